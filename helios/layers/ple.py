"""Per-layer n-gram embeddings (qwen4_exp's PLE): hashed n-gram ids of each token, their embedding rows, a value
gated per residual stream, and a dilated depthwise causal conv whose last inputs are per-request state
(helios.core.manifest.PleConfig). Imports torch and helios.layers only.

The n-gram context is not state: each sequence's ngram_size - 1 tokens before its first scheduled one arrive in
meta.context_token_ids (the runner holds every request's tokens), so a restored prefix or a preempted request
needs nothing beyond its tokens. The conv state is a StateCache tensor at meta.state_slots, [S, W, S*H].
"""

from __future__ import annotations

import math

import torch
from torch import nn

from helios.core.manifest import PleConfig
from helios.layers import recurrent
from helios.layers.attention import AttentionMetadata
from helios.layers.hyper_connections import grouped_rms_norm
from helios.layers.linear import Embedding, Linear, Stacked
from helios.layers.linear_attention import sequence_starts
from helios.layers.norm import RMSNorm
from helios.layers.transfer import device_tensor
from helios.switches import DEFAULT_SWITCHES, Switches


def ngram_token_ids(
    token_ids: torch.Tensor,  # [T] int64, the step's tokens
    context: torch.Tensor,  # [B, n-1] int64: each sequence's n-1 tokens before its first one, oldest first
    query_start_loc: list[int],
    reset_token_id: int,
) -> torch.Tensor:  # [T, n] int64: column j = the token j places back
    """Each token and its n-1 predecessors, the reset token standing for every predecessor at or before a reset
    token (the n-gram context restarts after one; HF's _shift_right_ignore_eos) or before the sequence."""
    num_tokens, width = token_ids.shape[0], context.shape[1]
    lengths = [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]
    device = token_ids.device
    # one buffer of each sequence's context rows, then its tokens: [T + B*(n-1)]
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                      device_tensor(lengths, torch.int64, device), output_size=num_tokens)
    rows = torch.arange(num_tokens, device=device) + width * (seq_ids + 1)
    buf = torch.empty(num_tokens + len(lengths) * width, dtype=torch.int64, device=device)
    buf[rows] = token_ids
    context_rows = (device_tensor(query_start_loc[:-1], torch.int64, device)
                    + width * torch.arange(len(lengths), device=device))
    buf[(context_rows[:, None] + torch.arange(width, device=device)).flatten()] = context.flatten()
    columns, seen = [token_ids], torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for back in range(1, width + 1):
        prev = buf[rows - back]
        seen = seen | (prev == reset_token_id)
        columns.append(torch.where(seen, reset_token_id, prev))
    return torch.stack(columns, dim=1)


def hash_constants(config: PleConfig, index: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """The index-th PLE layer's hash constants (int64; not weights): multipliers [n], each head's modulus and table
    offset [heads]."""
    sizes = config.head_vocab_sizes[index]
    num_heads = (config.ngram_size - 1) * config.heads_per_ngram
    return (torch.tensor(config.multipliers[index], dtype=torch.int64, device=device),
            torch.tensor(sizes, dtype=torch.int64, device=device),
            torch.tensor([sum(sizes[:h]) for h in range(num_heads)], dtype=torch.int64, device=device))


def ngram_rows(tokens: torch.Tensor, constants: tuple[torch.Tensor, ...], config: PleConfig) -> torch.Tensor:
    """[T, n] n-gram tokens (ngram_token_ids) -> [T, heads] int64 table rows: per n = 2 .. ngram_size,
    heads_per_ngram hashes (the XOR of token_j * multiplier_j over its n tokens) modulo each head's prime, plus the
    head's offset. On the device in the forward, on the host for helios.runner.host_embedding's lookups."""
    multipliers, moduli, offsets = constants
    mixed = tokens[:, 0] * multipliers[0]
    ids = []
    for n in range(2, config.ngram_size + 1):
        mixed = torch.bitwise_xor(mixed, tokens[:, n - 1] * multipliers[n - 1])
        heads = slice((n - 2) * config.heads_per_ngram, (n - 1) * config.heads_per_ngram)
        ids.append(torch.remainder(mixed[:, None], moduli[heads]) + offsets[heads])
    return torch.cat(ids, dim=1)


class PleLayer(nn.Module):
    """One PLE layer (the p-th of arch.ple.layers). Tensors bound: embed.weight [rows, Dh], key.weight [S*H, E],
    value.weight [H, E], key_norm / query_norm / conv_norm.weight [S*H], conv.weight [S*H, K]."""

    def __init__(self, hidden_size: int, num_streams: int, config: PleConfig, index: int, eps: float,
                 device: torch.device | str = "cpu", switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        self.num_streams = num_streams
        width = num_streams * hidden_size
        num_heads = (config.ngram_size - 1) * config.heads_per_ngram
        self.embed = Embedding(config.table_rows[index], config.embed_dim // num_heads)
        self.key = Linear(config.embed_dim, width, switches=switches)
        self.value = Linear(config.embed_dim, hidden_size, switches=switches)
        self.key_norm = RMSNorm(width, eps, multiply_in_float32=True)
        self.query_norm = RMSNorm(width, eps, multiply_in_float32=True)
        self.conv_norm = RMSNorm(width, eps, multiply_in_float32=True)
        self.conv = Stacked(width, config.conv_kernel)
        self.multipliers, self.moduli, self.offsets = hash_constants(config, index, device)

    def forward(
        self,
        x: torch.Tensor,  # [T, S*H] the residual streams
        token_ids: torch.Tensor,  # [T] int64
        state: torch.Tensor,  # [S_slots, W, S*H]: each slot's last W = (K-1)*ngram_size conv inputs
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, S*H], what the layer adds to the streams
        num_tokens, s = x.shape[0], self.num_streams
        e = self.embed(self.ngram_ids(token_ids, meta)).flatten(1)  # [T, E]
        key = grouped_rms_norm(self.key(e), self.key_norm, s).view(num_tokens, s, -1)
        query = grouped_rms_norm(x, self.query_norm, s).view(num_tokens, s, -1)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)  # [T, S, 1]
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (recurrent.sigmoid(gate) * self.value(e)[:, None, :]).flatten(1)  # [T, S*H]
        normed = grouped_rms_norm(gated, self.conv_norm, s)
        conv = recurrent.causal_conv(normed, self._dilated_taps(), state, meta.state_slots_cpu,
                                     meta.query_start_loc_cpu, sequence_starts(meta), activation="silu")
        return gated + conv

    def ngram_ids(self, token_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, heads] int64
        """Rows of the table: per n = 2 .. ngram_size, heads_per_ngram hashes of the token's n-gram (the XOR of
        token_j * multiplier_j over its n tokens) modulo each head's prime, plus the head's offset."""
        c = self.config
        tokens = ngram_token_ids(token_ids, meta.context_token_ids, meta.query_start_loc_cpu, c.reset_token_id)
        return ngram_rows(tokens, (self.multipliers, self.moduli, self.offsets), c)

    def _dilated_taps(self) -> torch.Tensor:  # [S*H, (K-1)*ngram_size + 1]
        """The dilated conv as a dense causal one: tap j at offset j*ngram_size, zeros between (helios.layers.
        recurrent.causal_conv then keeps exactly the W = (K-1)*ngram_size inputs the state holds)."""
        weight, dilation = self.conv.weight, self.config.ngram_size
        dense = weight.new_zeros(weight.shape[0], (weight.shape[1] - 1) * dilation + 1)
        dense[:, ::dilation] = weight
        return dense
