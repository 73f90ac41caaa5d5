"""glm5_next (GLM-5.3-Flash, text): Kimi delta attention layers with the safe (lower-bounded) gate (`linear`:
per-request state) and MLA + DSA layers without position embeddings (`full`: paged latents and index rows), between
manifold-constrained hyper-connections: the residual stream is num_streams streams, [T, S, H], from the embedding
repeated to their mean before the final norm. Each feed-forward is a clamped SwiGLU MLP (arch.moe.dense_layers) or
sigmoid-routed clamped experts with a shared expert.

Block: pre-norm sublayers behind mHC: post, comb, h = attn_hc(x); x = post * mixer(attn_norm(h)) + comb^T x; the
same with mlp_hc, mlp_norm and the feed-forward. A shared DSA layer takes the selection of the layer before it.
Forward-only, no weights of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import AttentionBackend, AttentionMetadata
from helios.layers.dsa import DsaAttention, Selection
from helios.layers.kda import KimiDeltaAttention
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.mhc import ManifoldHyperConnection
from helios.layers.moe import SigmoidMoe
from helios.layers.norm import RMSNorm
from helios.switches import DEFAULT_SWITCHES, Switches


class Glm5NextLayer(nn.Module):
    """attn_hc, attn_norm and kda (a linear layer) or mla (MLA + DSA, a full one); mlp_hc, mlp_norm and mlp or moe."""

    def __init__(self, arch: Architecture, layer_idx: int, switches: Switches = DEFAULT_SWITCHES,
                 fused: bool = False, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        h, eps, moe, limit = arch.hidden_size, arch.rms_norm_eps, arch.moe, arch.swiglu_limit
        self.is_linear = arch.layer_types[layer_idx] == "linear"
        self.attn_hc = ManifoldHyperConnection(h, arch.mhc, eps, fused)
        self.attn_norm = RMSNorm(h, eps)
        if self.is_linear:
            self.kda = KimiDeltaAttention(h, arch.recurrent, eps, switches, fused=fused)
        else:
            shared = layer_idx in arch.dsa.shared_layers
            self.mla = DsaAttention(h, arch.num_heads, arch.mla, arch.dsa, shared, switches, backend)
        self.mlp_hc = ManifoldHyperConnection(h, arch.mhc, eps, fused)
        self.mlp_norm = RMSNorm(h, eps)
        if moe is None or layer_idx in moe.dense_layers:
            self.ffn_name = "mlp"
            ffn = GatedMLP(h, arch.intermediate_size, arch.hidden_act, switches=switches, limit=limit)
        else:
            self.ffn_name = "moe"
            ffn = SigmoidMoe(h, moe, arch.hidden_act, switches, limit=limit, fused=fused)
        self.add_module(self.ffn_name, ffn)
        self.fused_norms = fused  # the GPU path: each norm one Triton launch instead of five or six torch kernels

    def forward(self, x: torch.Tensor, cache, meta: AttentionMetadata,
                selection: Selection | None) -> tuple[torch.Tensor, Selection | None]:
        """x [T, S, H] -> ([T, S, H], this layer's DSA selection, None after a KDA layer)."""
        post, comb, h = self.attn_hc(x)
        h = self.attn_norm.forward_add(h, None, fused=self.fused_norms)[0]
        if self.is_linear:
            y, selection = self.kda(h, cache, meta), None
        else:
            y, selection = self.mla(h, cache, meta, selection)
        x = self.attn_hc.expand(x, y, post, comb)
        post, comb, h = self.mlp_hc(x)
        h = self.mlp_norm.forward_add(h, None, fused=self.fused_norms)[0]
        return self.mlp_hc.expand(x, getattr(self, self.ffn_name)(h), post, comb), selection


class Glm5NextForCausalLM(nn.Module):
    """forward's `caches` holds one entry per layer: the (latent pages, index rows) pair of an MLA + DSA layer
    (helios.runner.kv_cache), the (conv, recurrent) state pair of a KDA one (helios.runner.state_cache)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False):
        super().__init__()
        r = arch.recurrent
        if r is not None and (r.kind != "kimi_delta" or r.gate_lower_bound is None):
            raise ValueError("a glm5_next architecture's recurrent layers are kimi_delta with a gate lower bound")
        if arch.attention_layers and (arch.mla is None or arch.dsa is None):
            raise ValueError("a glm5_next architecture's attention layers are MLA with DSA (arch.mla, arch.dsa)")
        if arch.mhc is None or arch.position_embedding != "none":
            raise ValueError("a glm5_next architecture has mHC streams (arch.mhc) and no position embeddings")
        self.arch = arch
        self.switches = switches
        self.path = "eager"
        self.num_streams = arch.mhc.num_streams
        self.embed = Embedding(arch.vocab_size, arch.hidden_size)
        fused = getattr(backend, "fuses_layers", False)  # the Triton backend: KDA's, the MoE's and mHC's kernels
        self.layers = nn.ModuleList(Glm5NextLayer(arch, i, switches, fused, backend) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size,
                                                                    switches=switches)

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)[:, None, :].repeat(1, self.num_streams, 1)  # [T, S, H]
        selection = None
        for layer, cache in zip(self.layers, caches):
            x, selection = layer(x, cache, meta, selection)
        return self.norm(x.mean(dim=1))  # HF's Glm5NextTextHyperHead: the streams' plain mean

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, None, self.switches)
