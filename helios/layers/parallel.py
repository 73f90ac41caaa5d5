"""Tensor-parallel layers: the collectives a sharded model calls, and the layers whose slice of a weight needs one.

A `TensorGroup` names this rank's place among `world_size` ranks and the process group it reduces over (gloo on the CPU,
NCCL on GPUs: the same calls). A column-parallel projection (qkv, gate_up, a gated delta rule's in_proj) needs no class
of its own: a Linear bound to this rank's rows. What crosses ranks: `RowParallelLinear`'s sum (o, down, a gated delta
rule's, KDA's or Mamba-2 mixer's out, MLA's o; `row_parallel` swaps one in for a built Linear),
`VocabParallelEmbedding`'s masked lookup and sum, the head's vocabulary all-gather (`TensorGroup.gather_vocab`) and the
expert-parallel MoE layers' sums (`ExpertParallelMoe`, `ExpertParallelSigmoidMoe`). The slices are cut at load time
(helios.runner.parallel). Imports torch, layers and the manifest's config types only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helios.core.manifest import Activation, MoeConfig
from helios.layers.activation import gated
from helios.layers.linear import Linear, Stacked, linear, meta_parameter
from helios.layers.moe import SigmoidMoe, SparseMoe, route
from helios.switches import DEFAULT_SWITCHES, Switches


@dataclass(frozen=True)
class TensorGroup:
    """This rank among world_size ranks that each hold a slice of every sharded weight; `group` is the
    torch.distributed process group the activations reduce over (None: the default group)."""

    rank: int
    world_size: int
    group: Any = None

    def split(self, size: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's even share of `size` (heads, rows, experts); raises when it does not divide."""
        if size % self.world_size:
            raise ValueError(f"{what} = {size} does not split over {self.world_size} ranks")
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows: ceil(V / world_size) each, the last rank's shorter."""
        share = -(-vocab_size // self.world_size)
        start = min(vocab_size, self.rank * share)
        return start, min(vocab_size, start + share)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits)."""
        dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int, device: torch.device | str = "cpu") -> int:
        """The smallest of every rank's `value` (a KV pool every rank has room for)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [N, V_rank] -> [N, V]
        """Every rank's vocabulary columns side by side, on every rank (one all-gather; the last rank's shorter
        slice padded to the common width and the padding cut off)."""
        share = -(-vocab_size // self.world_size)
        if logits.shape[1] < share:
            logits = F.pad(logits, (0, share - logits.shape[1]))
        out = logits.new_empty(self.world_size * logits.shape[0], share)
        dist.all_gather_single(out, logits.contiguous(), group=self.group)  # rank-major rows
        rows = logits.shape[0]
        # NOTE: the width named, not -1: a step whose rows all continue a prompt samples none (rows = 0)
        return out.view(self.world_size, rows, share).permute(1, 0, 2).reshape(rows, self.world_size * share)[
            :, :vocab_size]


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks (o over heads, down over the MLP width): each
    rank's partial product `weight` [out, in / world_size], summed over the ranks. No bias (none of the families
    that shard has one on o or down; it would be added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorGroup, switches: Switches = DEFAULT_SWITCHES):
        super().__init__(in_features, out_features, bias=False, switches=switches)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in / world_size] -> [..., out]
        return self.tp.all_reduce(super().forward(x))

    def serves_gemv(self, x: torch.Tensor) -> bool:
        # NOTE: False, so a fused GatedMLP takes its down product through forward (and the sum) rather than its
        # activation-in-the-GEMV shortcut, which would skip the sum
        return False


def row_parallel(layer: Linear, tp: TensorGroup) -> RowParallelLinear:
    """A RowParallelLinear in place of `layer` (unbound, on meta): the same shape and switches, its input features
    this rank's (the architecture the layer was built from is the rank's)."""
    if layer.bias is not None:
        raise ValueError("a row-parallel projection with a bias would add it once per rank")
    return RowParallelLinear(layer.in_features, layer.out_features, tp, layer.switches)


class VocabParallelEmbedding(torch.nn.Module):
    """The embedding table's vocabulary rows [start, end) of this rank (`weight` [end - start, hidden]): a token
    outside them looks up zeros, and the sum over the ranks gives every token its one row, exactly."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorGroup):
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.vocab_range(num_embeddings)
        self.weight = meta_parameter(self.end - self.start, embedding_dim)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        inside = (token_ids >= self.start) & (token_ids < self.end)
        rows = F.embedding(torch.where(inside, token_ids - self.start, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(~inside[:, None], 0.0))


class ExpertParallelMoe(SparseMoe):
    """SparseMoe with the experts split over the ranks: the router (replicated) routes every token over all
    experts, each rank runs its own experts [first, first + count) for the tokens routed to them, in SparseMoe's
    order, and the sum over the ranks adds the experts' outputs. Tensors bound: router.weight [E, H],
    gate_up.weight [E / world_size, 2*Fm, H], down.weight [E / world_size, H, Fm] (a contiguous slice of the core's).

    NOTE: expert parallel rather than each expert's width split: an expert's products are the single-rank ones to
    the bit (the same rows through the same whole weights), only the per-token sum of top_k outputs is regrouped by
    rank (exact for top_k 2 over 2 ranks: a + b either way); a split width would also split every down product's
    reduction, and cut each expert's [gate | up] rows in two (a copy per expert) where whole experts are one view."""

    def __init__(self, hidden_size: int, num_experts: int, moe_intermediate_size: int, top_k: int,
                 norm_topk_prob: bool, tp: TensorGroup, act="silu", switches: Switches = DEFAULT_SWITCHES):
        super().__init__(hidden_size, num_experts, moe_intermediate_size, top_k, norm_topk_prob, act, switches)
        self.tp = tp
        self.first, end = tp.split(num_experts, "num_experts")
        count = end - self.first
        self.gate_up = Stacked(count, 2 * moe_intermediate_size, hidden_size)
        self.down = Stacked(count, hidden_size, moe_intermediate_size)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:  # [T, H]
        weights, experts = route(self.router(x if router_input is None else router_input), self.top_k,
                                 self.norm_topk_prob)
        out = torch.zeros_like(x)
        assignment, hit = local_assignment(experts, self.first, self.gate_up.weight.shape[0])
        for e in hit:
            slot, token = torch.where(assignment[e])
            h = gated(linear(x[token], self.gate_up.weight[e]), self.act)
            h = linear(h, self.down.weight[e]) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return self.tp.all_reduce(out)


class ExpertParallelSigmoidMoe(SigmoidMoe):
    """SigmoidMoe with the experts split over the ranks, as ExpertParallelMoe: the router and its score bias (every
    token routed over all experts), the latent projections and norms and the shared expert replicated; each rank
    runs its experts [first, first + count) for the tokens routed to them and the sum over the ranks adds the
    experts' outputs (before latent_out and the shared expert, which every rank then applies alike). Tensors bound:
    SigmoidMoe's, with gate_up (or up) and down [E / world_size, ...], a contiguous slice of the core's. The torch
    expert loop on every device (no fused path)."""

    def __init__(self, hidden_size: int, moe: MoeConfig, act: Activation, tp: TensorGroup,
                 switches: Switches = DEFAULT_SWITCHES, **options):
        """options: SigmoidMoe's limit, clamp_after_act, norm_eps and alpha."""
        super().__init__(hidden_size, moe, act, switches, **options)
        self.tp = tp
        self.first, end = tp.split(moe.num_experts, "moe.num_experts")
        count, width, fm = end - self.first, moe.latent_size or hidden_size, moe.moe_intermediate_size
        if act == "relu2":
            self.up = Stacked(count, fm, width)
        else:
            self.gate_up = Stacked(count, 2 * fm, width)
        self.down = Stacked(count, width, fm)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:  # [T, W]
        out = torch.zeros_like(x)
        assignment, hit = local_assignment(experts, self.first, self.down.weight.shape[0])
        for e in hit:
            slot, token = torch.where(assignment[e])
            out.index_add_(0, token, (self._expert(x[token], e) * weights[token, slot, None]).to(out.dtype))
        return self.tp.all_reduce(out)


def local_assignment(experts: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, list[int]]:
    """experts [T, k] (ids over all experts) -> ([count, k, T] one-hot of the slots routed to this rank's experts
    first .. first + count - 1, renumbered from 0; the local experts hit, ascending: the single-rank loop's order)."""
    local = experts - first
    assignment = F.one_hot(torch.where((local >= 0) & (local < count), local, count),
                           num_classes=count + 1)[..., :count].permute(2, 1, 0)
    return assignment, (assignment.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
