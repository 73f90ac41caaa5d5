"""Gated activations over a fused [gate | up] projection (gate rows first, then up) and the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import Activation
from helios.layers.linear import Linear
from helios.switches import DEFAULT_SWITCHES, Switches


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # HF's gelu_pytorch_tanh is exactly this call.
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def gated(gate_up: torch.Tensor, act: Activation, limit: float | None = None,
          clamp_after_act: bool = False, *, alpha: float | None = None) -> torch.Tensor:  # [..., 2*F] -> [..., F]
    """act(gate) * up, with gate the first half of the last dimension; with `limit` (arch.swiglu_limit, glm5_next)
    gate is clamped to <= limit and up to [-limit, limit] first; with clamp_after_act too (arch.swiglu_limits,
    step3p7) act(gate) is clamped instead of gate. With `alpha` (arch.swiglu_alpha, minimax_m3): SwiGLU-OAI, (up + 1)
    * gate * sigmoid(alpha * gate) after the clamp, in HF's order."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None and clamp_after_act:
        return ACTIVATIONS[act](gate).clamp(max=limit) * up.clamp(-limit, limit)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    if alpha is not None:
        # NOTE: exp-based sigmoid, not torch.sigmoid, whose CPU SIMD body and scalar tail may differ in the last bit
        # (a row's value would depend on its offset in the batch; helios.layers.recurrent.sigmoid says more)
        return (up + 1.0) * (gate * (1.0 / (1.0 + torch.exp(-(gate * alpha).float()))).to(gate.dtype))
    return ACTIVATIONS[act](gate) * up


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: Activation,
                kernel: bool = False) -> torch.Tensor:  # 2 x [T, F] -> [T, F]
    """act(gate) * up of two tensors (gemma4's per-layer-input gate); kernel (the Triton path): one launch of
    helios.kernels.activation for silu / gelu_tanh, the same roundings as the two torch ops."""
    if kernel and act in ("silu", "gelu_tanh") and gate.dim() == 2:
        from helios.kernels.activation import act_and_mul as act_and_mul_kernel

        return act_and_mul_kernel(gate, up, act)
    return ACTIVATIONS[act](gate) * up


def softcap(logits: torch.Tensor, cap: float | None, kernel: bool = False) -> torch.Tensor:  # [N, V]
    """cap * tanh(logits / cap) when the architecture declares a final soft-cap (gemma); kernel (the Triton path):
    one launch of helios.kernels.softcap for torch's three, the same roundings."""
    if cap is None:
        return logits
    if kernel and logits.dim() == 2 and logits.stride(-1) == 1:
        from helios.kernels.softcap import softcap as softcap_kernel

        return softcap_kernel(logits, cap)
    return torch.tanh(logits / cap) * cap


class GatedMLP(nn.Module):
    """down(act(gate) * up) over a fused projection: gate_up.weight [2*F, H], down.weight [H, F]."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Activation = "silu", fused: bool = False,
                 switches: Switches = DEFAULT_SWITCHES, limit: float | None = None, clamp_after_act: bool = False,
                 alpha: float | None = None):
        super().__init__()
        self.act = act
        self.limit = limit  # the clamp of `gated` (arch.swiglu_limit, or a layer's arch.swiglu_limits_shared entry)
        self.clamp_after_act = clamp_after_act
        self.alpha = alpha  # SwiGLU-OAI's gain (arch.swiglu_alpha); None: act(gate) * up
        # GPU path: `gated` in one Triton kernel (helios.kernels.activation), clamps and alpha included
        self.fused = fused and act in ("silu", "gelu_tanh")
        self.gate_up = Linear(hidden_size, 2 * intermediate_size, switches=switches)
        self.down = Linear(intermediate_size, hidden_size, switches=switches)

    def forward(self, x: torch.Tensor, gate_up: torch.Tensor | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        """gate_up: the gate_up projection of x, already computed (then x is not read)."""
        if gate_up is None:
            gate_up = self.gate_up(x)
        if self.fused:
            from helios.kernels import activation
            from helios.kernels.gemv import gemv

            plain = self.limit is None and self.alpha is None
            if plain and self.down.serves_gemv(gate_up):
                # batch-1 decode: the activation rides in the down GEMV as it reads its input (same values)
                return gemv(gate_up, self.down.weight, gated=self.act, allow_pdl=self.down.switches.gemv_pdl)
            # NOTE: the GEMV's fold has no clamp: a clamped MLP takes the one act-and-mul launch, then the GEMV
            act_and_mul = getattr(activation, f"{self.act}_and_mul")
            return self.down(act_and_mul(gate_up, self.limit, self.clamp_after_act, self.alpha))
        return self.down(gated(gate_up, self.act, self.limit, self.clamp_after_act, alpha=self.alpha))
