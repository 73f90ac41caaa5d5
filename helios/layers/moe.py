"""Sparse mixture of experts with softmax top-k routing (qwen3-moe style), forward-only.

Experts are stacked tensors as the core stores them: gate_up [E, 2*Fm, H] (gate rows first) and
down [E, H, Fm]. The CPU path loops over the experts that received tokens, in HF's order, so the
result matches transformers' own loop to float32 rounding (the expert products go through
`helios.layers.linear`, whose CPU bits do not depend on the thread count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import Activation
from helios.layers.activation import gated
from helios.layers.linear import Linear, Stacked, linear
from helios.switches import DEFAULT_SWITCHES, Switches


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] (logits dtype), expert ids [T, k] int64
    """Softmax in float32 over all experts, keep the top k, optionally renormalize them to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class SparseMoe(nn.Module):
    """Tensors bound: router.weight [E, H], gate_up.weight [E, 2*Fm, H], down.weight [E, H, Fm]."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        moe_intermediate_size: int,
        top_k: int,
        norm_topk_prob: bool,
        act: Activation = "silu",
        switches: Switches = DEFAULT_SWITCHES,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = act
        self.router = Linear(hidden_size, num_experts, switches=switches)
        self.gate_up = Stacked(num_experts, 2 * moe_intermediate_size, hidden_size)
        self.down = Stacked(num_experts, hidden_size, moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = route(self.router(x), self.top_k, self.norm_topk_prob)
        out = torch.zeros_like(x)
        # [E, k, T] one-hot of assignments; only experts with at least one token run
        assignment = F.one_hot(experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = (assignment.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            slot, token = torch.where(assignment[e])
            # `linear`: on the CPU its bits do not depend on the thread count (helios.layers.linear)
            h = gated(linear(x[token], self.gate_up.weight[e]), self.act)
            h = linear(h, self.down.weight[e]) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out
