"""qwen4_exp (Qwen3.8-Flash-Next): qwen3_5_moe's gated-delta layers (per-request state) and gated attention, the
latter through the QSA indexer (helios.layers.qsa), between gated-residual hyper-connections: the residual stream
is num_streams streams of the hidden size, [T, S*H], from the embedding repeated to the final mix (hc_head, no final
norm). Every layer's feed-forward is the softmax top-k MoE with a sigmoid-gated shared expert; PLE layers first add
their hashed n-gram embeddings to the streams (helios.layers.ple).

Block: x += ple(x); h, w = attn_hc(x); x += w * mixer(h) per stream; h, w = mlp_hc(x); x += w * moe(h) per stream.
Each add is taken by the next hyper-connection (or the PLE before it), so on the Triton backend it rides in that
mix's first launch (helios.layers.hyper_connections). Forward-only, no weights of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.attention import AttentionBackend, AttentionMetadata
from helios.layers.hyper_connections import HyperConnection, add_to_streams
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.linear_attention import GatedDeltaNet
from helios.layers.ple import PleLayer, hash_constants, ngram_rows, ngram_token_ids
from helios.layers.qsa import IndexedAttention
from helios.layers.rotary import RotaryEmbedding
from helios.models.qwen3_5 import SharedExpertMoe
from helios.switches import DEFAULT_SWITCHES, Switches


class Qwen4ExpLayer(nn.Module):
    """One block: an optional PLE, then a GatedDeltaNet (`linear`) or an IndexedAttention (`attn`), then the MoE,
    each sublayer behind its hyper-connection."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend, rotary: RotaryEmbedding,
                 device: torch.device | str, switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        h, hc, eps = arch.hidden_size, arch.hyper_connections, arch.rms_norm_eps
        ple = arch.ple
        self.ple = None
        if ple is not None and layer_idx in ple.layers:
            self.ple = PleLayer(h, hc.num_streams, ple, ple.layers.index(layer_idx), eps, device, switches)
        fused = getattr(backend, "fuses_layers", False)  # the Triton backend: the mixes' kernels (two launches each)
        self.attn_hc = HyperConnection(h, hc, eps, switches=switches, fused=fused)
        self.is_linear = arch.layer_types[layer_idx] == "linear"
        if self.is_linear:
            self.linear = GatedDeltaNet(h, arch.recurrent, eps, fused=fused, switches=switches)
        else:
            self.attn = IndexedAttention(h, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.indexer, eps,
                                         rotary, switches, backend)
        self.mlp_hc = HyperConnection(h, hc, eps, switches=switches, fused=fused)
        self.moe = SharedExpertMoe(arch, switches, fused=fused)

    def forward(self, x: torch.Tensor, residual, token_ids: torch.Tensor, cos_sin, cache, meta: AttentionMetadata):
        """(x [T, S*H], residual) -> (x, residual): residual is the (output [T, H], weights [T, S]) of the sublayer
        before, not yet added to x (None for the first layer). cache: (conv, recurrent[, ple conv]) states of a linear
        layer, (kv, index keys) of an attention one."""
        if self.ple is not None:
            if residual is not None:
                x, residual = add_to_streams(x, *residual), None
            x = x + self.ple(x, token_ids, cache[2], meta)
        h, weights, x = self.attn_hc(x, residual)
        y = self.linear(h, cache[:2], meta) if self.is_linear else self.attn(h, cos_sin, cache, meta)
        h, mlp_weights, x = self.mlp_hc(x, (y, weights))
        return x, (self.moe(h), mlp_weights)


class Qwen4ExpForCausalLM(nn.Module):
    """forward's `caches` holds one entry per layer (helios.runner.model_runner._layer_caches): a linear layer's
    state tuple (helios.runner.state_cache; a PLE layer's third tensor is its conv state), an attention layer's
    (KV, index keys) pages (helios.runner.kv_cache). meta.context_token_ids carries the n-gram context of PLE."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False):
        super().__init__()
        if arch.recurrent is None or arch.recurrent.kind != "gated_delta" or arch.hyper_connections is None \
                or arch.moe is None or (arch.indexer is None and arch.attention_layers):
            raise ValueError("a qwen4_exp architecture needs gated_delta layers, hyper-connections, MoE and, with "
                             "attention layers, an indexer")
        self.arch = arch
        self.switches = switches
        self.path = "eager"
        self.num_streams = arch.hyper_connections.num_streams
        self.embed = Embedding(arch.vocab_size, arch.hidden_size)
        self.rotary = RotaryEmbedding(arch.rotary_dim or arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                      arch.max_position_embeddings, device)
        self.layers = nn.ModuleList(
            Qwen4ExpLayer(arch, i, backend, self.rotary, device, switches) for i in range(arch.num_layers)
        )
        self.hc_head = HyperConnection(arch.hidden_size, arch.hyper_connections, arch.rms_norm_eps, inject=False,
                                       switches=switches, fused=getattr(backend, "fuses_layers", False))
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size,
                                                                    switches=switches)

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False

    @staticmethod
    def host_tables(arch: Architecture) -> list[str]:
        """The tables helios.runner.host_embedding may keep in host memory: each PLE layer's hashed n-gram table (a
        step reads heads_per_ngram * (ngram_size - 1) rows per token). Its rows are then read from the device row
        cache by slot (HostRows stands in for the layer's ple.embed)."""
        return [f"layers.{i}.ple.embed.weight" for i in arch.ple.layers] if arch.ple is not None else []

    @staticmethod
    def host_table_rows(arch: Architecture, token_ids: torch.Tensor, context: torch.Tensor,
                        query_start_loc: list[int]) -> dict[str, torch.Tensor]:
        """The rows of each host table a batch reads, on the host: the hashed n-gram ids PleLayer.ngram_ids
        computes on the device, from the same tokens and context (AttentionMetadata.context_token_ids' rows)."""
        ple = arch.ple
        tokens = ngram_token_ids(token_ids, context, query_start_loc, ple.reset_token_id)
        return {f"layers.{layer}.ple.embed.weight": ngram_rows(tokens, hash_constants(ple, p), ple)
                for p, layer in enumerate(ple.layers)}

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids).repeat(1, self.num_streams)  # [T, S*H]
        cos_sin = self.rotary.cos_sin(meta.positions, x.dtype)
        residual = None
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, token_ids, cos_sin, cache, meta)
        return self.hc_head(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, None, self.switches)
