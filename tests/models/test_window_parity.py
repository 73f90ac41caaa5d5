"""gemma3 with its sliding layer's pages in a window group (helios/engine/kv_groups.py) against HF transformers, through
the real path: ignition's float32 export, the ModelRunner with window_pages (the sliding layer's KV tensor holds
only those pages, indexed by the group's own tables), and the engine returning the pages before the window.
Greedy tokens = HF generate, logits and logprobs = the one-group runner's, and the memory bound from the pool."""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.engine.messages import EngineRequest, SamplingParams
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.test_parity import FAMILIES, export_tiny, hf_logits, prompt

PAGE, WINDOW, CHUNK = 4, FAMILIES["gemma3"]["sliding_window"], 8
NUM_PAGES = 128


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return export_tiny("gemma3", tmp_path_factory.mktemp("gemma3"), **FAMILIES["gemma3"])


def make_engine(core, window_pages: int | None, max_concurrency: int = 4, prefix_caching: bool = True,
                chunk: int = CHUNK) -> EngineCore:
    """window_pages None: one group (every layer keeps every page), the reference."""
    groups = dict(sliding_window=WINDOW, window_pages=window_pages) if window_pages else {}
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=max(chunk, max_concurrency) * 2,
                             prefill_chunk_size=chunk, page_size=PAGE, num_pages=NUM_PAGES,
                             max_model_len=NUM_PAGES * PAGE, enable_prefix_caching=prefix_caching, **groups)
    runner = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE, window_pages=window_pages or 0)
    return EngineCore(config, runner)


def greedy(req_id: str, ids: list[int], max_tokens: int = 32, **kw) -> EngineRequest:
    return EngineRequest(req_id=req_id, prompt_token_ids=ids,
                         sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw))


def run(engine: EngineCore, requests: list[EngineRequest], bound: int | None = None) -> dict:
    """{req_id: [outputs]}; with `bound`, asserts the window pool holds at most that many pages per running request
    after every step (from its counters)."""
    outs = {r.req_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.req_id].append(o)
        if bound is not None:
            pool = engine.scheduler.window_groups[0].pool
            assert pool.num_used_blocks <= bound * max(1, engine.scheduler.num_running)
    return outs


def tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_the_sliding_layer_keeps_only_the_window_pages(gemma3):
    _, core = gemma3
    arch = core.manifest.arch
    runner = ModelRunner(arch, core.tensors, NUM_PAGES, PAGE, window_pages=6)
    assert KVCache.window_layers(arch) == [0] and arch.layer_types == ["sliding", "full"]
    assert [t.shape[1] for t in runner.kv_cache.layers] == [6, NUM_PAGES]
    assert runner.startup.graphs == "CPU"


def test_forward_logits_through_a_cyclic_window_table_match_hf(gemma3):
    """40 tokens over a 4-page window group in chunks of 5: the table reuses pages whose keys left the window."""
    hf, core = gemma3
    ids = prompt(40)
    minimum = window_pages_per_request(WINDOW, PAGE, 5)
    grouped = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE, window_pages=minimum)
    single = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE)
    ours = grouped.forward_logits(ids, chunk_size=5)
    torch.testing.assert_close(ours, single.forward_logits(ids, chunk_size=5), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="window pages"):
        grouped.forward_logits(ids)  # one 40-token chunk reads more pages than the group has


def test_engine_greedy_with_page_freeing_matches_generate(gemma3):
    """Four prompts batched through the engine whose window pool is the minimum four requests can run in: each
    request's 32 greedy tokens are HF generate's, and no request ever holds more window pages than one step needs."""
    hf, core = gemma3
    per_request = window_pages_per_request(WINDOW, PAGE, CHUNK)
    engine = make_engine(core, window_pages=4 * per_request)
    prompts = [prompt(n, seed=s) for n, s in ((20, 1), (33, 2), (9, 3), (27, 4))]
    outs = run(engine, [greedy(f"r{i}", p) for i, p in enumerate(prompts)], bound=per_request)
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist()
        assert tokens(outs[f"r{i}"]) == ref[len(ids):], i
    pool = engine.scheduler.window_groups[0].pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_logprobs_and_prompt_logprobs_are_the_one_group_engines(gemma3):
    _, core = gemma3
    reqs = [greedy("a", prompt(30, seed=5), max_tokens=12, logprobs=3, prompt_logprobs=2),
            greedy("b", prompt(14, seed=6), max_tokens=12, logprobs=3)]
    got = run(make_engine(core, window_pages=32), reqs)
    want = run(make_engine(core, window_pages=None), reqs)
    for rid in ("a", "b"):
        assert tokens(got[rid]) == tokens(want[rid])
        ours = [(p.token.token_id, p.token.logprob) for o in got[rid] for p in (o.logprobs or [])]
        ref = [(p.token.token_id, p.token.logprob) for o in want[rid] for p in (o.logprobs or [])]
        assert [t for t, _ in ours] == [t for t, _ in ref] and len(ours) == 12
        assert max(abs(x - y) for (_, x), (_, y) in zip(ours, ref)) < 1e-5
    ours = [p.token.logprob for o in got["a"] for p in (o.prompt_logprobs or [])]
    ref = [p.token.logprob for o in want["a"] for p in (o.prompt_logprobs or [])]
    assert len(ours) == 29 and max(abs(x - y) for x, y in zip(ours, ref)) < 1e-5


def test_a_long_prompt_holds_no_more_window_pages_than_the_window_needs(gemma3):
    """200 prompt tokens and 40 decodes: between steps the window pool holds at most ceil(W / P) + 1 pages (the
    positions n - W + 1 .. n the next query reads, and a decode's look-ahead page), while group 0 holds them all;
    the tokens are the one-group engine's."""
    _, core = gemma3
    bound = -(-WINDOW // PAGE) + 1
    engine = make_engine(core, window_pages=window_pages_per_request(WINDOW, PAGE, CHUNK), max_concurrency=1)
    req = greedy("long", prompt(200, seed=7), max_tokens=40)
    engine.add_request(req)
    sched, outs, peak = engine.scheduler, [], 0
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
        peak = max(peak, sched.window_groups[0].pool.num_used_blocks)
        assert sched.window_groups[0].pool.num_used_blocks <= bound
        if sched.running:
            assert sched.block_pool.num_used_blocks >= sched.running[0].num_computed_tokens // PAGE
    assert peak == bound
    assert tokens(outs) == tokens(run(make_engine(core, window_pages=None, max_concurrency=1), [req])["long"])


def test_a_repeated_prompt_reuses_both_groups_pages(gemma3):
    _, core = gemma3
    engine = make_engine(core, window_pages=32)
    ids = prompt(37, seed=8)
    first = run(engine, [greedy("a", ids, max_tokens=10)])["a"]
    second = run(engine, [greedy("b", ids, max_tokens=10)])["b"]
    assert second[-1].num_cached_tokens == 36 and tokens(second) == tokens(first)


def test_compose_gives_a_full_and_sliding_model_a_window_group(gemma3):
    """build_engine: the window group sized for every model slot's window and chunk (at most group 0's pages), the
    runner's sliding layer on it, the host tier off beside it; a served request matches HF greedy."""
    from helios.compose import build_engine
    from helios.server.config import ServerConfig
    from helios.server.runtime import resolve_serving

    hf, core = gemma3
    config = ServerConfig(kv_cache_tokens=1024, host_cache_bytes=1 << 20, max_concurrency=2)
    serving = resolve_serving(core.manifest, config)
    engine, runner = build_engine(core, config, serving, own_thread=False)
    try:
        sched = engine.core.scheduler
        per_request = window_pages_per_request(WINDOW, sched.config.page_size, sched.config.prefill_chunk_size)
        assert sched.config.sliding_window == WINDOW
        assert sched.config.window_pages == min(2 * per_request, sched.config.num_pages) >= per_request
        assert runner.window_pages == sched.config.window_pages and sched.host_cache is None
        ids = prompt(21, seed=9)
        engine.core.add_request(greedy("a", ids, max_tokens=8))
        got = []
        while engine.core.has_unfinished_requests():
            got.extend(t for o in engine.core.step() for t in o.new_token_ids)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist()
        assert got == ref[len(ids):]
    finally:
        engine.shutdown()
