"""Parity of deepseek_v4 (sliding / CSA / HCA shared-KV MQA with sinks + mHC streams + hash- and score-routed clamped
experts) against HF transformers on a tiny random checkpoint, through the real path: an HF directory
(DeepseekV4ForCausalLM), ignition's float32 export, helios.core.load, the ModelRunner with its per-token rows in
pages, and the engine (continuous batching, chunked prefill at any boundary, prefix reuse). Prompts run far past the
window (8) and the indexer's budget (3 entries of 4 tokens), so most keys are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.engine.kv_groups import window_pages_per_request
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.deepseek_v4_tiny import build_deepseek_v4
from tests.models.hybrid_harness import (
    PAGE_SIZE,
    check_greedy_matches_generate,
    export_float32,
    generate,
    greedy_request,
    hf_logits,
    prompt,
    run_collecting,
    window_engine,
)


def export_deepseek_v4(root: Path):
    """(HF model, LoadedCore) of the tiny checkpoint."""
    from transformers import DeepseekV4ForCausalLM

    return export_float32(DeepseekV4ForCausalLM, build_deepseek_v4(root / "hf"), root)


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    return export_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4"))


def test_the_export_is_deepseek_v4(dsv4):
    _, core = dsv4
    arch = core.manifest.arch
    c = arch.compressed
    assert arch.family == "deepseek_v4" and arch.num_kv_heads == 1 and arch.layer_types == []
    assert c.layer_kinds == ["sliding", "csa", "hca", "csa"] and (c.csa_rate, c.hca_rate, c.window) == (4, 8, 8)
    assert c.rope_dim == 8 and c.compress_rope_scaling.type == "yarn" and c.index_topk == 3
    assert arch.moe.hash_layers == [0, 1] and arch.moe.scoring == "sqrtsoftplus" and arch.mhc.num_streams == 2
    assert core.tensors["layers.0.moe.tid2eid"].dtype == torch.int32


def test_the_runner_keeps_raw_rows_in_the_window_group_and_entries_in_every_page(dsv4):
    """Per layer: the raw rows (sliding: its kv, 32 values; HCA: kv and the compressor's kv and gate rows, 3 * 32;
    CSA: kv, the compressor's 2d-wide rows, the indexer's, 5 * 32 + 4 * 16) in the window group's pages, and its
    window's entry spread over the window's rows (HCA 32 / 8, CSA (32 + 16) / 4 values) in every page."""
    _, core = dsv4
    arch = core.manifest.arch
    assert KVCache.window_layers(arch) == [0, 1, 2, 3] and arch.sliding_window == 8
    runner = ModelRunner(arch, core.tensors, 64, PAGE_SIZE, window_pages=6)
    raw, shares = [32, 224, 96, 224], [0, 12, 4, 12]
    assert [tuple(t.shape) for t in runner.kv_cache.layers] == [(1, 6, PAGE_SIZE, w) for w in raw]
    assert [tuple(t.shape) for t in runner.kv_cache.index_layers] == [(1, 64, PAGE_SIZE, e) for e in shares]
    assert KVCache.compressed_bytes_per_page(arch, PAGE_SIZE, torch.float32) == (
        PAGE_SIZE * sum(raw) * 4, PAGE_SIZE * sum(shares) * 4)
    one_group = ModelRunner(arch, core.tensors, 8, PAGE_SIZE)
    assert [t.shape[1] for t in one_group.kv_cache.paged_tensors] == [8] * 8
    assert KVCache.bytes_per_page(arch, PAGE_SIZE, torch.float32) == PAGE_SIZE * (sum(raw) + sum(shares)) * 4


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
    # the raw rows in a window group of the fewest pages chunks of 7 need, its table reusing pages cyclically
    fewest = window_pages_per_request(core.manifest.arch.sliding_window, PAGE_SIZE, 7)
    windowed = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, window_pages=fewest)
    torch.testing.assert_close(windowed.forward_logits(ids, chunk_size=7), whole, atol=1e-5, rtol=0)


def test_a_long_prefill_runs_in_query_blocks(dsv4, monkeypatch):
    """Scores capped at 3000 floats: the prompt's queries attend in blocks of a few, each seeing its sequence cut
    after it; the logits are the unblocked ones."""
    from helios.layers import compressed_attention as ca

    _, core = dsv4
    ids = prompt(60, seed=4)
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE)
    whole = runner.forward_logits(ids)
    monkeypatch.setattr(ca, "_MAX_SCORES", 3000)
    torch.testing.assert_close(runner.forward_logits(ids), whole, atol=1e-5, rtol=0)


def test_the_selection_is_hfs_and_drops_entries(dsv4, monkeypatch):
    """Each query's selected CSA entries equal HF's indexer output, whole and over chunks of 7; at 150 tokens most
    visible entries are dropped (3 kept)."""
    from helios.layers import compressed_attention as ca

    hf, core = dsv4
    ids = prompt(150, seed=3)
    want, hooks = [], []

    def record(module, args, kwargs, out):  # out: [1, S, k] entry ids, -1 unused
        idx, n = out[0].long(), len(ids) // 4
        hit = torch.zeros(idx.shape[0], n + 1, dtype=torch.bool)
        want.append(hit.scatter_(1, torch.where(idx >= 0, idx, n), True)[:, :n])

    for layer in hf.model.layers:
        if getattr(layer.self_attn.compressor, "indexer", None) is not None:
            hooks.append(layer.self_attn.compressor.indexer.register_forward_hook(record, with_kwargs=True))
    hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    got: list[torch.Tensor] = []
    select = ca.LightningIndexer.select

    def spy(self, q, weights, keys, visible):
        mask = select(self, q, weights, keys, visible)
        got.append(mask[0])
        return mask

    monkeypatch.setattr(ca.LightningIndexer, "select", spy)
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE)
    for chunk in (None, 7):
        got.clear()
        runner.forward_logits(ids, chunk_size=chunk)
        for j, ref in enumerate(want):  # chunks come layer by layer: chunk c of CSA layer j is got[c * 2 + j]
            rows = torch.cat([torch.nn.functional.pad(m, (0, ref.shape[1] - m.shape[1])) for m in got[j::2]])
            assert torch.equal(rows, ref), (chunk, j)
    kept = want[0].sum(-1)
    assert kept.max() == 3 and (kept == 3).sum() > 100


def test_greedy_matches_generate(dsv4):
    """Through the window-group engine compose builds, and through one group."""
    hf, core = dsv4
    ids = prompt(90, seed=5)
    check_greedy_matches_generate(hf, core, ids, engine=window_engine)
    check_greedy_matches_generate(hf, core, ids, engine=lambda c: window_engine(c, window=False))


def test_sixteen_requests_together_give_what_each_gives_alone(dsv4):
    """A 128-token budget: long prompts split into chunks beside the others' decodes."""
    _, core = dsv4
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    engine = window_engine(core, prefix_caching=False)
    bound = -(-core.manifest.arch.sliding_window // PAGE_SIZE) + 1  # window pages a request holds between steps
    together = {r.req_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            together[o.req_id].extend(o.new_token_ids)
        sched = engine.scheduler
        assert sched.window_groups[0].pool.num_used_blocks <= bound * max(1, sched.num_running)
    single = window_engine(core, max_concurrency=1, budget=512, chunk=512, prefix_caching=False)  # one at a time
    for r in reqs:
        assert together[r.req_id] == generate(single, [r])[r.req_id], r.req_id


def test_a_second_turn_reuses_the_first_turns_pages(dsv4):
    """Prefix reuse needs no state: group 0's pages hold the entries, the window group's the rows the window and the
    compressors read."""
    _, core = dsv4
    engine = window_engine(core, max_concurrency=4)
    first = greedy_request("t1", prompt(100, seed=21), 20)
    history = first.prompt_token_ids + generate(engine, [first])["t1"]
    second = greedy_request("t2", history + prompt(30, seed=22), 16)
    tokens, cached = run_collecting(engine, second)
    assert cached == (len(history) // PAGE_SIZE) * PAGE_SIZE
    assert tokens == generate(window_engine(core, max_concurrency=4, prefix_caching=False), [second])["t2"]


def test_a_page_shared_through_the_prefix_cache_is_never_written(dsv4):
    """Pages of 4 tokens, HCA windows of 8: a window's entry lives in its last 4 rows, the page of its last token.
    A request that reuses a cached first page and completes the window on its own tokens writes only its own page,
    so the cached page still serves the first prompt exactly."""
    _, core = dsv4
    engine = window_engine(core, max_concurrency=2, page_size=4)
    a = prompt(30, seed=41)
    first, _ = run_collecting(engine, greedy_request("a", a, 8))
    assert run_collecting(engine, greedy_request("b", a[:4] + prompt(26, seed=42), 8))[1] == 4
    again, cached = run_collecting(engine, greedy_request("a2", a, 8))
    assert cached == 28 and again == first
    alone = window_engine(core, max_concurrency=1, page_size=4, prefix_caching=False)
    assert first == generate(alone, [greedy_request("x", a, 8)])["x"]


def test_compose_keeps_the_raw_rows_in_a_window_group(dsv4):
    """build_engine: every layer's raw rows on a window group sized for every model slot's window and chunk, the
    host tier off beside it; a served request matches HF greedy."""
    from helios.compose import build_engine
    from helios.server.config import ServerConfig
    from helios.server.runtime import resolve_serving

    hf, core = dsv4
    config = ServerConfig(kv_cache_tokens=1024, host_cache_bytes=1 << 20, max_concurrency=2)
    engine, runner = build_engine(core, config, resolve_serving(core.manifest, config), own_thread=False)
    try:
        sched = engine.core.scheduler
        assert sched.config.sliding_window == 8 and runner.window_pages == sched.config.window_pages > 0
        assert [t.shape[1] for t in runner.kv_cache.layers] == [runner.window_pages] * 4 and sched.host_cache is None
        ids = prompt(21, seed=9)
        got = generate(engine.core, [greedy_request("a", ids, 8)])["a"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist()
        assert got == ref[len(ids):]
    finally:
        engine.shutdown()


def test_decode_steps_on_the_triton_backend_give_the_torch_logits(dsv4):
    """Every position fed as a one-token decode step on the Triton backend (the kernels in the interpreter: the
    interleaved ropes, the compressors' entries written where a token completes a window, the index scores and the
    sink attention) = the torch runner's float32 logits of the whole prompt, within 1e-4; 24 tokens: CSA windows
    complete and entries are dropped (3 kept), HCA windows complete."""
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()
    _, core = dsv4
    arch, ids = core.manifest.arch, prompt(24, seed=7)
    want = ModelRunner(arch, core.tensors, 16, PAGE_SIZE, attention_backend="torch").forward_logits(ids)
    runner = ModelRunner(arch, core.tensors, 16, PAGE_SIZE, attention_backend="triton")
    torch.testing.assert_close(runner.forward_logits(ids, chunk_size=1), want, atol=1e-4, rtol=1e-4)
