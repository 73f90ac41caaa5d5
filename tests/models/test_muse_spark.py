"""Parity of muse_spark (sliding + full GQA with weightless q/k/o norms and the elementwise gate, NoPE layers of both
types, residual gates, dense SwiGLU and the latent MoE, the soft-capped logits) against HF transformers on a tiny random
checkpoint, text only, through the real path: an HF directory (MuseSparkForConditionalGeneration), ignition's float32
export, helios.core.load, the ModelRunner with the sliding layers' pages in a window group (helios/engine/kv_groups.py)
and the engine returning the pages before the window. Prompts run far past the 8-token window.
"""

from __future__ import annotations

import pytest
import torch

from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.layers.norm import RMSNorm
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.hybrid_harness import (
    check_batched_equals_alone,
    check_fused_loop_equals_eager,
    check_greedy_matches_generate,
    export_float32,
    hf_logits,
    prompt,
    window_engine,
)
from tests.models.muse_spark_tiny import WINDOW, build_muse_spark

PAGE, CHUNK, NUM_PAGES = 4, 8, 160


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    """(HF model, LoadedCore) of the tiny checkpoint, exported in float32."""
    from transformers import MuseSparkForConditionalGeneration

    root = tmp_path_factory.mktemp("muse_spark")
    return export_float32(MuseSparkForConditionalGeneration, build_muse_spark(root / "hf"), root)


def make_engine(core, max_concurrency: int = 16, budget: int = 64, chunk: int = CHUNK) -> EngineCore:
    """The sliding layers' pages in a window group of the minimum every running request needs."""
    return window_engine(core, max_concurrency, NUM_PAGES, chunk, budget, page_size=PAGE)


def test_the_export_is_muse_spark(muse):
    _, core = muse
    arch = core.manifest.arch
    assert arch.family == "muse_spark" and arch.layer_types == ["full", "sliding", "sliding", "sliding", "full"]
    assert arch.nope_layers == [0, 2] and arch.sliding_window == WINDOW and arch.attn_output_gate
    assert arch.moe.dense_layers == [0, 3] and arch.moe.latent_size == 32 and arch.moe.latent_norms
    assert KVCache.window_layers(arch) == [1, 2, 3]


def test_logits_and_prompt_logprobs_match(muse):
    """Last-position logits within 1e-4 of HF, every position's log-softmax within 1e-4; the prompt in chunks of 5
    through a cyclic window table of the minimum pages = the whole prompt through one group."""
    hf, core = muse
    arch = core.manifest.arch
    ids = prompt(80)
    ref = hf_logits(hf, ids)
    whole = ModelRunner(arch, core.tensors, 64, PAGE).forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.log_softmax(whole, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)
    grouped = ModelRunner(arch, core.tensors, 64, PAGE, window_pages=window_pages_per_request(WINDOW, PAGE, 5))
    chunked = grouped.forward_logits(ids, chunk_size=5)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)


def test_greedy_matches_generate(muse):
    """32 greedy tokens through the engine (8-token chunks, decode steps, pages freed behind the window) = HF
    generate, and the window pool never holds more than the window and a chunk need."""
    hf, core = muse
    engine = check_greedy_matches_generate(hf, core, prompt(45, seed=5), engine=lambda c: make_engine(c, 1))
    pool = engine.scheduler.window_groups[0].pool
    assert pool.num_free_blocks == pool.num_blocks  # every window page came back


def test_sixteen_requests_together_give_what_each_gives_alone(muse):
    """16 requests batched (a 64-token budget: prompts split into 8-token chunks beside the others' decodes) give
    the tokens each gives alone in one whole-prompt chunk."""
    _, core = muse
    prompts = [prompt(5 + 7 * i, seed=10 + i) for i in range(16)]
    check_batched_equals_alone(core, prompts, make_engine, budget=64, chunk=CHUNK, alone_budget=256, alone_chunk=128)


def use_triton_path(model) -> None:
    """What the Triton backend picks for a muse_spark model: every norm module as its kernel, the fused layer loop."""
    from helios.models import use_layer_kernels

    use_layer_kernels(model, True)
    model.path = "fused"


def test_the_fused_path_gives_the_eager_paths_logits(muse):
    """The Triton path's layer loop (interpreter) over the torch backend's attention: the weightless and input-scaled
    norms as kernels (the output norm with its sigmoid gate), q and k rotated in one launch, each post-norm, residual
    gate and next norm in one launch (MuseSparkDecoderLayer.forward_fused), NoPE and rotary layers, dense and MoE
    ffns = the eager loop's logits."""
    check_fused_loop_equals_eager(muse[1], fuse=use_triton_path, is_fused=lambda model: model.path == "fused")


def test_on_the_triton_backend_every_norm_is_a_kernel_and_the_logits_are_torchs(muse):
    """A model built for the Triton backend (its attention in the interpreter) takes the fused path, every norm
    module (weightless, input-scaled, the latents') a kernel, and gives the torch backend's logits."""
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()
    arch = muse[1].manifest.arch
    runners = {name: ModelRunner(arch, muse[1].tensors, 32, PAGE, attention_backend=name)
               for name in ("torch", "triton")}
    model = runners["triton"].model
    assert model.path == "fused" and runners["torch"].model.path == "eager"
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert {(m.weight is None, m.scale_first) for m in norms} == {(True, False), (False, True), (False, False)}
    assert all(m.kernel for m in norms)
    ids = prompt(12, seed=7)
    torch.testing.assert_close(runners["triton"].forward_logits(ids), runners["torch"].forward_logits(ids),
                               atol=1e-4, rtol=1e-4)
