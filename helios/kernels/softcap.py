"""The final logit soft-cap, cap * tanh(logits / cap) (gemma), in one launch for torch's div, tanh and mul.

Numerics follow the torch path op by op: each of the three results is rounded to the logits' dtype (round_to);
the division is what torch's kernel on the device computes: on CUDA a multiply by the float32 reciprocal of the
cap (torch's div by a CPU scalar), elsewhere a correctly rounded division. Imports torch and
helios.kernels._triton only.
"""

from __future__ import annotations

import struct

import torch

from helios.kernels._triton import (
    cdiv,
    check_last_dim_contiguous,
    jit,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    round_to,
    tanh,
    tl,
    use_pdl,
)

_BLOCK = 2048


@jit
def _tanh(y):
    """tanh to float32's last bits or so: _triton.tanh's one exp where |y| >= 1/16, else its series to y^5 (there
    1 - exp(-2|y|) would cancel: a logit near 0 would lose its relative precision)."""
    y2 = y * y
    series = y * (1.0 + y2 * (-1.0 / 3.0 + y2 * (2.0 / 15.0)))
    return tl.where(tl.abs(y) < 0.0625, series, tanh(y))


@jit
def _softcap_kernel(
    x_ptr,  # [num_rows, V] rows may be strided
    out_ptr,  # [num_rows, V] contiguous
    stride_x,
    width,  # V
    cap,
    inv_cap,  # float32(1) / float32(cap), for MUL_RECIPROCAL
    MUL_RECIPROCAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if MUL_RECIPROCAL:
        scaled = x * inv_cap
    else:
        scaled = tl.math.div_rn(x, cap)
    y = round_to(round_to(_tanh(round_to(scaled, DT)), DT) * cap, DT)
    tl.store(out_ptr + r * width + cols, y.to(DT), mask=mask)


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:  # [num_rows, V] -> [num_rows, V]
    require_triton()
    assert logits.dim() == 2, f"expected [num_rows, V], got {tuple(logits.shape)}"
    check_last_dim_contiguous("logits", logits)
    num_rows, width = logits.shape
    out = torch.empty(num_rows, width, dtype=logits.dtype, device=logits.device)
    if num_rows == 0:
        return out
    inv_cap = _float32(1.0 / _float32(cap))  # float32's correctly rounded reciprocal, as torch's opmath computes it
    pdl = use_pdl(logits, num_rows)
    _softcap_kernel[(num_rows, cdiv(width, _BLOCK))](
        logits, out, logits.stride(0), width, float(cap), inv_cap, MUL_RECIPROCAL=logits.is_cuda, BLOCK=_BLOCK,
        USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def softcap_ref(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap
