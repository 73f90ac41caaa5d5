"""helios.kernels.gated_norm = helios.layers.recurrent.rms_norm_gated in each of its three orders (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import tolerance

ORDERS = {
    "qwen3_5": dict(),  # norm, weight in x's dtype, * silu(z)
    "nemotron_h": dict(norm_before_gate=False, group_size=16),  # x * silu(z), grouped norm, weight
    "kimi": dict(activation="sigmoid", multiply_in_float32=True),  # norm, float32 weight, * sigmoid(z)
}


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_gated_norm_matches_the_torch_reference(interpreter, order, dtype):
    from helios.kernels.gated_norm import gated_rms_norm
    from helios.layers.recurrent import rms_norm_gated

    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 96, generator=gen).to(dtype)
    x, z = wide[:, :48], torch.randn(5, 48, generator=gen).to(dtype)  # x strided: a view of a wider row
    weight = (1 + 0.1 * torch.randn(48, generator=gen)).to(dtype)
    got = gated_rms_norm(x, z, weight, 1e-6, **ORDERS[order])
    want = rms_norm_gated(x, z, weight, 1e-6, **ORDERS[order])
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, **tolerance(dtype))
