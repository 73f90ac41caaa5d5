"""Gated-residual hyper-connections (qwen4_exp): the residual stream is S streams of the hidden size side by side,
[T, S*H]; a sublayer reads a gated mix of the normed streams and its output is added to each stream with a
per-token weight (helios.core.manifest.HyperConnectionConfig). Imports torch, helios.core, helios.layers and
helios.kernels.qwen4_hc only.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from helios.core.manifest import HyperConnectionConfig
from helios.kernels import qwen4_hc
from helios.layers.linear import Linear, linear
from helios.layers.norm import RMSNorm, rms_norm
from helios.switches import DEFAULT_SWITCHES, Switches


def grouped_rms_norm(
    x: torch.Tensor,  # [T, S*H]
    norm: RMSNorm,  # weight [S*H] (zero-centred, stored 1+w), multiplied in float32
    num_groups: int,
) -> torch.Tensor:  # [T, S*H]
    """RMSNorm of each of the S groups of H channels on its own (HF's Qwen4ExpTextRMSNorm with group_size=H)."""
    grouped = x.view(x.shape[0], num_groups, -1)
    weight = norm.weight.view(num_groups, -1)
    return rms_norm(grouped, weight, norm.eps, multiply_in_float32=True).view(x.shape)


class HyperConnection(nn.Module):
    """The mix before one sublayer (inject=True) or after the last layer (hc_head, inject=False), the previous
    sublayer's output first added to the streams. The torch path is helios.kernels.qwen4_hc.hc_mix_ref; `fused` (the
    Triton backend) takes its kernels: two launches for the add, the norm, the three projections and the gates.

    Tensors bound: norm.weight [S*H], down.weight [R, S*H], up.weight [S*H, R], inject.weight [S, S*H] (inject)."""

    def __init__(self, hidden_size: int, config: HyperConnectionConfig, eps: float, inject: bool = True,
                 switches: Switches = DEFAULT_SWITCHES, fused: bool = False) -> None:
        super().__init__()
        self.num_streams = config.num_streams
        self.fused = fused
        self.switches = switches
        width = config.num_streams * hidden_size
        self.norm = RMSNorm(width, eps, multiply_in_float32=True)
        self.down = Linear(width, config.rank, switches=switches)
        self.up = Linear(config.rank, width, switches=switches)
        self.inject = Linear(width, config.num_streams, switches=switches) if inject else None

    def forward(
        self,
        x: torch.Tensor,  # [T, S*H] the residual streams
        residual: tuple[torch.Tensor, torch.Tensor] | None = None,  # (y [T, H], weights [T, S]): add_to_streams first
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(the sublayer's input [T, H], the injection weights [T, S] or None, the streams [T, S*H] after the add):
        as Qwen4ExpTextGatedResidual."""
        weights = (self.norm.weight, self.down.weight, self.up.weight,
                   self.inject.weight if self.inject is not None else None)
        if self.fused and self._kernel_takes(x, weights, residual):
            return qwen4_hc.hc_mix(x, *weights, self.num_streams, self.norm.eps, residual)
        return qwen4_hc.hc_mix_ref(x, *weights, self.num_streams, self.norm.eps, residual,
                                   linear=functools.partial(linear, switches=self.switches))

    @staticmethod
    def _kernel_takes(x: torch.Tensor, weights, residual) -> bool:
        """Whether hc_mix gives the torch path's dtypes: rows of unit last stride, plain (not oneDNN-packed) weights
        of x's dtype (the norm's any: multiplied in float32), a residual of x's dtype."""
        return (x.dim() == 2 and x.stride(1) == 1
                and all(w is None or (not w.is_mkldnn and (i == 0 or w.dtype == x.dtype))
                        for i, w in enumerate(weights))
                and (residual is None or all(r.dtype == x.dtype for r in residual)))


def add_to_streams(
    x: torch.Tensor,  # [T, S*H] the residual streams
    y: torch.Tensor,  # [T, H] a sublayer's output
    weights: torch.Tensor,  # [T, S] its injection weights
) -> torch.Tensor:  # [T, S*H]
    """Stream s += weights[:, s] * y (helios.kernels.qwen4_hc.add_to_streams_ref)."""
    return qwen4_hc.add_to_streams_ref(x, y, weights)
