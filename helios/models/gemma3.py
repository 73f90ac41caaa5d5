"""gemma3 (text): sandwich norms around attention and MLP, embeddings scaled by arch.embedding_scale in the
model dtype, q/k norms, query scale from arch.query_scale, sliding-window layers (per arch.layer_types)
with their own local rope base, gelu-tanh gated MLP, optional final and attention logit soft-capping.

Norm weights arrive as the multiplier (ignition applied gemma's 1 + w); gemma multiplies in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.norm_free import pdl_launches
from helios.layers.norm import RMSNorm
from helios.layers.rotary import RotaryEmbedding
from helios.models.llama import is_sliding, softcap_logits
from helios.switches import DEFAULT_SWITCHES, Switches

# HF's Gemma3TextConfig default for the local (sliding) rope base when a core does not state one
_DEFAULT_LOCAL_THETA = 10_000.0


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend,
                 switches: Switches = DEFAULT_SWITCHES):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.attn_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.attn = Attention(
            h,
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            backend,
            bias=arch.attention_bias,
            qk_norm=True,
            norm_eps=eps,
            norm_multiply_in_float32=True,
            scale=arch.query_scale,
            sliding_window=arch.sliding_window if is_sliding(arch, layer_idx) else None,
            softcap=arch.attn_logit_softcapping,
            switches=switches,
        )
        self.attn_post_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.mlp_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.mlp = GatedMLP(h, arch.intermediate_size, arch.hidden_act, switches=switches)
        self.mlp_post_norm = RMSNorm(h, eps, multiply_in_float32=True)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, D]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), cos_sin, kv_cache, meta))
        return x + self.mlp_post_norm(self.mlp(self.mlp_norm(x)))


class Gemma3ForCausalLM(nn.Module):
    """One forward path: torch layers around the backend's attention (the sandwich norms never fuse); with
    the pdl switch on, its one-row launches take PDL. Norm weights are never folded (gemma multiplies in float32)."""

    # its forward decides on shapes only (sliding windows are the kernels' masks): a prompt step's launches replay
    # as a CUDA graph (helios.runner.prompt_graphs) unless the runner keeps a window page group
    prompt_graph_safe = True

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False):
        super().__init__()
        if norms_folded:
            raise ValueError("gemma3 norm weights are never folded")
        self.arch = arch
        self.switches = switches
        self.pdl = switches.pdl is True
        self.embed = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, i, backend, switches) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size,
                                                                    switches=switches)
        # global layers: rope_theta with the declared scaling; local layers: rope_local_theta, unscaled
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings, device
        )
        local_theta = arch.rope_local_theta if arch.rope_local_theta is not None else _DEFAULT_LOCAL_THETA
        self.local_rotary = RotaryEmbedding(arch.head_dim, local_theta, None, arch.max_position_embeddings, device)
        self.embedding_scale = arch.embedding_scale if arch.embedding_scale is not None else arch.hidden_size**0.5

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_pages, page_size, Nkv, D]
    ) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)
        # NOTE: HF rounds the scale to the weight dtype first (bf16 sqrt(H) is not sqrt(H)).
        x = x * torch.tensor(self.embedding_scale, dtype=x.dtype)
        rope = self.rotary.cos_sin(meta.positions, x.dtype)
        local_rope = self.local_rotary.cos_sin(meta.positions, x.dtype)
        with pdl_launches(self.pdl):
            for i, layer in enumerate(self.layers):
                x = layer(x, local_rope if is_sliding(self.arch, i) else rope, kv_caches[i], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        with pdl_launches(self.pdl):
            logits = linear(hidden, weight, None, self.switches)
        return softcap_logits(logits, self.arch.final_logit_softcapping)
