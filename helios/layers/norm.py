"""RMSNorm as the HF families compute it: statistics in float32, weights stored as the multiplier.

Two orders of the final multiply exist upstream and differ only below float32 (bf16/fp16):
llama/qwen cast the normalized value back to the input dtype before multiplying by the weight;
gemma multiplies in float32 and casts afterwards. `multiply_in_float32` picks the gemma order.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
    multiply_in_float32: bool = False,
) -> torch.Tensor:
    """y = x / rms(x) * weight, normalized in float32 like HF."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if multiply_in_float32:
        return (h * weight.to(torch.float32)).to(input_dtype)
    return weight * h.to(input_dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., dim]
    """x / rms(x) in float32, rounded to x's dtype: a norm without a weight (HF's weightless norms, muse_spark)."""
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Holds `weight` [dim] (bound from the core) and applies `rms_norm`; with scale_first, norm(x * weight) instead
    (muse_spark's input-scaled norm: the product in float32, rounded to x's dtype, then normalized; forward only,
    the fused forward_add kernels do not know this order). With `kernel` (helios.models.use_layer_kernels: a model on
    the Triton backend) forward runs helios.kernels.rmsnorm's one launch where its output is torch's dtype, else torch's five."""

    kernel = False

    def __init__(self, dim: int, eps: float, multiply_in_float32: bool = False, scale_first: bool = False):
        super().__init__()
        self.eps = eps
        self.multiply_in_float32 = multiply_in_float32
        self.scale_first = scale_first
        # NOTE: meta until the model binds the core's tensor; never allocated here.
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self.scale_first:
            return rms_normalize((x.float() * self.weight.float()).to(x.dtype), self.eps)
        if self.kernel and self._kernel_takes(x):
            from helios.kernels.rmsnorm import rms_norm as rms_norm_kernel

            return rms_norm_kernel(x, self.weight, self.eps, self.multiply_in_float32)
        return rms_norm(x, self.weight, self.eps, self.multiply_in_float32)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel gives what rms_norm gives: rows of a 2-d or 3-d tensor with unit last stride, and an
        output in x's dtype (torch's 16-bit x times a float32 weight, unless multiplied in float32, is float32)."""
        return (x.dim() in (2, 3) and x.stride(-1) == 1 and self.weight.is_contiguous()
                and (self.multiply_in_float32 or self.weight.dtype == x.dtype))

    def forward_add_gemv(
        self,
        x: torch.Tensor,  # [1, dim]
        residual: torch.Tensor | None,  # [1, dim]; None for the first layer
        weight: torch.Tensor,  # [N, dim], the projection that reads the normed row
        allow_pdl: bool = True,  # the gemv_pdl switch (helios.switches)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual) @ weight.T, x + residual)
        """forward_add then the projection, in one GEMV launch (batch-1 decode on the GPU path)."""
        from helios.kernels.gemv import gemv_add_rms_norm

        return gemv_add_rms_norm(x, residual, self.weight, self.eps, weight, self.multiply_in_float32,
                                 allow_pdl=allow_pdl)

    def forward_add(
        self,
        x: torch.Tensor,  # [T, dim]
        residual: torch.Tensor | None,  # [T, dim]; None for the first layer
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual), x + residual)
        """The residual add and the norm; `fused` runs both in one Triton kernel (GPU path), same values."""
        if fused:
            from helios.kernels.rmsnorm import fused_add_rms_norm, rms_norm as rms_norm_kernel

            if residual is None:
                return rms_norm_kernel(x, self.weight, self.eps, self.multiply_in_float32), x
            return fused_add_rms_norm(x, residual, self.weight, self.eps, self.multiply_in_float32)
        x = x if residual is None else x + residual
        return self(x), x


def pre_norm_stack(x: torch.Tensor, layers, caches: list, meta, norm: RMSNorm, fused: bool, *inputs) -> torch.Tensor:
    """x through a stack of pre-norm blocks and the final norm: each `layer(x, *inputs, cache, meta)` returning its
    output with the residual added (eager), or, with `fused`, `layer.forward_fused(x, residual, *inputs, cache,
    meta)` returning (its output, the stream before the add), each add then taken with the next norm in one launch
    (RMSNorm.forward_add). inputs: what every layer reads besides its cache (a rotary table)."""
    if not fused:
        for layer, cache in zip(layers, caches):
            x = layer(x, *inputs, cache, meta)
        return norm(x)
    residual = None
    for layer, cache in zip(layers, caches):
        x, residual = layer.forward_fused(x, residual, *inputs, cache, meta)
    return norm.forward_add(x, residual, fused=True)[0]
