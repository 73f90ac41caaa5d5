"""deepseek_v4's decode-step kernels compiled on the GPU: helios.kernels.interleaved_rope (unit_rms / kv_norm and the
interleaved rope in one launch, per-token rows or the tabulated ones) and helios.kernels.csa_compress (a layer's
compressors' entries in one launch) = their torch references, float32 and bfloat16 (the checks of
tests/kernels/test_interleaved_rope.py and test_csa_compress.py); the CompressedAttention layers' decode with tabulated
ropes = their torch path."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS

pytestmark = CUDA_MARKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_the_layers_ops_on_the_gpu(dtype):
    from tests.kernels.test_interleaved_rope import NORMS, check_rope

    for norm, inverse in NORMS:
        check_rope("cuda", dtype, norm, inverse)
    check_rope("cuda", dtype, "unit", False, block_h=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_step_matches_the_reference_on_the_gpu(dtype):
    from tests.kernels.test_csa_compress import check_compress_step

    for kind in ("csa", "hca"):
        for table in (False, True):
            check_compress_step("cuda", dtype, kind, table)
        check_compress_step("cuda", dtype, kind, True, block_m=2)


def test_layer_decode_with_rope_tables_on_the_gpu(monkeypatch):
    import helios.layers.compressed_attention as ca
    from tests.kernels.test_csa_decode import check_layer_decode

    class Tabulated(ca.InterleavedRope):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rotary.tabulate(64, torch.float32)

    monkeypatch.setattr(ca, "InterleavedRope", Tabulated)
    check_layer_decode("cuda", torch.float32, tol=dict(atol=1e-4, rtol=1e-4))
