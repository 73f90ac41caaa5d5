"""minimax_m3 (MiniMax-M3, text): pre-norm GQA decoder layers (per-head q/k norms, partial rotary) whose sparse layers
(arch.msa.layers) attend through the lightning indexer's block selection (helios.layers.msa), each with a SwiGLU-OAI
feed-forward: a dense MLP (arch.moe.dense_layers) or sigmoid-routed experts (score bias, renormalised, scaled) plus a
shared expert. Every norm is zero-centred in the checkpoint, stored 1 + w and multiplied in float32, as HF does.

Block: x += attn(attn_norm(x)); x += ffn(mlp_norm(x)); on the Triton backend each add is taken by the next norm's
launch (forward_fused, pre_norm_stack). Forward-only, no weights of its own.

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's query and KV
heads, its index heads (arch.msa.num_heads: the ones its query heads read, split with them or one replicated) and its
dense MLP width; o and down sum over the ranks, the experts split over them (ExpertParallelSigmoidMoe: the router, its
score bias and the shared expert replicated), the embedding and the head hold its vocabulary rows (compute_logits
gathers them).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.moe import SigmoidMoe
from helios.layers.msa import SparseAttention
from helios.layers.norm import RMSNorm, pre_norm_stack
from helios.layers.parallel import ExpertParallelSigmoidMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.layers.rotary import RotaryEmbedding
from helios.switches import DEFAULT_SWITCHES, Switches


class MiniMaxM3Layer(nn.Module):
    """attn_norm, attn (Attention, or SparseAttention in a sparse layer), mlp_norm, then mlp or moe."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend,
                 switches: Switches = DEFAULT_SWITCHES, tp: TensorGroup | None = None) -> None:
        super().__init__()
        h, eps, moe = arch.hidden_size, arch.rms_norm_eps, arch.moe
        self.is_sparse = arch.msa is not None and layer_idx in arch.msa.layers
        self.attn_norm = RMSNorm(h, eps, multiply_in_float32=True)
        if self.is_sparse:
            self.attn = SparseAttention(h, arch.num_heads, arch.num_kv_heads, arch.head_dim, backend, arch.msa, eps,
                                        arch.rotary_dim, switches)
        else:
            self.attn = Attention(h, arch.num_heads, arch.num_kv_heads, arch.head_dim, backend, qk_norm=True,
                                  norm_eps=eps, norm_multiply_in_float32=True, rotary_dim=arch.rotary_dim,
                                  switches=switches)
        self.mlp_norm = RMSNorm(h, eps, multiply_in_float32=True)
        limit, alpha = arch.swiglu_limit, arch.swiglu_alpha
        if moe is None or layer_idx in moe.dense_layers:
            self.ffn_name = "mlp"
            ffn = GatedMLP(h, arch.intermediate_size, arch.hidden_act, switches=switches, limit=limit, alpha=alpha)
        elif tp is not None:  # the experts split over the ranks
            self.ffn_name = "moe"
            ffn = ExpertParallelSigmoidMoe(h, moe, arch.hidden_act, tp, switches, limit=limit, alpha=alpha)
        else:
            self.ffn_name = "moe"
            ffn = SigmoidMoe(h, moe, arch.hidden_act, switches, limit=limit, alpha=alpha,
                             fused=getattr(backend, "fuses_layers", False))
        self.add_module(self.ffn_name, ffn)
        if tp is not None:  # o and a dense MLP's down read this rank's heads / width and sum over the ranks
            self.attn.o = row_parallel(self.attn.o, tp)
            if self.ffn_name == "mlp":
                ffn.down = row_parallel(ffn.down, tp)

    def forward(self, x: torch.Tensor, cos_sin, cache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        """cache: the layer's (KV, index keys) pages (its KV alone in a model without sparse layers); a full layer
        reads only the KV."""
        cache = self._own(cache)
        x = x + self.attn(self.attn_norm(x), cos_sin, cache, meta)
        return x + getattr(self, self.ffn_name)(self.mlp_norm(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, cache,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # (output, stream before it)
        """forward() on the GPU path: each residual add taken by the norm after it in one launch
        (RMSNorm.forward_add); x is the previous layer's output, residual the stream before its add (None first)."""
        h, residual = self.attn_norm.forward_add(x, residual, fused=True)
        a = self.attn(h, cos_sin, self._own(cache), meta)
        h, residual = self.mlp_norm.forward_add(a, residual, fused=True)
        return getattr(self, self.ffn_name)(h), residual

    def _own(self, cache):
        """The pages this layer reads: a full layer of a model with an indexer only its KV."""
        return cache[0] if isinstance(cache, tuple) and not self.is_sparse else cache


class MiniMaxM3ForCausalLM(nn.Module):
    """forward's `caches` holds one (KV, index keys) pair per layer (helios.runner.kv_cache: every attention layer of
    a model with an indexer keeps index rows; a full layer leaves its own unused), or the KV alone per layer when
    arch.msa is None (no sparse layers)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if arch.swiglu_alpha is None or arch.swiglu_limit is None or not arch.qk_norm:
            raise ValueError("a minimax_m3 architecture has q/k norms and a clamped SwiGLU-OAI")
        if arch.moe is not None and (arch.moe.scoring != "sigmoid" or arch.moe.shared_expert_gate):
            raise ValueError("a minimax_m3 architecture's experts are sigmoid-routed with an ungated shared expert")
        self.arch = arch
        self.switches = switches
        self.path = "fused" if getattr(backend, "fuses_layers", False) else "eager"  # chosen once, here
        self.tp = tp
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.rotary = RotaryEmbedding(arch.rotary_dim or arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                      arch.max_position_embeddings, device)
        self.layers = nn.ModuleList(MiniMaxM3Layer(arch, i, backend, switches, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, head_rows, switches=switches)
        if arch.float32_norms:  # the core keeps the norms' 1 + w in float32: bind_tensors leaves them so
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.keep_float32 = True

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)
        cos_sin = self.rotary.cos_sin(meta.positions, x.dtype)
        return pre_norm_stack(x, self.layers, caches, meta, self.norm, self.path == "fused", cos_sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, None, self.switches)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.arch.vocab_size)
