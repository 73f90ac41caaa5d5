"""mimo_v2_flash on the GPU: the tiny random checkpoint (full and sliding layers, sinks, V narrower than q/k, MoE)
exported in float32 and bfloat16, run by the CUDA runner (Triton attention backend: paged decode and prefill with
sinks, V zero-padded to the q/k head_dim; MoE keeps CUDA graphs off) through the engine with the sliding layers'
pages in a window group. Greedy tokens = HF transformers' generate on the device in float32 and bfloat16; 16
batched = alone (float32); the sink kernels = their torch reference on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_batched_on_cuda, check_greedy_on_cuda, export_family
from tests.kernels import checks
from tests.models.mimo_v2_flash_tiny import build_mimo

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "mimo_v2_flash", build_mimo)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (far past the 17-token window) = HF generate on the device."""
    from transformers import MiMoV2FlashForCausalLM

    src, cores = exported
    check_greedy_on_cuda(MiMoV2FlashForCausalLM, src, cores[dtype])


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    check_batched_on_cuda(exported[1]["float32"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_sinks_on_cuda(dtype, num_splits):
    checks.check_decode("cuda", dtype, 16, 16, seq_lens=(37, 5, 300), num_splits=num_splits, sliding_window=129,
                        num_kv_heads=2, head_dim=192, sinks=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_with_sinks_on_cuda(dtype):
    checks.check_prefill("cuda", dtype, 8, 16, (200, 1, 9), (200, 33, 300), sliding_window=129, num_kv_heads=4,
                         head_dim=192, sinks=True)
