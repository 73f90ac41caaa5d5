"""Parity of gemma4 (sliding + full layers of different head dims, k = v, KV-shared layers, per-layer embeddings,
layer scalars; a variant with the MoE block) against HF transformers on tiny random checkpoints, text only, through
the real path: an HF directory (Gemma4ForConditionalGeneration), ignition's float32 export, helios.core.load, the
ModelRunner (the KV-shared layers read their source layer's pages; the sliding layers keep only their window's
pages in a window group) and the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.engine.messages import EngineRequest
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.gemma4_tiny import WINDOW, build_gemma4
from tests.models.hybrid_harness import (
    check_fused_loop_equals_eager,
    export_float32,
    greedy_request,
    hf_logits,
    prompt,
    window_engine,
)

PAGE, CHUNK, NUM_PAGES = 4, 8, 640


def export_gemma4(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint, exported in float32."""
    from transformers import Gemma4ForConditionalGeneration

    return export_float32(Gemma4ForConditionalGeneration, build_gemma4(root / "hf", variant), root)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return export_gemma4("base", tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return export_gemma4("moe", tmp_path_factory.mktemp("moe"))


def make_engine(core, window: bool, max_concurrency: int = 4, chunk: int = CHUNK, budget: int = 32) -> EngineCore:
    """window: the sliding layers' pages in a window group sized for max_concurrency requests; else one group."""
    return window_engine(core, max_concurrency, NUM_PAGES, chunk, budget, page_size=PAGE, window=window,
                         prefix_caching=False)


def generate(engine: EngineCore, reqs: list[EngineRequest], window_bound: int | None = None) -> dict[str, list[int]]:
    """Each request's tokens; with window_bound, asserts after every step that the window pool holds at most that many
    pages per running request (from the pool's counters) and returns the peak under the key "peak"."""
    out: dict = {r.req_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    peak = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
        if window_bound is not None:
            used = engine.scheduler.window_groups[0].pool.num_used_blocks
            assert used <= window_bound * max(1, engine.scheduler.num_running)
            peak = max(peak, used)
    assert engine.error is None
    return {**out, "peak": peak} if window_bound is not None else out


def test_the_export_is_gemma4(base, moe):
    for variant, (_, core) in {"base": base, "moe": moe}.items():
        arch = core.manifest.arch
        assert arch.family == "gemma4"
        assert arch.layer_types == ["sliding", "sliding", "full", "sliding", "sliding", "full"]
        assert (arch.head_dim, arch.num_kv_heads, arch.full_head_dim, arch.full_num_kv_heads) == (16, 2, 32, 1)
        assert arch.kv_sources == [0, 1, 2, 3, 3, 2] and arch.kv_layers == [0, 1, 2, 3]
        g = arch.gemma4
        assert (g.rotated_pairs, g.k_eq_v, g.double_wide_mlp, g.ple_dim) == (4, True, True, 8)
        assert (arch.moe is not None) == (variant == "moe")
        assert arch.query_scale == 1.0 and arch.final_logit_softcapping == 30.0 and arch.tie_word_embeddings


def test_shared_layers_read_their_source_pages_and_window_layers_hold_the_window_group(base):
    """Four KV tensors for six layers: the KV-shared layers 4 and 5 get layer 3's and layer 2's; the sliding ones
    (0, 1, 3) hold the window group's pages, the full ones every page, each at its own head shape."""
    _, core = base
    arch = core.manifest.arch
    runner = ModelRunner(arch, core.tensors, NUM_PAGES, PAGE, window_pages=12)
    assert KVCache.window_layers(arch) == [0, 1, 3]
    shapes = [tuple(t.shape) for t in runner.kv_cache.layers]
    assert shapes == [(2, 12, PAGE, 2, 16), (2, 12, PAGE, 2, 16), (2, NUM_PAGES, PAGE, 1, 32), (2, 12, PAGE, 2, 16)]
    caches, own = runner.layer_caches, runner.kv_cache.layers
    assert [next(j for j, t in enumerate(own) if t is c) for c in caches] == [0, 1, 2, 3, 3, 2]
    per_page = KVCache.bytes_per_page(arch, PAGE, torch.float32)
    assert per_page == PAGE * 4 * (3 * 2 * 2 * 16 + 2 * 1 * 32)  # shared layers cost nothing


@pytest.mark.parametrize("variant", ["base", "moe"])
def test_logits_and_prompt_logprobs_match(variant, request):
    """Last-position logits within 1e-4 of transformers, prompt log-softmax within 1e-4, chunked prefill = whole.
    NOTE: chunked = whole within 3e-5, not bit-exact: the torch backend's SDPA blocks a chunk's keys from its own
    window start, so the summation order (not the math) moves with the split."""
    hf, core = request.getfixturevalue(variant)
    ids = prompt(120)
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, 16)
    ref = hf_logits(hf, ids)
    whole = runner.forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(whole, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)
    torch.testing.assert_close(runner.forward_logits(ids, chunk_size=13), whole, atol=3e-5, rtol=0)


@pytest.mark.parametrize("variant", ["base", "moe"])
def test_greedy_through_the_window_group_matches_generate(variant, request):
    """Prompts batched through the engine whose window pool is the minimum they run in: each one's 32 greedy tokens
    are HF generate's (three prompts; the MoE variant, slower, one)."""
    hf, core = request.getfixturevalue(variant)
    prompts = {"a": prompt(37, seed=1), "b": prompt(20, seed=2), "c": prompt(9, seed=3)}
    prompts = prompts if variant == "base" else {"a": prompts["a"]}
    bound = window_pages_per_request(WINDOW, PAGE, CHUNK)
    engine = make_engine(core, window=True, max_concurrency=len(prompts))
    got = generate(engine, [greedy_request(k, ids, 32) for k, ids in prompts.items()], bound)
    for rid, ids in prompts.items():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist()
        assert got[rid] == ref[len(ids):], rid


def test_sixteen_requests_together_give_what_each_gives_alone(base):
    """Sixteen prompts in 8-token chunks beside each other's decodes (window group) = each alone in one chunk (one
    group; one request at a time through one engine without prefix caching)."""
    _, core = base
    reqs = [greedy_request(f"r{i}", prompt(5 + 4 * i, seed=10 + i), 12) for i in range(16)]
    together = generate(make_engine(core, window=True, max_concurrency=16, budget=64), reqs)
    alone = make_engine(core, window=False, max_concurrency=1, chunk=128, budget=128)
    for r in reqs:
        assert together[r.req_id] == generate(alone, [r])[r.req_id], r.req_id


def test_a_long_prompt_holds_no_more_window_pages_than_the_window_needs(base):
    """A prompt 15 windows long and 24 decodes: between steps the window pool holds at most ceil(W / P) + 1 pages
    (the keys the next query reads and a decode's look-ahead page; from the pool's counters, and reached) while
    group 0 keeps the full layers' pages; the tokens are the one-group engine's."""
    _, core = base
    bound = -(-WINDOW // PAGE) + 1
    req = greedy_request("long", prompt(120, seed=7), 24)
    engine = make_engine(core, window=True, max_concurrency=1)
    got = generate(engine, [req], window_bound=bound)
    assert got["peak"] == bound
    assert engine.scheduler.block_pool.num_used_blocks == 0  # everything returned at the finish
    assert got["long"] == generate(make_engine(core, window=False, max_concurrency=1), [req])["long"]


@pytest.mark.parametrize("name", ["e2b", "31b"])
def test_released_configs_match_transformers(name, tmp_path):
    """A config.json with a released model's keys (tiny sizes) exports, and its logits are transformers' (loaded
    from that same config): the E2B shape (PLE, KV sharing, no k = v) and the 31B shape (k = v, no PLE)."""
    from transformers import Gemma4ForConditionalGeneration

    from ignition.export import ExportOptions, export_core
    from tests.models.gemma4_tiny import build_released

    src = build_released(tmp_path / "hf", name)
    core = load_core(export_core(src, tmp_path / "core", ExportOptions(dtype="float32")))
    arch = core.manifest.arch
    assert (bool(arch.kv_sources), arch.gemma4.k_eq_v, arch.gemma4.ple_dim) == {
        "e2b": (True, False, 8), "31b": (False, True, 0)}[name]
    assert arch.full_head_dim == 32 and arch.full_num_kv_heads == (1 if name == "31b" else None)
    hf = Gemma4ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    ids = prompt(40, seed=3)
    got = ModelRunner(arch, core.tensors, 16, 16).forward_logits(ids)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_a_proportional_rope_factor_matches_transformers(tmp_path):
    """The full layers' proportional rope with a factor (every turning frequency divided by it) and a rotated share
    of one half: logits = transformers'."""
    from transformers import Gemma4ForConditionalGeneration

    from ignition.export import ExportOptions, export_core

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 8.0,
                               "rope_theta": 100_000.0}}
    src = build_gemma4(tmp_path / "hf", "base", rope_parameters=rope)
    core = load_core(export_core(src, tmp_path / "core", ExportOptions(dtype="float32")))
    assert (core.manifest.arch.gemma4.rotated_pairs, core.manifest.arch.gemma4.rope_factor) == (8, 8.0)
    hf = Gemma4ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    ids = prompt(60, seed=4)
    got = ModelRunner(core.manifest.arch, core.tensors, 16, 16).forward_logits(ids)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")
def test_graphed_decode_on_the_triton_backend_gives_the_eager_tokens(base):
    """The GPU path on the CPU: the Triton attention backend (interpreter) under the decode graphs' function
    (GraphRunner(capture=False), the runner's per-layer caches: KV-shared layers read their source's pages inside it)
    with the speculative next step and the window group = the eager torch engine's tokens."""
    _, core = base
    arch, window_pages = core.manifest.arch, 3 * window_pages_per_request(WINDOW, PAGE, 16)
    config = SchedulerConfig(max_concurrency=3, max_num_batched_tokens=16, prefill_chunk_size=16, page_size=PAGE,
                             num_pages=96, max_model_len=256, sliding_window=WINDOW, window_pages=window_pages)
    runner = ModelRunner(arch, core.tensors, 96, PAGE, max_model_len=256, attention_backend="triton",
                         decode_overlap=True, window_pages=window_pages)
    runner.graphs = runner.make_graphs([1, 2, 4], capture=False)
    reqs = [greedy_request(f"r{i}", prompt(n, seed=i), 10) for i, n in enumerate((5, 11, 17))]
    got = generate(EngineCore(config, runner), reqs)
    assert got == generate(make_engine(core, window=False), reqs)
    assert runner.launches["graph"] > 0 and runner.overlap_hits > 0, (runner.launches, runner.overlap_hits)


def use_triton_path(model) -> None:
    """What the Triton backend picks for a gemma4 model: every norm module as its kernel, the fused layer loop."""
    from helios.models import use_layer_kernels

    use_layer_kernels(model, True)
    model.path = "fused"


@pytest.mark.parametrize("variant", ["base", "moe"])
def test_the_fused_path_gives_the_eager_paths_logits(variant, request):
    """The Triton path's layer loop (interpreter) over the torch backend's attention: q and k rotated in one launch
    (a KV-shared layer's q alone), v's weightless norm a kernel, each post-norm, residual add, layer scalar and next
    norm in one launch (Gemma4DecoderLayer.forward_fused; the PLE branch and the MoE block's sum between) = the eager
    loop's logits."""
    _, core = request.getfixturevalue(variant)
    check_fused_loop_equals_eager(core, fuse=use_triton_path, is_fused=lambda model: model.path == "fused")
