"""kimi_linear's folded decode launches compiled on CUDA (the interpreter's checks in tests/kernels/test_kda_folds.py
and test_mla_folds.py): the KDA step with f_b and the gated output norm folded in at Kimi-Linear's shape (32 heads of
128, split programs meeting at the arrival counters), the absorbed MLA decode's
absorption (with the cache write) and merge-with-W_uv launches at Kimi's MLA shape (32 heads, rank 512, rope 64),
and the cache write with the latent's norm. Against the unfused launches within rounding (other reduction orders on the device), rows alone =
in a batch bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import MlaConfig
from tests.gpu.family_cuda import CUDA_MARKS
from tests.kernels.test_kda_folds import (
    check_f_b_fold,
    check_output_norm_fold,
    check_rows_alone,
)
from tests.kernels.test_mla_folds import (
    check_absorb_query,
    check_absorbed_decode,
    check_decode_writes_its_latents,
    check_write_latent_norm,
)

pytestmark = CUDA_MARKS

CUDA = "cuda"
KIMI = dict(num_heads=32, dk=128, df=128)  # Kimi-Linear-48B-A3B's KDA heads; f_a and g_a are head_dim wide
KIMI_MLA = MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     softmax_scale=192**-0.5)
DTYPE = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)


@DTYPE
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_kda_decode_folds_at_kimi_shape(dtype, num_splits):
    check_f_b_fold(CUDA, dtype, num_splits=num_splits, tol=_tol(dtype), dv=128, **KIMI)
    check_output_norm_fold(CUDA, dtype, num_splits, tol=_tol(dtype), dz=128, **KIMI)
    check_rows_alone(CUDA, dtype, num_splits, dv=128, **KIMI)


@DTYPE
@pytest.mark.parametrize("num_splits", [1, 8])
def test_absorbed_mla_decode_at_kimi_shape(dtype, num_splits):
    lens = (1000, 1, 0, 257)
    check_absorb_query(CUDA, KIMI_MLA, dtype, tol=_tol(dtype), num_heads=32, seq_lens=lens, page_size=16)
    check_absorbed_decode(CUDA, KIMI_MLA, dtype, num_splits, tol=_tol(dtype), rows_alone=True, num_heads=32,
                          seq_lens=lens, page_size=16)
    check_decode_writes_its_latents(CUDA, KIMI_MLA, dtype, num_splits, page_size=16, num_heads=32, seq_lens=lens)


@DTYPE
def test_write_latent_folds_the_latent_norm(dtype):
    check_write_latent_norm(CUDA, dtype, rank=512, rope_dim=64, page_size=16, tol=_tol(dtype))
