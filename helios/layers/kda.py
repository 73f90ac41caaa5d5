"""Kimi delta attention (KDA, kimi_linear's linear-attention layers) as a module over helios' flattened batch.

in_proj -> [q, k, v (the short convs' channels), f_a, g_a, b]; a depthwise causal conv (silu) over q, k, v; the
per-channel forget gate g = -exp(A_log) softplus(f_b f_a x + dt_bias) (glm5_next's safe gate with
RecurrentConfig.gate_lower_bound: lower_bound * sigmoid(exp(A_log) (f_b f_a x + dt_bias))) and beta = sigmoid(b); the
Kimi delta rule with its state per request in a state slot; the output's per-head RMSNorm times sigmoid(g_b g_a x);
out. The ops are helios.layers.recurrent's torch references on every device, or on the fused (GPU) path the Triton
kernels of helios.kernels.kda (imported there only); there a decode step runs f_b, the KDA step, g_b and the gated
norm in one launch. Imports torch only.
"""

from __future__ import annotations

import torch

from helios.core.manifest import RecurrentConfig
from helios.layers import recurrent as ops
from helios.layers.attention import AttentionMetadata
from helios.layers.linear import Linear, Stacked, meta_parameter
from helios.layers.linear_attention import (
    RecurrentMixer,
    all_fresh,
    fla_cu_seqlens,
    mixed_rows,
    sequence_starts,
    sequence_starts_device,
    token_sequences_device,
)
from helios.switches import DEFAULT_SWITCHES, Switches


class KimiDeltaAttention(RecurrentMixer):
    """Tensors bound (helios/core/layout.py, layers.L.kda.*): in_proj.weight [C + 2*d + Hk, H] (rows q, k, v, f_a,
    g_a, b), conv.weight [C, K], f_b.weight and g_b.weight [Hk*d, d], dt_bias [Hk*d], A_log [Hk], norm.weight [d],
    out.weight [H, Hk*d]."""

    def __init__(self, hidden_size: int, config: RecurrentConfig, eps: float,
                 switches: Switches = DEFAULT_SWITCHES, fused: bool = False) -> None:
        super().__init__()
        c = config
        self.fused = fused  # the Triton kernels (GPU path)
        if c.kind != "kimi_delta" or c.num_key_heads != c.num_heads or c.key_head_dim != c.value_head_dim:
            raise ValueError("KimiDeltaAttention needs kimi_delta layers with one head count and one head size")
        self.config = c
        self.eps = eps
        self.head_dim = c.key_head_dim
        self.inner = c.num_heads * c.key_head_dim  # the width of each of q, k, v
        self.in_proj = Linear(hidden_size, c.conv_dim + 2 * self.head_dim + c.num_heads, switches=switches)
        self.conv = Stacked(c.conv_dim, c.conv_kernel)
        self.f_b = Linear(self.head_dim, self.inner, switches=switches)
        self.g_b = Linear(self.head_dim, self.inner, switches=switches)
        self.dt_bias = meta_parameter(self.inner)
        self.A_log = meta_parameter(c.num_heads)
        self.norm = Stacked(self.head_dim)
        self.out = Linear(self.inner, hidden_size, switches=switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        state: tuple[torch.Tensor, torch.Tensor],  # conv [S, K-1, C], recurrent [S, Hk, d, d] float32
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        c, d = self.config, self.head_dim
        num_tokens = x.shape[0]
        mixed, f_a, g_a, b = self.in_proj(x).split([c.conv_dim, d, d, c.num_heads], dim=-1)
        conv_state, recurrent_state = state
        split = mixed_rows(meta) if self.fused else None
        if split is not None:  # decode rows by the one-token kernel, the prompts' rows chunked
            out = x.new_empty(num_tokens, self.out.out_features)
            for rows, part in split:
                out[rows] = self._fused(mixed[rows], f_a[rows], g_a[rows], b[rows], conv_state, recurrent_state, part)
            return out
        if self.fused:
            return self._fused(mixed, f_a, g_a, b, conv_state, recurrent_state, meta)
        slots, qsl, starts = meta.state_slots_cpu, meta.query_start_loc_cpu, sequence_starts(meta)
        mixed = ops.causal_conv(mixed, self.conv.weight, conv_state, slots, qsl, starts, activation="silu")
        q, k, v = self._heads(mixed.split([self.inner] * 3, dim=-1))
        g, beta = ops.kimi_delta_gates(self.f_b(f_a), b, self.A_log, self.dt_bias, c.gate_lower_bound)
        o = ops.kimi_delta_rule(q, k, v, g, beta, recurrent_state, slots, qsl, starts, chunk_size=c.chunk_size)
        return self._output(o, g_a, num_tokens)

    def _output(self, o: torch.Tensor, g_a: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [T, H]
        """The gated output norm (g_b's gate) and out, from the rule's output [T, Hk, d]."""
        d = self.head_dim
        o = self.gated_norm(o.reshape(-1, d), self.g_b(g_a).reshape(-1, d), self.norm.weight, self.eps,
                            activation="sigmoid", multiply_in_float32=True)
        return self.out(o.reshape(num_tokens, self.inner))

    def _heads(self, parts):  # the conv output's q, k, v columns, [T, inner] each -> [T, H, d] each
        return (t.reshape(t.shape[0], self.config.num_heads, self.head_dim) for t in parts)

    def _fused(self, mixed, f_a, g_a, b, conv_state, recurrent_state, meta: AttentionMetadata) -> torch.Tensor:
        """The Triton path of a decode step or a prompt step, from in_proj's parts to out's output."""
        if mixed.shape[0] == meta.num_seqs:
            return self._decode_fused(mixed, f_a, g_a, b, conv_state, recurrent_state, meta)
        o = self._mix_fused(mixed, self.f_b(f_a), b, conv_state, recurrent_state, meta)
        return self._output(o, g_a, mixed.shape[0])

    def _decode_fused(self, mixed, f_a, g_a, b, conv_state, recurrent_state, meta: AttentionMetadata) -> torch.Tensor:
        """A decode step (one token per sequence) on the Triton path: between in_proj and out one launch
        (helios.kernels.kda.kda_decode) does the conv, the KDA step with f_b's product, and the gated output norm
        with g_b's, from device-side slots and starts (graph-safe). Values: f_b's and g_b's products in float32,
        rounded as their own launches round them; the norm as helios.kernels.gated_norm computes it."""
        from helios.kernels import kda

        norm = kda.GatedOutputNorm(g_a, self.g_b.weight, self.norm.weight, self.eps)
        o = kda.kda_decode(mixed, self.conv.weight, conv_state, f_a, b, self.A_log, self.dt_bias, recurrent_state,
                           meta.state_slots, sequence_starts_device(meta), self.config.gate_lower_bound,
                           f_b_weight=self.f_b.weight, output_norm=norm)
        return self.out(o.reshape(mixed.shape[0], self.inner))

    def _mix_fused(self, mixed, f, b, conv_state, recurrent_state, meta: AttentionMetadata) -> torch.Tensor:
        """The Triton path's prefill or mixed step (helios.kernels.kda): the varlen conv kernel and fla's chunk_kda."""
        from helios.kernels import gated_delta, kda

        c = self.config
        qsl, starts = meta.query_start_loc, sequence_starts_device(meta)
        # planar: q, k and v each contiguous (their reshapes are views), as fla takes them without a copy
        # q and k heads l2-normalized by the conv where its tiles hold whole heads (fla's two launches saved)
        norm = gated_delta.can_norm_heads(self.head_dim, self.inner, self.inner)
        q, k, v = self._heads(gated_delta.causal_conv(mixed, self.conv.weight, conv_state, meta.state_slots, qsl,
                                                      starts, seq_ids=token_sequences_device(meta),
                                                      planar=(self.inner,) * 3,
                                                      norm_head=self.head_dim if norm else None))
        safe = c.gate_lower_bound is not None
        g, beta = gated_delta.delta_gates(f, b, self.A_log, self.dt_bias,
                                          gated_delta.GATE_SAFE if safe else gated_delta.GATE_SOFTPLUS_KIMI,
                                          c.gate_lower_bound)
        g = g.view(g.shape[0], c.num_heads, self.head_dim)
        return kda.kda_rule(q, k, v, g, beta, recurrent_state, meta.state_slots, qsl, starts,
                            chunk_size=c.chunk_size, cu_seqlens=fla_cu_seqlens(meta),
                            all_fresh=all_fresh(meta), qk_normalized=norm)
