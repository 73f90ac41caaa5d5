"""The recurrent layers' gated RMSNorm in one launch: helios.layers.recurrent.rms_norm_gated's three orders (qwen3_5's
norm, weight in x's dtype, * silu(z); nemotron_h's x * silu(z) then a grouped norm and the weight; kimi's norm, a
float32 weight multiply, * sigmoid(z)), a program per tile of (row, group) pairs, statistics in float32. Replaces a
dozen elementwise torch kernels per layer on the GPU path (a decode step's launch count). Imports torch and
helios.kernels._triton only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import cdiv, check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl


@jit
def _gated_rms_norm_kernel(
    x_ptr,  # [N, d]
    z_ptr,  # [N, d]
    w_ptr,  # [d]
    out_ptr,  # [N, d] contiguous, x's dtype
    stride_x,
    stride_z,
    eps,
    d,
    num_units,  # N * (d / GROUP): the (row, group) pairs, one statistic each
    GROUP: tl.constexpr,  # channels one statistic covers (d, or d / n_groups)
    BLOCK: tl.constexpr,  # next power of two >= GROUP
    UNITS: tl.constexpr,  # (row, group) pairs a program normalizes, row-major
    SIGMOID: tl.constexpr,  # the gate's activation: sigmoid, else silu
    NORM_FIRST: tl.constexpr,  # norm (and weight), then the gate; else the gate, then the norm
    F32_MUL: tl.constexpr,  # the weight multiplies in float32; else in x's dtype (the normed value rounded first)
    SHARED_W: tl.constexpr,  # one [GROUP] weight for every group (heads side by side in a row); else [d]
):
    units = tl.program_id(0) * UNITS + tl.arange(0, UNITS)  # [UNITS]
    groups_per_row = d // GROUP
    row = (units // groups_per_row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    cols = (units % groups_per_row)[:, None] * GROUP + offs[None, :]  # [UNITS, BLOCK]
    mask = (units < num_units)[:, None] & (offs < GROUP)[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    z = tl.load(z_ptr + row[:, None] * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    if SIGMOID:
        gate = 1.0 / (1.0 + tl.exp(-z))
    else:
        gate = z / (1.0 + tl.exp(-z))
    if not NORM_FIRST:
        h = h * gate
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / GROUP + eps)
    h = h * rstd[:, None]
    w = tl.load(w_ptr + (offs[None, :] if SHARED_W else cols), mask=mask, other=0.0)
    if F32_MUL:
        h = w.to(tl.float32) * h
    else:  # weight * h.to(dtype), in dtype: the float32 product of two dtype values, rounded once
        h = (w.to(tl.float32) * h.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if NORM_FIRST:
        h = h * gate
    tl.store(out_ptr + row[:, None] * d + cols, h.to(dtype), mask=mask)


# elements a program covers: a prompt step's statistics are short (a 128-channel head) and many (tokens x heads);
# one program each left the H100 at ~1.2 TB/s in qwen3_5_moe's 4k prefill (80 us a layer for 96 MB)
TILE = 2048


def gated_rms_norm(
    x: torch.Tensor,  # [N, d]
    z: torch.Tensor,  # [N, d]
    weight: torch.Tensor,  # [d]
    eps: float,
    *,
    activation: str = "silu",
    norm_before_gate: bool = True,
    group_size: int | None = None,
    multiply_in_float32: bool = False,
) -> torch.Tensor:  # [N, d] in x's dtype
    """helios.layers.recurrent.rms_norm_gated in one launch (same arguments, same orders). A [group_size] weight
    serves every group of a row: a row of heads side by side, z a strided view (no copy), each head the
    reference's [N * heads, group_size] row."""
    require_triton()
    num_rows, d = x.shape
    group = group_size or d
    assert z.shape == x.shape and weight.shape in ((d,), (group,)) and weight.is_contiguous() and d % group == 0
    assert activation in ("silu", "sigmoid"), f"activation {activation!r}"
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("z", z)
    out = torch.empty(num_rows, d, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block = next_power_of_2(group)
    units = max(1, TILE // block)  # a fixed tile: a row's values never depend on the rows beside it
    num_units = num_rows * (d // group)
    _gated_rms_norm_kernel[(cdiv(num_units, units),)](
        x, z, weight, out, x.stride(0), z.stride(0), eps, d, num_units, GROUP=group, BLOCK=block, UNITS=units,
        SIGMOID=activation == "sigmoid", NORM_FIRST=norm_before_gate, F32_MUL=multiply_in_float32,
        SHARED_W=weight.shape[0] != d, num_warps=4,
    )
    return out
