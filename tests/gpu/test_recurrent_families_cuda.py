"""The recurrent families whose GPU checks so far covered their kernels and layers only, end to end on the GPU:
qwen3_next (gated delta rule + gated attention, MoE), nemotron_h (Mamba-2 + attention, relu2 MoE), kimi_linear (KDA +
MLA, sigmoid-routed MoE) and glm5_next (its "shared" variant: KDA, full and shared DSA layers, experts), each tiny random
checkpoint exported in float32 and bfloat16 and run by the CUDA runner through the engine with its decode graphs:
32 greedy tokens of a 150-token prompt = HF transformers' generate on the device (float32 and bfloat16, the 16-bit
rounding-tie rule of family_cuda.check_tokens_match_hf), and 16 requests together = each alone (float32)."""

from __future__ import annotations

import pytest

from tests.gpu.family_cuda import (CUDA_MARKS, DTYPES, check_batched_on_cuda, check_greedy_on_cuda, export_family,
                                   router_tie)
from tests.models.glm5_next_tiny import build_glm5_next
from tests.models.hybrid_tiny import build_hybrid
from tests.models.kimi_linear_tiny import build_kimi_linear
from tests.models.nemotron_h_tiny import build_nemotron_h

pytestmark = CUDA_MARKS

BUILDERS = {
    "qwen3_next": lambda hf: build_hybrid("qwen3_next", hf),
    "nemotron_h": build_nemotron_h,
    "kimi_linear": build_kimi_linear,
    "glm5_next": lambda hf: build_glm5_next(hf, "shared"),
}


def hf_class(family: str):
    import transformers

    return transformers.Glm5NextForConditionalGeneration if family == "glm5_next" else transformers.AutoModelForCausalLM


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def exported(request, tmp_path_factory):
    return request.param, *export_family(tmp_path_factory, request.param, BUILDERS[request.param])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    family, src, cores = exported
    engine = check_greedy_on_cuda(hf_class(family), src, cores[dtype])
    assert engine.runner.launches["graph"] > 0, (family, engine.runner.startup.graphs, engine.runner.launches)


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    family, src, cores = exported
    # qwen3_next's softmax router: its near-ties are ties (family_cuda.router_tie); the others' sigmoid routers
    # with a correction bias are held without one
    tie = router_tie(hf_class(family), src) if family == "qwen3_next" else None
    check_batched_on_cuda(cores["float32"], tie=tie)
