"""qwen3_5 / qwen3_5_moe / qwen3_next: hybrid decoders of gated-delta-rule layers (most of them: per-request
recurrent state, no KV) and gated full-attention layers (per-head q/k norms, partial rotary, a sigmoid output
gate; paged KV), a dense MLP or a softmax top-k MoE with a sigmoid-gated shared expert.

Pre-norm blocks: x += mixer(attn_norm(x)); x += ffn(mlp_norm(x)). The zero-centred norms of the checkpoint are
stored shifted (1 + w) and multiply in float32, as HF computes them. Forward-only, no weights of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.linear_attention import GatedDeltaNet
from helios.layers.moe import SparseMoe
from helios.layers.norm import RMSNorm
from helios.layers.rotary import RotaryEmbedding
from helios.switches import DEFAULT_SWITCHES, Switches


class SharedExpertMoe(SparseMoe):
    """SparseMoe plus a shared expert every token takes, scaled by sigmoid(shared_gate x) (qwen3_5_moe).
    Tensors bound: those of SparseMoe, shared.gate_up / shared.down, shared_gate.weight [1, H]."""

    def __init__(self, arch: Architecture, switches: Switches = DEFAULT_SWITCHES) -> None:
        moe = arch.moe
        super().__init__(arch.hidden_size, moe.num_experts, moe.moe_intermediate_size, moe.num_experts_per_tok,
                         moe.norm_topk_prob, arch.hidden_act, switches=switches)
        self.shared = GatedMLP(arch.hidden_size, moe.shared_expert_intermediate_size, arch.hidden_act,
                               switches=switches)
        self.shared_gate = Linear(arch.hidden_size, 1, switches=switches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routed = super().forward(x)
        return routed + torch.sigmoid(self.shared_gate(x)) * self.shared(x)


class HybridLayer(nn.Module):
    """One pre-norm block whose mixer is a GatedDeltaNet (`linear`) or a gated Attention (`attn`)."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend, ffn: nn.Module,
                 ffn_name: str, switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        self.is_linear = arch.layer_types[layer_idx] == "linear"
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        if self.is_linear:
            self.linear = GatedDeltaNet(arch.hidden_size, arch.recurrent, arch.rms_norm_eps,
                                        fused=getattr(backend, "fuses_layers", False), switches=switches)
        else:
            self.attn = Attention(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, backend,
                                  qk_norm=arch.qk_norm, norm_eps=arch.rms_norm_eps, norm_multiply_in_float32=True,
                                  output_gate=arch.attn_output_gate, rotary_dim=arch.rotary_dim, switches=switches)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)

    def forward(self, x: torch.Tensor, cos_sin, cache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        h = self.attn_norm(x)
        x = x + (self.linear(h, cache, meta) if self.is_linear else self.attn(h, cos_sin, cache, meta))
        return x + getattr(self, self.ffn_name)(self.mlp_norm(x))


class Qwen3_5ForCausalLM(nn.Module):
    """qwen3_5 (dense), qwen3_5_moe and qwen3_next (MoE in every layer but arch.moe.dense_layers).

    forward's `caches` holds one entry per layer: the paged KV tensor of an attention layer, the (conv, recurrent)
    state pair of a linear one (helios.runner.state_cache)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False):
        super().__init__()
        if arch.recurrent is None or arch.recurrent.kind != "gated_delta":
            raise ValueError(f"a {arch.family} architecture needs gated_delta recurrent layers")
        self.arch = arch
        self.switches = switches
        self.path = "eager"
        self.embed = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            HybridLayer(arch, i, backend, *self._make_ffn(arch, i, switches), switches=switches)
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size,
                                                                    switches=switches)
        self.rotary = RotaryEmbedding(arch.rotary_dim or arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                      arch.max_position_embeddings, device)
        if arch.float32_norms:  # the core keeps these multipliers in float32: bind_tensors leaves them so
            for module in self.modules():
                if isinstance(module, RMSNorm) and module.multiply_in_float32:
                    module.keep_float32 = True

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False

    @staticmethod
    def _make_ffn(arch: Architecture, layer_idx: int, switches: Switches) -> tuple[nn.Module, str]:
        moe = arch.moe
        if moe is None or layer_idx in moe.dense_layers:
            return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, switches=switches), "mlp"
        if moe.shared_expert_intermediate_size:
            return SharedExpertMoe(arch, switches), "moe"
        return SparseMoe(arch.hidden_size, moe.num_experts, moe.moe_intermediate_size, moe.num_experts_per_tok,
                         moe.norm_topk_prob, arch.hidden_act, switches=switches), "moe"

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)
        cos_sin = self.rotary.cos_sin(meta.positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cos_sin, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, None, self.switches)
