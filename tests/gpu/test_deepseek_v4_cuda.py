"""deepseek_v4 on the GPU: the tiny random checkpoint (tests/models/deepseek_v4_tiny.py: sliding, CSA and HCA layers,
hash-routed and score-routed experts, mHC streams) exported in float32 and bfloat16, run by the CUDA runner (its
attention is helios.layers.compressed_attention's torch ops on the device; MoE keeps CUDA graphs off) through the
engine with the raw rows in the window page group, no prefix caching: greedy tokens (float32, bfloat16) = HF transformers'
generate on the device; 16 batched = alone (float32) (tests/gpu/family_cuda.py's checks)."""

from __future__ import annotations

import pytest

from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_batched_on_cuda, check_greedy_on_cuda, export_family
from tests.models.deepseek_v4_tiny import build_deepseek_v4

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "deepseek_v4", build_deepseek_v4)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (window 8, CSA keeping 3 entries) = HF generate on the device."""
    from transformers import DeepseekV4ForCausalLM

    src, cores = exported
    engine = check_greedy_on_cuda(DeepseekV4ForCausalLM, src, cores[dtype], prefix_caching=False)
    assert engine.runner.graphs is None  # MoE routing keeps graphs off


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    check_batched_on_cuda(exported[1]["float32"], prefix_caching=False)
