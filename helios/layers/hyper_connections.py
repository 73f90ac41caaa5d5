"""Gated-residual hyper-connections (qwen4_exp): the residual stream is S streams of the hidden size side by side,
[T, S*H]; a sublayer reads a gated mix of the normed streams and its output is added to each stream with a
per-token weight (helios.core.manifest.HyperConnectionConfig). Imports torch and helios.layers only.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import HyperConnectionConfig
from helios.layers.linear import Linear
from helios.layers.norm import RMSNorm, rms_norm
from helios.layers.recurrent import sigmoid, silu
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
    """The mix before one sublayer (inject=True) or after the last layer (hc_head, inject=False).

    Tensors bound: norm.weight [S*H], down.weight [R, S*H], up.weight [S*H, R], inject.weight [S, S*H] (inject)."""

    def __init__(self, hidden_size: int, config: HyperConnectionConfig, eps: float, inject: bool = True,
                 switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        self.num_streams = config.num_streams
        width = config.num_streams * hidden_size
        self.norm = RMSNorm(width, eps, multiply_in_float32=True)
        self.down = Linear(width, config.rank, switches=switches)
        self.up = Linear(config.rank, width, switches=switches)
        self.inject = Linear(width, config.num_streams, switches=switches) if inject else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, S*H]
        """(the sublayer's input [T, H], the injection weights [T, S] or None): as Qwen4ExpTextGatedResidual.
        NOTE: recurrent's silu and sigmoid (exp-based), whose bits do not depend on a row's place in the batch."""
        s = self.num_streams
        normed = grouped_rms_norm(x, self.norm, s)
        gates = sigmoid(self.up(silu(self.down(normed) / s)))  # [T, S*H]
        mixed = (gates * normed).view(x.shape[0], s, -1).mean(dim=1)
        if self.inject is None:
            return mixed, None
        return mixed, 2 * sigmoid(self.inject(normed) / s)


def add_to_streams(
    x: torch.Tensor,  # [T, S*H] the residual streams
    y: torch.Tensor,  # [T, H] a sublayer's output
    weights: torch.Tensor,  # [T, S] its injection weights
) -> torch.Tensor:  # [T, S*H]
    """Stream s += weights[:, s] * y (HF: hyper_input + (y[..., None, :] * w[..., None]).flatten(-2))."""
    return x + (y[:, None, :] * weights[:, :, None]).flatten(1)
