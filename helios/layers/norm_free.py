"""The operations of a batch-1 decode layer without norm kernels (helios.models.llama's "norm_free" path).

The layer's norm weights were folded into its qkv and gate_up weights at load (helios.runner.norm_folding), so
each projection reads the un-normed residual stream; the stream's RMS statistic travels between kernels as
float32 partial sums of its squares (a RowNorm): the o and down GEMVs add into the stream and write them, decode
attention and the down GEMV scale by the rstd they give. Also the PDL scope a model's forward runs in. The
model reaches these kernels through this module only (models never import helios.kernels).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from helios.kernels import gemv as gemv_kernels
from helios.layers.linear import linear
from helios.switches import Switches

RowNorm = gemv_kernels.RowNorm  # (partials [P] float32, dim, eps)


def pdl_launches(on: bool):
    """The scope a forward's one-row launches run in: programmatic dependent launch when `on` (sm90+, compiled
    kernels; helios.kernels._triton.pdl_allowed), never outside one."""
    if not on:
        return nullcontext()
    from helios.kernels._triton import pdl_scope

    return pdl_scope(True)


def stream_partials(x: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:  # x [1, H] -> [P] float32
    """The embedding's statistic, in the count of partials the o / down GEMVs write (each reader's load is sized
    for one count)."""
    from helios.kernels.rmsnorm import row_sum_squares

    return row_sum_squares(x, gemv_kernels.num_partials(*o_weight.shape, o_weight.dtype))


def wide_product(x: torch.Tensor, weight: torch.Tensor, switches: Switches) -> torch.Tensor:  # [1, K] -> [1, N]
    """A wide one-row product of the norm-free path (qkv, gate_up, the lm_head): the GEMV whatever the gemv switch
    admits (helios.kernels.gemv.NORM_FREE_WIDE), or `linear`'s choice."""
    if gemv_kernels.NORM_FREE_WIDE:
        return gemv_kernels.gemv(x, weight, allow_pdl=switches.gemv_pdl)
    return linear(x, weight, None, switches)


def product_add(
    x: torch.Tensor,  # [1, K] ([1, 2K] gated)
    weight: torch.Tensor,  # [N, K]
    stream: torch.Tensor,  # [1, N], the residual stream
    switches: Switches,
    gated: str | None = None,
    row_norm: RowNorm | None = None,  # x's own statistic: x is scaled by its rstd as it is read
) -> tuple[torch.Tensor, torch.Tensor]:  # (stream + x @ weight.T [1, N], its partials [P] float32)
    """The o / down GEMV that adds into the stream and hands its statistic on (helios.kernels.gemv.gemv_add)."""
    return gemv_kernels.gemv_add(x, weight, stream, gated=gated, row_norm=row_norm, allow_pdl=switches.gemv_pdl)
