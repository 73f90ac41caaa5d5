"""The Mamba-2 token mixer (nemotron_h's NemotronHMamba2Mixer), as a module over helios' flattened batch.

in_proj -> [z, xBC, dt]; a depthwise causal conv (silu) over xBC; the selective scan (SSD) over x with B, C and
dt per head, its state per request in a state slot; y * silu(z) through a grouped RMSNorm; out. The ops are
helios.layers.recurrent's torch references on every device, or on the fused (GPU) path the Triton kernels of
helios.kernels.gated_delta (the conv), helios.kernels.mamba (the scan; a decode step's conv and scan in one launch)
and helios.kernels.gated_norm (the norm), imported there only. Imports torch only.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from helios.core.manifest import RecurrentConfig
from helios.layers import recurrent as ops
from helios.layers.attention import AttentionMetadata
from helios.layers.linear import Linear, Stacked, meta_parameter
from helios.layers.linear_attention import (
    RecurrentMixer,
    sequence_starts,
    sequence_starts_device,
    token_sequences_device,
)
from helios.switches import DEFAULT_SWITCHES, Switches


class _Conv(nn.Module):
    """The conv's taps `weight` [C, K] and, with a conv bias, `bias` [C]."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = meta_parameter(channels, kernel)
        self.bias = meta_parameter(channels) if bias else None


def gated_group_rms_norm(
    y: torch.Tensor,  # [T, I], the scan's output
    z: torch.Tensor,  # [T, I], the gate
    weight: torch.Tensor,  # [I]
    group_size: int,
    eps: float,
) -> torch.Tensor:  # [T, I] float32
    """NemotronHRMSNormGated: h = y * silu(z) in float32, normalised over groups of group_size channels, times the
    weight in float32 (HF's chunked path, where y arrives in float32). silu is helios.layers.recurrent's, whose
    bits do not depend on an element's offset in the batch."""
    num_tokens, inner = y.shape
    h = y.to(torch.float32) * ops.silu(z.to(torch.float32))
    groups = h.view(num_tokens, inner // group_size, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(torch.float32) * groups.view(num_tokens, inner)


class Mamba2Mixer(RecurrentMixer):
    """Tensors bound (helios/core/layout.py, layers.L.mamba.*): in_proj.weight [I + C + Hm, H] (rows z, x, B, C,
    dt), conv.weight [C, K] (+ conv.bias [C]), dt_bias, A_log, D [Hm], norm.weight [I], out.weight [H, I]."""

    def __init__(self, hidden_size: int, config: RecurrentConfig, eps: float,
                 switches: Switches = DEFAULT_SWITCHES, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused  # the Triton kernels (GPU path)
        if config.kind != "mamba2":
            raise ValueError(f"Mamba2Mixer needs mamba2 recurrent layers, not {config.kind}")
        c = config
        self.config = c
        self.eps = eps
        self.inner = c.num_heads * c.value_head_dim
        self.group_size = c.norm_group_size or c.value_head_dim
        self.dt_limit = tuple(c.time_step_limit) if c.time_step_limit is not None else (0.0, math.inf)
        self.in_proj = Linear(hidden_size, self.inner + c.conv_dim + c.num_heads, switches=switches)
        self.conv = _Conv(c.conv_dim, c.conv_kernel, c.conv_bias)
        self.dt_bias = meta_parameter(c.num_heads)
        self.A_log = meta_parameter(c.num_heads)
        self.D = meta_parameter(c.num_heads)
        self.norm = Stacked(self.inner)
        self.out = Linear(self.inner, hidden_size, switches=switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        state: tuple[torch.Tensor, torch.Tensor],  # conv [S, K-1, C], ssm [S, Hm, N, P] float32 (StateCache's rows)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        c = self.config
        num_tokens = x.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.inner, c.conv_dim, c.num_heads], dim=-1)
        conv_state, ssm_state = state
        # NOTE: the StateCache row is [Hm, N, P] (RecurrentConfig's [num_heads, key_head_dim, value_head_dim]);
        # Mamba-2's state is HF's [Hm, P, N]: the same elements, only ever read by this layer, so a view serves
        ssm_state = ssm_state.view(ssm_state.shape[0], c.num_heads, c.value_head_dim, c.key_head_dim)
        if self.fused:  # the norm in one launch (helios.kernels.gated_norm's nemotron order: the same roundings)
            y = self._mix_fused(xbc, dt, conv_state, ssm_state, meta).reshape(num_tokens, self.inner)
            return self.out(self.gated_norm(y, z, self.norm.weight, self.eps, norm_before_gate=False,
                                            group_size=self.group_size, multiply_in_float32=True))
        slots, qsl, starts = meta.state_slots_cpu, meta.query_start_loc_cpu, sequence_starts(meta)
        xbc = ops.causal_conv(xbc, self.conv.weight, conv_state, slots, qsl, starts, bias=self.conv.bias,
                              activation="silu")
        xs, b, cm = self._heads(xbc)
        y = ops.mamba2_scan(xs, dt, self.A_log, b, cm, self.D, self.dt_bias, ssm_state, slots, qsl, starts,
                            c.chunk_size, dt_limit=self.dt_limit)
        y = gated_group_rms_norm(y.reshape(num_tokens, self.inner), z, self.norm.weight, self.group_size, self.eps)
        return self.out(y.to(x.dtype))

    def _heads(self, xbc: torch.Tensor):  # [T, C] -> x [T, Hm, P], B and C [T, G, N] (views)
        c = self.config
        num_tokens, groups = xbc.shape[0], c.num_key_heads * c.key_head_dim
        xs, b, cm = xbc.split([self.inner, groups, groups], dim=-1)
        return (xs.reshape(num_tokens, c.num_heads, c.value_head_dim),
                b.reshape(num_tokens, c.num_key_heads, c.key_head_dim),
                cm.reshape(num_tokens, c.num_key_heads, c.key_head_dim))

    def _mix_fused(self, xbc, dt, conv_state, ssm_state, meta: AttentionMetadata) -> torch.Tensor:
        """The Triton path from device-side slots, bounds and starts (no host sync: graph-safe): a decode step (one
        token per sequence) in one launch (helios.kernels.mamba.mamba2_decode), else the varlen conv kernel, then
        helios.kernels.mamba's scan."""
        from helios.kernels.gated_delta import causal_conv
        from helios.kernels.mamba import mamba2_decode, mamba2_scan

        slots, qsl, starts = meta.state_slots, meta.query_start_loc, sequence_starts_device(meta)
        if xbc.shape[0] == slots.shape[0]:  # NOTE: no sequence is scheduled with zero tokens: one token each
            return mamba2_decode(xbc, dt, self.conv.weight, self.conv.bias, conv_state, self.A_log, self.D,
                                 self.dt_bias, ssm_state, slots, starts, self.config.num_key_heads,
                                 dt_limit=self.dt_limit)
        xbc = causal_conv(xbc, self.conv.weight, conv_state, slots, qsl, starts, bias=self.conv.bias,
                          activation="silu", seq_ids=token_sequences_device(meta))
        xs, b, cm = self._heads(xbc)
        return mamba2_scan(xs, dt, self.A_log, b, cm, self.D, self.dt_bias, ssm_state, slots, qsl, starts,
                           dt_limit=self.dt_limit, chunk_size=self.config.chunk_size)
