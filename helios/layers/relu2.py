"""nemotron_h's relu2 MLP with its fused (GPU) path: helios.layers.moe.Relu2MLP whose relu(x)^2 is one Triton launch
(helios.kernels.relu2, imported there only) instead of torch's relu and square; same tensors, same bits.
Imports torch and helios.layers only.
"""

from __future__ import annotations

import torch

from helios.layers.moe import Relu2MLP, relu2
from helios.switches import DEFAULT_SWITCHES, Switches


class FusedRelu2MLP(Relu2MLP):
    """Relu2MLP (up.weight [F, H], down.weight [H, F]); `fused` picks the one-launch activation."""

    def __init__(self, hidden_size: int, intermediate_size: int, switches: Switches = DEFAULT_SWITCHES,
                 fused: bool = False) -> None:
        super().__init__(hidden_size, intermediate_size, switches)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        up = self.up(x)
        if self.fused:
            from helios.kernels.relu2 import relu2 as relu2_launch

            return self.down(relu2_launch(up))
        return self.down(relu2(up))
