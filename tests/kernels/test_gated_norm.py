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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_heads_side_by_side_share_one_weight_and_match_the_per_head_rows(interpreter, dtype):
    """GatedDeltaNet's fused path: a row of 4 heads of 16, z a strided view of the projection (read in place, no
    copy), one [16] weight for every head: the bits of the reference over the [rows * heads, 16] rows."""
    from helios.kernels.gated_norm import gated_rms_norm

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    projected = torch.randn(5, 100, generator=gen).to(dtype)
    z = projected[:, 20:84]  # a split's columns: row stride 100
    weight = (1 + 0.1 * torch.randn(16, generator=gen)).to(dtype)
    got = gated_rms_norm(x, z, weight, 1e-6, group_size=16)
    per_head = gated_rms_norm(x.reshape(-1, 16), z.reshape(-1, 16), weight, 1e-6)
    assert torch.equal(got, per_head.view(5, 64))


def test_a_row_gives_the_same_bits_alone_and_among_many(interpreter):
    """A program normalizes a fixed tile of (row, group) pairs (gated_norm.TILE): 300 rows of 8 heads of 16 span
    several tiles, a tile holds pieces of several rows, and each row alone gives its bits in the batch."""
    from helios.kernels.gated_norm import TILE, gated_rms_norm

    gen = torch.Generator().manual_seed(5)
    x, z = torch.randn(300, 128, generator=gen), torch.randn(300, 128, generator=gen)
    weight = 1 + 0.1 * torch.randn(16, generator=gen)
    got = gated_rms_norm(x, z, weight, 1e-6, group_size=16)
    assert 300 * 8 > TILE // 16, "more pairs than one tile holds"
    for row in (0, 127, 128, 299):
        alone = gated_rms_norm(x[row:row + 1], z[row:row + 1], weight, 1e-6, group_size=16)
        assert torch.equal(alone, got[row:row + 1])
