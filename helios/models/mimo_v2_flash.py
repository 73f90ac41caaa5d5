"""mimo_v2_flash (MiMo-V2-Flash, and the V2.5 / V2.6 mimo_v2 releases ignition maps here): pre-norm GQA blocks,
full and sliding-window layers (per arch.layer_types). A sliding layer has arch.sliding_num_kv_heads KV heads (its
own KV shape in the pages) and its own rope base (arch.rope_local_theta); the layer types in arch.attention_sinks
add per-head sink logits to the softmax. q/k heads are head_dim wide, v heads arch.v_head_dim (the pages keep V
zero-padded to head_dim: helios.layers.attention); rotary turns each head's leading arch.rotary_dim dims. V's scale
(attention_value_scale) is folded into the qkv weight by ignition. The feed-forward is a SwiGLU MLP (the dense
layers) or sigmoid-routed, group-limited experts without a shared expert (helios.layers.moe.SigmoidMoe).
Forward-only, no weights of its own.

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's attention
heads (and their sinks), full and sliding KV heads and dense MLP width; o and down sum over the ranks, the experts
split over them (helios.layers.parallel.ExpertParallelSigmoidMoe), the embedding and the head hold its vocabulary
rows (compute_logits gathers them).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.moe import SigmoidMoe, chain_moe_norms
from helios.layers.norm import RMSNorm, pre_norm_stack
from helios.layers.parallel import ExpertParallelSigmoidMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.layers.rotary import RotaryEmbedding
from helios.models.llama import is_sliding
from helios.switches import DEFAULT_SWITCHES, Switches


class MiMoV2FlashLayer(nn.Module):
    """x += attn(attn_norm(x)); x += mlp or moe(mlp_norm(x))."""

    def __init__(self, arch: Architecture, i: int, backend: AttentionBackend, switches: Switches = DEFAULT_SWITCHES,
                 tp: TensorGroup | None = None):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        sliding = is_sliding(arch, i)
        self.rope_index = 1 if sliding else 0  # which of the model's (rope, local rope) its attention turns by
        self.attn_norm = RMSNorm(h, eps)
        self.attn = Attention(h, arch.num_heads, arch.layer_kv_heads(i), arch.head_dim, backend,
                              sliding_window=arch.sliding_window if sliding else None, rotary_dim=arch.rotary_dim,
                              v_head_dim=arch.v_head_dim,
                              sinks=("sliding" if sliding else "full") in arch.attention_sinks, switches=switches)
        self.mlp_norm = RMSNorm(h, eps)
        self.is_moe = arch.moe is not None and i not in arch.moe.dense_layers
        if self.is_moe and tp is not None:  # the experts split over the ranks
            self.moe = ExpertParallelSigmoidMoe(h, arch.moe, arch.hidden_act, tp, switches=switches)
        elif self.is_moe:
            self.moe = SigmoidMoe(h, arch.moe, arch.hidden_act, switches=switches,
                                  fused=getattr(backend, "fuses_layers", False))
        else:
            self.mlp = GatedMLP(h, arch.intermediate_size, arch.hidden_act, switches=switches)
        self.norms_output: RMSNorm | None = None  # the next norm the MoE's combine takes (chain_moe_norms)
        self.input_normed = False  # the previous layer's combine took this layer's add and norm
        if tp is not None:  # o and a dense MLP's down read this rank's heads / width and sum over the ranks
            self.attn.o = row_parallel(self.attn.o, tp)
            if not self.is_moe:
                self.mlp.down = row_parallel(self.mlp.down, tp)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        ropes: tuple,  # the model's (rope, local rope) cos/sin pairs, each [T, rotary_dim]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv of this layer, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = x + self.attn(self.attn_norm(x), ropes[self.rope_index], kv_cache, meta)
        h = self.mlp_norm(x)
        return x + (self.moe(h) if self.is_moe else self.mlp(h))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, ropes: tuple, kv_cache: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # (output, stream before it)
        """forward() on the GPU path: each residual add taken by the norm after it in one launch
        (RMSNorm.forward_add); x is the previous layer's output, residual the stream before its add (None first)."""
        if self.input_normed:  # x normed, residual the stream (helios.layers.moe.chain_moe_norms)
            h = x
        else:
            h, residual = self.attn_norm.forward_add(x, residual, fused=True)
        a = self.attn(h, ropes[self.rope_index], kv_cache, meta)
        h, residual = self.mlp_norm.forward_add(a, residual, fused=True)
        if self.norms_output is not None:  # (the next norm of the stream, the stream) from the combine launch
            return self.moe(h, then_norm=(residual, self.norms_output))
        return (self.moe(h) if self.is_moe else self.mlp(h)), residual


class MiMoV2FlashForCausalLM(nn.Module):
    """Torch layers around the backend's attention; a sink or narrow-V layer never takes the fused qkv launch."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if norms_folded:
            raise ValueError("mimo_v2_flash norm weights are never folded")
        self.arch = arch
        self.switches = switches
        self.tp = tp
        self.path = "fused" if getattr(backend, "fuses_layers", False) else "eager"  # chosen once, here
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.layers = nn.ModuleList(MiMoV2FlashLayer(arch, i, backend, switches, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if self.path == "fused" and tp is None:
            chain_moe_norms(self.layers, self.norm, lambda layer: layer.moe if layer.is_moe else None)
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, head_rows, switches=switches)
        rotary_dim = arch.rotary_dim or arch.head_dim
        self.rotary = RotaryEmbedding(rotary_dim, arch.rope_theta, None, arch.max_position_embeddings, device)
        local_theta = arch.rope_local_theta if arch.rope_local_theta is not None else arch.rope_theta
        self.local_rotary = RotaryEmbedding(rotary_dim, local_theta, None, arch.max_position_embeddings, device)

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_pages, page_size, Nkv of the layer, D]
    ) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)
        ropes = (self.rotary.cos_sin(meta.positions, x.dtype), self.local_rotary.cos_sin(meta.positions, x.dtype))
        return pre_norm_stack(x, self.layers, kv_caches, meta, self.norm, self.path == "fused", ropes)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, None, self.switches)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.arch.vocab_size)
