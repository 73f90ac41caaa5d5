"""minimax_m3 on the GPU: the tiny random checkpoint (the wrapper variant: sparse, full and sparse layers, a dense MLP
then experts) exported in float32 and bfloat16, run by the CUDA runner through the engine: the full layers through
the Triton attention backend, the sparse layers' indexer and block-sparse attention through their torch ops on the
device (index keys in pages beside the K/V; MoE and the indexer keep CUDA graphs off). greedy tokens (float32, bfloat16) = HF
transformers' generate on the device; 16 batched = alone (float32) (tests/gpu/family_cuda.py's checks)."""

from __future__ import annotations

import pytest

from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_batched_on_cuda, check_greedy_on_cuda, export_family
from tests.models.minimax_m3_tiny import build_minimax_m3

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "minimax_m3", lambda hf: build_minimax_m3(hf, "wrapper"))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (38 blocks of 4, 4 kept per query) = HF generate on the device."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    src, cores = exported
    check_greedy_on_cuda(MiniMaxM3SparseForConditionalGeneration, src, cores[dtype])


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    check_batched_on_cuda(exported[1]["float32"])
