"""Parity of deepseek_v4 (sliding / CSA / HCA shared-KV MQA with sinks + mHC streams + hash- and score-routed clamped
experts) against HF transformers on a tiny random checkpoint, through the real path: an HF directory
(DeepseekV4ForCausalLM), ignition's float32 export, helios.core.load, the ModelRunner with its per-token rows in
pages, and the engine (continuous batching, chunked prefill at any boundary, prefix reuse). Prompts run far past the
window (8) and the indexer's budget (3 entries of 4 tokens), so most keys are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.deepseek_v4_tiny import build_deepseek_v4
from tests.models.hybrid_harness import PAGE_SIZE, generate, greedy_request, hf_logits, prompt, run_collecting


def export_deepseek_v4(root: Path):
    """(HF model, LoadedCore) of the tiny checkpoint."""
    from transformers import DeepseekV4ForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_deepseek_v4(root / "hf")
    core = load_core(export_core(src, root / "core", ExportOptions(dtype="float32", prompt_logprobs=True)))
    return DeepseekV4ForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), core


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    return export_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4"))


def make_engine(core, max_concurrency: int = 16, num_pages: int = 256, chunk: int = 64, budget: int = 128,
                prefix_caching: bool = False) -> EngineCore:
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget, prefill_chunk_size=chunk,
                             page_size=PAGE_SIZE, num_pages=num_pages, max_model_len=num_pages * PAGE_SIZE,
                             enable_prefix_caching=prefix_caching)
    return EngineCore(config, ModelRunner(core.manifest.arch, core.tensors, num_pages, PAGE_SIZE))


def test_the_export_is_deepseek_v4(dsv4):
    _, core = dsv4
    arch = core.manifest.arch
    c = arch.compressed
    assert arch.family == "deepseek_v4" and arch.num_kv_heads == 1 and arch.layer_types == []
    assert c.layer_kinds == ["sliding", "csa", "hca", "csa"] and (c.csa_rate, c.hca_rate, c.window) == (4, 8, 8)
    assert c.rope_dim == 8 and c.compress_rope_scaling.type == "yarn" and c.index_topk == 3
    assert arch.moe.hash_layers == [0, 1] and arch.moe.scoring == "sqrtsoftplus" and arch.mhc.num_streams == 2
    assert core.tensors["layers.0.moe.tid2eid"].dtype == torch.int32


def test_the_runner_keeps_one_row_per_token_and_layer(dsv4):
    """Each layer's pages hold rows of its kind's width: sliding its kv (32 values); HCA kv, the compressor's kv and
    gate rows, the window's entry (4 * 32); CSA kv, the compressor's 2d-wide kv and gate rows, the indexer's, the
    window's entry and index key (6 * 32 + 5 * 16)."""
    _, core = dsv4
    arch = core.manifest.arch
    runner = ModelRunner(arch, core.tensors, 8, PAGE_SIZE)
    widths = [32, 272, 128, 272]
    assert [tuple(t.shape) for t in runner.kv_cache.layers] == [(1, 8, PAGE_SIZE, w) for w in widths]
    assert KVCache.bytes_per_page(arch, PAGE_SIZE, torch.float32) == PAGE_SIZE * sum(widths) * 4
    assert runner.layer_caches == runner.kv_cache.layers


def test_logits_and_prompt_logprobs_match(dsv4):
    """Last-position logits within 1e-4 of transformers, chunks (7 tokens: windows and compression groups split
    anywhere) the same rows as the whole prompt within 1e-5, prompt log-softmax within 1e-4."""
    hf, core = dsv4
    ids = prompt(150)
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE)
    ref = hf_logits(hf, ids)
    whole = runner.forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(runner.forward_logits(ids, chunk_size=7), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.log_softmax(whole, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)


def test_the_indexer_drops_entries(dsv4, monkeypatch):
    """The CSA selection keeps index_topk (3) of the visible entries: at 150 tokens most are dropped."""
    from helios.layers import compressed_attention as ca

    _, core = dsv4
    kept: list[torch.Tensor] = []
    select = ca.LightningIndexer.select

    def spy(self, q, weights, keys, thresholds):
        mask = select(self, q, weights, keys, thresholds)
        kept.append(mask.sum(-1))
        return mask

    monkeypatch.setattr(ca.LightningIndexer, "select", spy)
    ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE).forward_logits(prompt(150))
    counts = torch.cat(kept)
    assert counts.max() == 3 and (counts == 3).sum() > 200


def test_greedy_matches_generate(dsv4):
    hf, core = dsv4
    ids = prompt(90, seed=5)
    got = generate(make_engine(core), [greedy_request("a", ids, 32)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


def test_sixteen_requests_together_give_what_each_gives_alone(dsv4):
    """A 128-token budget: long prompts split into chunks beside the others' decodes."""
    _, core = dsv4
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    together = generate(make_engine(core), reqs)
    single = make_engine(core, max_concurrency=1, budget=512, chunk=512)  # one request at a time, no reuse
    for r in reqs:
        assert together[r.req_id] == generate(single, [r])[r.req_id], r.req_id


def test_a_second_turn_reuses_the_first_turns_pages(dsv4):
    """Prefix reuse needs no state: the pages hold every row the window and the compressors read."""
    _, core = dsv4
    engine = make_engine(core, max_concurrency=4, prefix_caching=True)
    first = greedy_request("t1", prompt(100, seed=21), 20)
    history = first.prompt_token_ids + generate(engine, [first])["t1"]
    second = greedy_request("t2", history + prompt(30, seed=22), 16)
    tokens, cached = run_collecting(engine, second)
    assert cached == (len(history) // PAGE_SIZE) * PAGE_SIZE
    assert tokens == generate(make_engine(core, max_concurrency=4), [second])["t2"]
