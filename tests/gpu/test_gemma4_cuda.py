"""gemma4 on the GPU: the tiny random checkpoints (tests/models/gemma4_tiny.py: sliding and full layers of different
head dims and kv heads, k = v, KV-shared layers, per-layer embeddings, layer scalars; the MoE variant) exported in
float32 and bfloat16, run by the CUDA runner (Triton attention backend; the base variant with decode graphs captured
and the speculative next step, the MoE one eager) through the engine with the sliding layers' pages in a window group:
greedy tokens (float32, bfloat16) = HF transformers' generate on the device; 16 batched = alone (float32)
(tests/gpu/family_cuda.py's checks)."""

from __future__ import annotations

import pytest

from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_batched_on_cuda, check_greedy_on_cuda, export_dtypes
from tests.models.gemma4_tiny import build_gemma4

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{variant: (HF directory, {dtype name: LoadedCore})}; the MoE variant in float32 only."""
    root = tmp_path_factory.mktemp("gemma4")
    out = {}
    for variant, dtypes in (("base", DTYPES), ("moe", ["float32"])):
        src = build_gemma4(root / variant / "hf", variant)
        out[variant] = src, export_dtypes(src, root / variant, dtypes)
    return out


@pytest.mark.parametrize(("variant", "dtype"), [("base", "float32"), ("base", "bfloat16"), ("moe", "float32")])
def test_greedy_matches_transformers_on_the_gpu(exported, variant, dtype):
    """32 greedy tokens of a 150-token prompt (the window 8) = HF generate on the device; the base variant decodes
    through captured graphs (the KV-shared layers read their source's pages inside the graph)."""
    from transformers import Gemma4ForConditionalGeneration

    src, cores = exported[variant]
    engine = check_greedy_on_cuda(Gemma4ForConditionalGeneration, src, cores[dtype])
    if variant == "base":
        assert engine.runner.graphs is not None and engine.runner.launches["graph"] > 0, engine.runner.startup.graphs


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone (one engine, one request
    at a time)."""
    check_batched_on_cuda(exported["base"][1]["float32"], one_alone_engine=True)
