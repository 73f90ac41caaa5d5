"""gemma4's per-layer inputs in one launch: (norm(proj * proj_scale) + rows * row_scale) * 2^-0.5 for each token's
L slices of P, for the torch path's two multiplies, norm, add and multiply (helios.models.gemma4.per_layer_inputs).

Numerics follow that path op by op: each product, the norm (rmsnorm._normalize, weight multiplied in float32) and
the sum rounded to the output dtype (round_to). Imports torch and helios.kernels only.
"""

from __future__ import annotations

import struct

import torch

from helios.kernels._triton import (
    check_last_dim_contiguous,
    jit,
    next_power_of_2,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    round_to,
    tl,
    use_pdl,
)
from helios.kernels.rmsnorm import _normalize


@jit
def _ple_inputs_kernel(
    proj_ptr,  # [num_tokens, L * P] rows may be strided
    rows_ptr,  # [num_tokens, L * P] rows may be strided
    weight_ptr,  # [P] the norm's weight
    out_ptr,  # [num_tokens, L * P] contiguous
    stride_proj,
    stride_rows,
    num_layers,  # L
    dim,  # P
    proj_scale,  # float32
    row_scale,  # float32, already rounded to the output dtype (HF rounds the scale first)
    out_scale,  # float32(2^-0.5)
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    t = pid // num_layers
    col0 = (pid % num_layers) * dim
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    p = tl.load(proj_ptr + t * stride_proj + col0 + cols, mask=mask, other=0.0).to(tl.float32)
    p = round_to(p * proj_scale, DT)  # masked lanes stay 0: the norm's sum is the row's
    normed = round_to(_normalize(p, w, dim, eps, 1, True), DT)
    r = tl.load(rows_ptr + t * stride_rows + col0 + cols, mask=mask, other=0.0).to(tl.float32)
    r = round_to(r * row_scale, DT)
    y = round_to(round_to(normed + r, DT) * out_scale, DT)
    tl.store(out_ptr + t * num_layers * dim + col0 + cols, y.to(DT), mask=mask)


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _rounded(value: float, dtype: torch.dtype) -> float:
    """float32(value) rounded to dtype (to nearest even), on the host and without a torch op."""
    v = _float32(value)
    if dtype == torch.bfloat16:
        bits = struct.unpack("I", struct.pack("f", v))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("f", struct.pack("I", bits))[0]
    if dtype == torch.float16:
        return struct.unpack("e", struct.pack("e", v))[0]
    return v


def ple_inputs(
    proj: torch.Tensor,  # [num_tokens, L * P] the projection of the scaled embedding
    rows: torch.Tensor,  # [num_tokens, L * P] the table's rows
    weight: torch.Tensor,  # [P]
    eps: float,
    num_layers: int,
    proj_scale: float,  # H^-0.5
    row_scale: float,  # sqrt(P), rounded to the dtype first as HF does
) -> torch.Tensor:  # [num_tokens, L, P]
    require_triton()
    assert proj.dim() == 2 and proj.shape == rows.shape and proj.dtype == rows.dtype, (
        tuple(proj.shape), tuple(rows.shape))
    check_last_dim_contiguous("proj", proj)
    check_last_dim_contiguous("rows", rows)
    num_tokens, width = proj.shape
    dim = width // num_layers
    assert dim * num_layers == width and weight.shape == (dim,), (width, num_layers, tuple(weight.shape))
    out = torch.empty(num_tokens, num_layers, dim, dtype=proj.dtype, device=proj.device)
    if num_tokens == 0:
        return out
    pdl = use_pdl(proj, num_tokens)
    _ple_inputs_kernel[(num_tokens * num_layers,)](
        proj, rows, weight, out, proj.stride(0), rows.stride(0), num_layers, dim, _float32(proj_scale),
        _rounded(row_scale, proj.dtype), _float32(2.0**-0.5), eps, BLOCK=next_power_of_2(dim), USE_PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return out


def ple_inputs_ref(proj, rows, weight, eps, num_layers, proj_scale, row_scale) -> torch.Tensor:
    """helios.models.gemma4.per_layer_inputs' torch ops."""
    num_tokens, width = proj.shape
    rows = rows * torch.tensor(row_scale).to(proj.dtype)
    h = (proj * proj_scale).reshape(num_tokens, num_layers, width // num_layers).float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(proj.dtype)
    return (h + rows.reshape(h.shape)) * 2.0**-0.5
