"""Parity of mimo_v2_flash (full and sliding GQA layers, the sliding ones with twice the KV heads and attention sinks,
q/k heads wider than v heads, partial rotary with a rope base per layer type, V scaled, a dense first MLP and
group-limited sigmoid-routed experts without a shared expert) against HF transformers on a tiny random checkpoint,
through the real path: an HF directory, ignition's float32 export, helios.core.load, the ModelRunner (per-layer KV
shapes, the sliding layers' pages in a window group) and the engine. Prompts run far past the 17-token window."""

from __future__ import annotations

import pytest
import torch

from helios.engine.kv_groups import window_pages_per_request
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.hybrid_harness import (
    PAGE_SIZE,
    check_batched_equals_alone,
    check_fused_loop_equals_eager,
    check_greedy_matches_generate,
    check_logits_and_prompt_logprobs,
    export_float32,
    hf_logits,
    prompt,
)
from tests.models.mimo_v2_flash_tiny import build_mimo

WINDOW = 17


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """(HF model, LoadedCore) of the tiny checkpoint."""
    from transformers import MiMoV2FlashForCausalLM

    root = tmp_path_factory.mktemp("mimo_v2_flash")
    return export_float32(MiMoV2FlashForCausalLM, build_mimo(root / "hf"), root)


def test_the_export_is_mimo_v2_flash(mimo):
    _, core = mimo
    arch = core.manifest.arch
    assert arch.family == "mimo_v2_flash" and arch.layer_types == ["full", "sliding", "sliding", "full"]
    assert (arch.num_kv_heads, arch.sliding_num_kv_heads, arch.head_dim, arch.v_head_dim) == (2, 4, 24, 16)
    assert (arch.sliding_window, arch.rotary_dim, arch.attention_sinks) == (WINDOW, 8, ["sliding"])
    assert (arch.rope_theta, arch.rope_local_theta) == (5_000_000.0, 10_000.0)
    assert arch.moe.dense_layers == [0] and arch.moe.shared_expert_intermediate_size == 0
    assert core.tensors["layers.1.attn.sinks"].shape == (8,) and "layers.0.attn.sinks" not in core.tensors


def test_each_layer_keeps_its_own_kv_shape_and_the_window_its_own_pages(mimo):
    """Full layers keep 2 KV heads, sliding ones 4, V padded to the q/k head_dim; the sliding layers' tensors hold
    only the window group's pages; the page bytes count each layer's own shape."""
    _, core = mimo
    arch = core.manifest.arch
    runner = ModelRunner(arch, core.tensors, 32, PAGE_SIZE, window_pages=6)
    shapes = [tuple(t.shape) for t in runner.kv_cache.layers]
    assert shapes == [(2, 32, PAGE_SIZE, 2, 24), (2, 6, PAGE_SIZE, 4, 24), (2, 6, PAGE_SIZE, 4, 24),
                      (2, 32, PAGE_SIZE, 2, 24)]
    assert KVCache.window_layers(arch) == [1, 2]
    per_layer = [2 * 2 * 24, 2 * 4 * 24, 2 * 4 * 24, 2 * 2 * 24]
    assert KVCache.bytes_per_page(arch, PAGE_SIZE, torch.float32) == sum(per_layer) * PAGE_SIZE * 4
    assert KVCache.bytes_per_page(arch, PAGE_SIZE, torch.float32, layers=[1, 2]) == 2 * 2 * 4 * 24 * PAGE_SIZE * 4


def test_logits_and_prompt_logprobs_match(mimo):
    hf, core = mimo
    check_logits_and_prompt_logprobs(hf, core, prompt(100))


def test_forward_logits_through_a_cyclic_window_table_match_hf(mimo):
    """60 tokens in chunks of 5 over the fewest window pages a request may hold (3, 48 positions): the table reuses
    pages whose keys left the window, and every row equals the one-group runner's."""
    hf, core = mimo
    ids = prompt(60, seed=4)
    fewest = window_pages_per_request(WINDOW, PAGE_SIZE, 5)
    grouped = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, window_pages=fewest)
    single = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE)
    ours = grouped.forward_logits(ids, chunk_size=5)
    torch.testing.assert_close(ours, single.forward_logits(ids, chunk_size=5), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[-1], hf_logits(hf, ids)[-1], atol=1e-4, rtol=0)


def test_greedy_matches_generate(mimo):
    hf, core = mimo
    check_greedy_matches_generate(hf, core, prompt(90, seed=5))


def test_sixteen_requests_together_give_what_each_gives_alone(mimo):
    _, core = mimo
    check_batched_equals_alone(core, [prompt(5 + 7 * i, seed=10 + i) for i in range(16)])


def test_the_fused_path_gives_the_eager_paths_logits(mimo):
    """The GPU path's layer loop (MiMoV2FlashLayer.forward_fused through pre_norm_stack: each residual add taken by
    the next norm's launch, each layer turning by its own rope) = the eager loop's logits."""
    check_fused_loop_equals_eager(mimo[1], fuse=lambda model: setattr(model, "path", "fused"),
                                  is_fused=lambda model: model.path == "fused")
