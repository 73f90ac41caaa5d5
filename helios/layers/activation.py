"""Gated activations over a fused [gate | up] projection (gate rows first, then up) and the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import Activation
from helios.layers.linear import Linear


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # HF's gelu_pytorch_tanh is exactly this call.
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def gated(gate_up: torch.Tensor, act: Activation) -> torch.Tensor:  # [..., 2*F] -> [..., F]
    """act(gate) * up, with gate the first half of the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


class GatedMLP(nn.Module):
    """down(act(gate) * up) over a fused projection: gate_up.weight [2*F, H], down.weight [H, F]."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Activation = "silu"):
        super().__init__()
        self.act = act
        self.gate_up = Linear(hidden_size, 2 * intermediate_size)
        self.down = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """The GPU path runs the down projection through RMSNorm.forward_add_projected instead (gated there)."""
        return self.down(gated(self.gate_up(x), self.act))
