"""Parity of step3p7 (full and sliding-window layers with their own query heads, rope bases and rotary widths, a
per-head output gate, dense and sigmoid-routed MoE layers with a shared expert, per-layer SwiGLU clamps) against HF
transformers on tiny random checkpoints, text only, through the real path: an HF directory
(Step3p7ForConditionalGeneration), ignition's float32 export, helios.core.load, the ModelRunner with the sliding
layers' pages in a window group (helios/engine/kv_groups.py), and the engine returning the pages before the window.
Prompts run far past the 8-token window and the 4-token pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.hybrid_harness import (
    check_batched_equals_alone,
    check_greedy_matches_generate,
    export_float32,
    hf_logits,
    prompt,
    window_engine,
)
from tests.models.step3p7_tiny import VARIANTS, WINDOW, build_step3p7, step3p7_model

PAGE, CHUNK, NUM_PAGES = 4, 8, 1024


def export_step3p7(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint."""
    from transformers import Step3p7ForConditionalGeneration

    return export_float32(Step3p7ForConditionalGeneration, build_step3p7(root / "hf", variant), root)


@pytest.fixture(scope="module", params=VARIANTS)
def step(request, tmp_path_factory):
    hf, core = export_step3p7(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def make_engine(core, max_concurrency: int = 16, budget: int = 64, chunk: int = CHUNK) -> EngineCore:
    """The engine with the sliding layers' pages in a window group sized for every request's window and chunk."""
    return window_engine(core, max_concurrency, NUM_PAGES, chunk, budget, page_size=PAGE)


def test_the_export_is_step3p7(step):
    variant, _, core = step
    arch = core.manifest.arch
    want = {
        "base": dict(layer_types=["full", "sliding", "sliding", "full", "sliding"], num_heads=4, sliding_num_heads=6,
                     rotary_dim=8, sliding_rotary_dim=None, rope_theta=10000.0, rope_local_theta=500.0,
                     query_scale=24**-0.5, swiglu_limits=[0, 0, 0.4, 0, 0.3], swiglu_limits_shared=[0.3, 0, 0, 0.4, 0],
                     tie_word_embeddings=False),
        "native": dict(layer_types=["sliding", "full", "sliding", "sliding"], num_heads=4, sliding_num_heads=8,
                       rotary_dim=4, sliding_rotary_dim=None, rope_theta=10000.0, rope_local_theta=100.0,
                       query_scale=16**-0.5, swiglu_limits=[], swiglu_limits_shared=[], tie_word_embeddings=True),
    }[variant]
    assert {k: getattr(arch, k) for k in want} == want
    assert arch.family == "step3p7" and arch.attn_output_gate and arch.attn_gate_per_head
    assert arch.moe.dense_layers == ([0, 1] if variant == "base" else [0]) and arch.moe.scoring == "sigmoid"
    assert arch.rope_scaling.type == "llama3" and arch.rope_scaling.factor == (2.0 if variant == "base" else 4.0)
    # both layer kinds keep K/V of 2 heads of 16: one KV shape; the sliding layers' pages live in the window group
    runner = ModelRunner(arch, core.tensors, 32, PAGE, window_pages=12)
    sliding = KVCache.window_layers(arch)
    assert sliding == [i for i, t in enumerate(arch.layer_types) if t == "sliding"]
    assert [tuple(t.shape) for t in runner.kv_cache.layers] == [
        (2, 12 if i in sliding else 32, PAGE, 2, 16) for i in range(arch.num_layers)]


def test_logits_and_prompt_logprobs_match(step):
    """Last-position logits and the prompt's log-softmax within 1e-4 of transformers; chunks of 5 through a cyclic
    window group of the minimum size = the whole prompt through one group (5e-5: float32 rounding of products
    blocked by other row counts, on logits up to ~15)."""
    _, hf, core = step
    arch, ids = core.manifest.arch, prompt(90)
    ref = hf_logits(hf, ids)
    whole = ModelRunner(arch, core.tensors, 64, PAGE).forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(whole, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)
    grouped = ModelRunner(arch, core.tensors, 64, PAGE, window_pages=window_pages_per_request(WINDOW, PAGE, 5))
    torch.testing.assert_close(grouped.forward_logits(ids, chunk_size=5), whole, atol=5e-5, rtol=0)


def test_the_clamps_are_active(step):
    """The tiny checkpoint's SwiGLU clamps are active (HF without them gives other logits): the parity above checks
    them, not a no-op."""
    variant, hf, _ = step
    if variant != "base":
        pytest.skip("the base variant clamps")
    ids = prompt(40)
    unclamped = step3p7_model("base", swiglu_limits=None, swiglu_limits_shared=None)
    assert (hf_logits(unclamped, ids) - hf_logits(hf, ids)).abs().max() > 1e-2


def test_greedy_matches_generate(step):
    """32 greedy tokens through the engine (8-token prefill chunks, window pages returned) = transformers' generate."""
    _, hf, core = step
    engine = check_greedy_matches_generate(hf, core, prompt(90, seed=5), engine=lambda c: make_engine(c, 1))
    pool = engine.scheduler.window_groups[0].pool
    assert pool.num_free_blocks == pool.num_blocks


def test_sixteen_requests_together_give_what_each_gives_alone(step):
    """16 requests under a 64-token budget (prompts split into 8-token chunks beside the others' decodes) give the
    tokens each gives alone in one chunk."""
    variant, _, core = step
    if variant != "base":
        pytest.skip("one variant covers batching")
    prompts = [prompt(5 + 11 * i, seed=10 + i) for i in range(16)]
    check_batched_equals_alone(core, prompts, make_engine, budget=64, chunk=CHUNK, alone_budget=256, alone_chunk=256)
