"""step3p7 on the GPU: the tiny random checkpoint (tests/models/step3p7_tiny.py's base variant: full and sliding
layers with their own head counts, a per-head output gate, partial rotary on the full layers, dense MLPs then experts,
active SwiGLU clamps) exported in float32 and bfloat16, run by the CUDA runner (Triton attention backend; MoE keeps
CUDA graphs off) through the engine with the sliding layers' pages in a window group: greedy tokens (float32, bfloat16) = HF
transformers' generate on the device; 16 batched = alone (float32) (tests/gpu/family_cuda.py's checks)."""

from __future__ import annotations

import pytest

from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_batched_on_cuda, check_greedy_on_cuda, export_family
from tests.models.step3p7_tiny import build_step3p7

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "step3p7", build_step3p7)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (the window 8) = HF generate on the device."""
    from transformers import Step3p7ForConditionalGeneration

    src, cores = exported
    check_greedy_on_cuda(Step3p7ForConditionalGeneration, src, cores[dtype])


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    check_batched_on_cuda(exported[1]["float32"])
