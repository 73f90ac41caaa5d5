"""A window page group's tables in the runner (helios/engine/kv_groups.py): prepare_batch gives the metadata the
group's own block tables and KV slots (entries the engine took back: page 0, never read), AttentionMetadata.for_window
hands a layer of that window its group's view, and KVCache gives the window layers their own page count."""

from __future__ import annotations

import pytest
import torch

from helios.engine.messages import ScheduledRequest
from helios.runner.input_batch import prepare_batch

PAGE = 4


def chunk(num_computed: int, num_tokens: int, blocks: list[int], window_blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(req_id="a", token_ids=list(range(1, num_tokens + 1)), num_computed_tokens=num_computed,
                            block_ids=blocks, group_block_ids=[window_blocks], sample=True)


def test_prepare_batch_gives_the_window_group_its_tables_and_slots():
    scheduled = [chunk(13, 3, [7, 3, 9, 4], [-1, -1, 5, 2]), chunk(2, 3, [6, 1], [8, 0])]
    meta = prepare_batch(scheduled, {}, PAGE, window=6).meta
    tables, slots = meta.window_groups[6]
    assert tables.shape == meta.block_tables.shape and tables.dtype == torch.int32
    assert tables[0, :4].tolist() == [0, 0, 5, 2] and tables[1, :2].tolist() == [8, 0]
    assert slots.tolist() == [2 * PAGE + 1, 2 * PAGE + 2, 2 * PAGE + 3, 8 * PAGE + 2, 8 * PAGE + 3, 0 * PAGE + 0]
    assert meta.slot_mapping.tolist() == [4 * PAGE + 1, 4 * PAGE + 2, 4 * PAGE + 3, 6 * PAGE + 2, 6 * PAGE + 3, 4]
    view = meta.for_window(6)
    assert view.block_tables is tables and view.slot_mapping is slots and view.positions is meta.positions
    assert meta.for_window(6) is view and view.for_window(6) is view  # one view per step, derived once
    assert meta.for_window(None) is meta and meta.for_window(5) is meta  # another window: the shared tables
    assert not prepare_batch(scheduled, {}, PAGE).meta.window_groups  # a one-group model: none


def test_a_window_table_without_its_chunks_page_is_refused():
    with pytest.raises(ValueError, match="window table"):
        prepare_batch([chunk(8, 1, [7, 3, 9], [-1, -1, -1])], {}, PAGE, window=4)


def test_the_window_layers_hold_their_own_pages():
    from helios.core.manifest import Architecture
    from helios.runner.kv_cache import KVCache

    common = dict(family="gemma3", hidden_size=64, num_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                  vocab_size=97, intermediate_size=80, num_kv_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=True)
    arch = Architecture(num_layers=3, sliding_window=8, layer_types=["sliding", "full", "sliding"], **common)
    assert KVCache.window_layers(arch) == [0, 2]
    cache = KVCache.from_arch(arch, 20, PAGE, torch.float32, "cpu", window_pages=6)
    assert [t.shape[1] for t in cache.layers] == [6, 20, 6] and cache.num_pages == 20
    assert [t.shape[1] for t in KVCache.from_arch(arch, 20, PAGE, torch.float32, "cpu").layers] == [20] * 3
    only_sliding = Architecture(num_layers=2, sliding_window=8, layer_types=["sliding", "sliding"], **common)
    assert KVCache.window_layers(only_sliding) == []  # nothing to keep apart from: one group, every page
    assert KVCache.bytes_per_page(arch, PAGE, torch.float32, 1) * 3 == KVCache.bytes_per_page(arch, PAGE, torch.float32)
