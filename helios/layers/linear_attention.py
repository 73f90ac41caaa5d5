"""Recurrent token mixers of hybrid models, as modules: the gated delta rule layer (qwen3_5 / qwen3_next GDN).

A layer reads and updates its per-request state in place: `state` is (conv [S, K-1, C], recurrent [S, Hv, dk, dv]
float32), rows addressed by meta.state_slots (helios.engine.state_pool). The ops are helios.layers.recurrent's
torch references on every device, or the Triton kernels of helios.kernels.gated_delta on the fused (GPU) path.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import RecurrentConfig
from helios.layers import recurrent
from helios.layers.attention import AttentionMetadata, decode_rows, subset
from helios.layers.linear import Linear, Stacked, meta_parameter
from helios.switches import DEFAULT_SWITCHES, Switches


def sequence_starts(meta: AttentionMetadata) -> list[int]:
    """Each sequence's first position in this step (its computed tokens before it); derived once per step, every
    recurrent layer reads it."""
    starts = meta.derived.get("sequence_starts")
    if starts is None:
        qsl = meta.query_start_loc_cpu
        starts = meta.derived["sequence_starts"] = [seq_len - (qsl[i + 1] - qsl[i])
                                                    for i, seq_len in enumerate(meta.seq_lens_cpu)]
    return starts


def all_fresh(meta: AttentionMetadata) -> bool:
    """Whether every sequence of the step starts at position 0 (a host fact): the chunked rules then gather no
    state (helios.kernels.gated_delta.chunked_by_slot's all_fresh)."""
    return not any(sequence_starts(meta))


def fla_cu_seqlens(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # [B + 1] int64 each
    """query_start_loc as flash-linear-attention's varlen kernels take it, on the device and on the host, derived
    once per step: fla memoizes its chunk layout by these tensors' identity, so every recurrent layer of the step
    finds it built, and the host copy (from the metadata's host list: no sync) spares the build its device sync."""
    pair = meta.derived.get("fla_cu_seqlens")
    if pair is None:
        host = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64)
        pair = meta.derived["fla_cu_seqlens"] = (meta.query_start_loc.to(torch.int64, copy=True), host)
    return pair


def sequence_starts_device(meta: AttentionMetadata) -> torch.Tensor:  # [B] int64, on the metadata's device
    """sequence_starts from the device tensors (no host sync: graph-safe), derived once per step: the position of
    each sequence's first token this step. A decode step (one token per sequence) launches nothing for it.
    NOTE: T == B means one token each since the scheduler gives no sequence zero tokens (a graph's padded rows hold
    one each, position 0: fresh, as seq_len 0 made them)."""
    starts = meta.derived.get("sequence_starts_device")
    if starts is None:
        qsl = meta.query_start_loc
        one_each = meta.positions.shape[0] == qsl.shape[0] - 1
        starts = meta.derived["sequence_starts_device"] = meta.positions if one_each else meta.positions[qsl[:-1]]
    return starts


def token_sequences_device(meta: AttentionMetadata) -> torch.Tensor:  # [T] int32, on the metadata's device
    """The sequence each token of a step belongs to (searchsorted over query_start_loc: no host sync), derived once
    per step for every recurrent layer's conv (helios.kernels.gated_delta.causal_conv's seq_ids)."""
    ids = meta.derived.get("token_sequences_device")
    if ids is None:
        qsl = meta.query_start_loc
        rows = torch.arange(meta.positions.shape[0], dtype=qsl.dtype, device=qsl.device)
        ids = meta.derived["token_sequences_device"] = torch.searchsorted(qsl[1:], rows, right=True).to(torch.int32)
    return ids


def mixed_rows(meta: AttentionMetadata):
    """A mixed step's split for the fused recurrent layers: ((rows, metadata) of its one-token sequences, (rows,
    metadata) of the others), or None for a step of one kind (every sequence one token, or none).

    NOTE: batch invariance. A one-token sequence (a decode) takes the one-token kernel in every step, as it does
    in a decode step, instead of riding in fla's chunked prefill beside the prompts: fla runs float32 dots in TF32
    on sm80+, so in a float32 core a decode row's output depended on whether the step held a prompt (tests/gpu/
    test_recurrent_families_cuda.py, kimi_linear and qwen3_next: 16 requests together against alone)."""
    if "mixed_rows" not in meta.derived:
        singles = list(decode_rows(meta))
        split = None
        if 0 < len(singles) < meta.num_seqs:
            others = sorted(set(range(meta.num_seqs)) - set(singles))
            split = subset(meta, singles), subset(meta, others)
        meta.derived["mixed_rows"] = split
    return meta.derived["mixed_rows"]


class RecurrentMixer(nn.Module):
    """A recurrent token mixer: `fused` picks its Triton kernels (the GPU path) over the torch references."""

    fused: bool = False

    @property
    def decode_graph_safe(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph (helios.runner.cuda_graphs): the Triton path reads
        device-side slots and starts only; the torch path loops over host-side slot lists."""
        return self.fused

    def gated_norm(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, **order) -> torch.Tensor:
        """recurrent.rms_norm_gated (its `order` arguments), in one Triton launch on the fused path."""
        if self.fused:
            from helios.kernels.gated_norm import gated_rms_norm

            return gated_rms_norm(x, z, weight, eps, **order)
        return recurrent.rms_norm_gated(x, z, weight, eps, **order)


class GatedDeltaNet(RecurrentMixer):
    """Tensors bound (helios/core/layout.py): in_proj.weight [C + Hv*dv + 2*Hv, H] (rows q, k, v, z, b, a),
    conv.weight [C, K], dt_bias [Hv], A_log [Hv], norm.weight [dv], out.weight [H, Hv*dv]."""

    def __init__(self, hidden_size: int, config: RecurrentConfig, eps: float, fused: bool = False,
                 switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        self.fused = fused  # the Triton kernels (GPU path)
        c = config
        self.key_dim = c.num_key_heads * c.key_head_dim
        self.value_dim = c.num_heads * c.value_head_dim
        self.in_proj = Linear(hidden_size, c.conv_dim + self.value_dim + 2 * c.num_heads, switches=switches)
        self.conv = Stacked(c.conv_dim, c.conv_kernel)
        self.dt_bias = meta_parameter(c.num_heads)
        self.A_log = meta_parameter(c.num_heads)
        self.norm = Stacked(c.value_head_dim)
        self.out = Linear(self.value_dim, hidden_size, switches=switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        state: tuple[torch.Tensor, torch.Tensor],  # conv [S, K-1, C], recurrent [S, Hv, dk, dv] float32
        meta: AttentionMetadata,
        projected: torch.Tensor | None = None,  # in_proj(x), already computed (then x is not read)
    ) -> torch.Tensor:  # [T, H]
        c = self.config
        projected = self.in_proj(x) if projected is None else projected
        num_tokens = projected.shape[0]
        mixed, z, b, a = projected.split([c.conv_dim, self.value_dim, c.num_heads, c.num_heads], dim=-1)
        conv_state, recurrent_state = state
        if self.fused:
            o = self._mix_fused(mixed, a, b, conv_state, recurrent_state, meta)
        else:
            slots, qsl, starts = meta.state_slots_cpu, meta.query_start_loc_cpu, sequence_starts(meta)
            mixed = recurrent.causal_conv(mixed, self.conv.weight, conv_state, slots, qsl, starts)
            q, k, v = self._heads(mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1))
            g, beta = self._gates(a, b)
            o = recurrent.gated_delta_rule(q, k, v, g, beta, recurrent_state, slots, qsl, starts,
                                           chunk_size=c.chunk_size)
        if self.fused:  # heads side by side, z read in place (a strided view: no copy)
            o = self.gated_norm(o.reshape(num_tokens, self.value_dim), z, self.norm.weight, self.eps,
                                activation=c.output_gate, group_size=c.value_head_dim)
        else:
            o = self.gated_norm(o.reshape(-1, c.value_head_dim), z.reshape(-1, c.value_head_dim), self.norm.weight,
                                self.eps, activation=c.output_gate)
        return self.out(o.reshape(num_tokens, self.value_dim))

    def _heads(self, parts):  # the conv output's q, k, v columns [T, kd], [T, kd], [T, vd] -> [T, H, d] each
        c = self.config
        q, k, v = parts
        num_tokens = q.shape[0]
        return (q.reshape(num_tokens, c.num_key_heads, c.key_head_dim),
                k.reshape(num_tokens, c.num_key_heads, c.key_head_dim),
                v.reshape(num_tokens, c.num_heads, c.value_head_dim))

    def _gates(self, a: torch.Tensor, b: torch.Tensor):  # -> g [T, Hv] float32 log-decay, beta [T, Hv]
        # NOTE: recurrent's own softplus and sigmoid: torch's CPU kernels give bits that depend on an element's
        # place in the tensor, so a row would not compute the same alone and in a batch
        return recurrent.gated_delta_gates(a, b, self.A_log, self.dt_bias)

    def _mix_fused(self, mixed, a, b, conv_state, recurrent_state, meta: AttentionMetadata) -> torch.Tensor:
        """The Triton path (helios.kernels.gated_delta): a decode step (one token per sequence) in one launch
        from device-side slots and starts (graph-safe); a prompt step by the varlen conv kernel and fla's chunked
        rule; a mixed step as the two apart (mixed_rows)."""
        from helios.kernels import gated_delta

        split = mixed_rows(meta)
        if split is not None:  # decode rows by the one-token kernel, the prompts' rows chunked
            o = mixed.new_empty(mixed.shape[0], self.config.num_heads, self.config.value_head_dim)
            for rows, part in split:
                o[rows] = self._mix_fused(mixed[rows], a[rows], b[rows], conv_state, recurrent_state, part)
            return o
        qsl, starts = meta.query_start_loc, sequence_starts_device(meta)
        if mixed.shape[0] == meta.num_seqs:
            return gated_delta.gated_delta_decode(mixed, self.conv.weight, conv_state, a, b, self.A_log,
                                                  self.dt_bias, recurrent_state, meta.state_slots, starts,
                                                  self.config.num_key_heads)
        # planar: q, k and v each contiguous (their reshapes are views), as fla takes them without a copy
        # q and k heads l2-normalized by the conv where its tiles hold whole heads (fla's two launches saved)
        head = self.config.key_head_dim
        norm = gated_delta.can_norm_heads(head, self.key_dim, self.key_dim)
        q, k, v = self._heads(gated_delta.causal_conv(mixed, self.conv.weight, conv_state, meta.state_slots, qsl,
                                                      starts, seq_ids=token_sequences_device(meta),
                                                      planar=(self.key_dim, self.key_dim, self.value_dim),
                                                      norm_head=head if norm else None))
        g, beta = gated_delta.delta_gates(a, b, self.A_log, self.dt_bias)
        return gated_delta.gated_delta_rule(q, k, v, g, beta, recurrent_state, meta.state_slots, qsl, starts,
                                            chunk_size=self.config.chunk_size, cu_seqlens=fla_cu_seqlens(meta),
                                            all_fresh=all_fresh(meta), qk_normalized=norm)
