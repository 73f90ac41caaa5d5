"""nemotron_h: a hybrid decoder whose blocks hold one pre-norm sublayer each: a Mamba-2 mixer (`linear`: per-request
state, no KV), attention without position embeddings (`full`: paged KV), or (`ffn`) a relu2 MLP or a sigmoid-routed
relu2 MoE with a shared expert and optional latent projections.

x += sublayer(norm(x)) per block; norms multiply in float32 (NemotronHRMSNorm). Forward-only, no weights of its own.

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's attention and
KV heads, Mamba-2 heads and B/C groups (arch.recurrent: its state slots hold those heads) and dense MLP width; o, the
mixer's out and the MLP's down sum over the ranks, the experts split over them (ExpertParallelSigmoidMoe: the router,
its score bias, the latent projections and the shared expert replicated), the embedding and the head hold its
vocabulary rows (compute_logits gathers them).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.mamba import Mamba2Mixer
from helios.layers.moe import SigmoidMoe
from helios.layers.norm import RMSNorm, pre_norm_stack
from helios.layers.parallel import ExpertParallelSigmoidMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.layers.relu2 import FusedRelu2MLP
from helios.switches import DEFAULT_SWITCHES, Switches


class PositionlessAttention(Attention):
    """Attention as the layer computes it, without rotary: q, k, v straight from the fused projection."""

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        o = self.backend.forward(q.reshape(num_tokens, self.num_heads, self.head_dim),
                                 k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
                                 v.reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous(),
                                 kv_cache, meta, self.scale, None, None)
        return self.o(o.reshape(num_tokens, q_size))


class NemotronHBlock(nn.Module):
    """One block: attn_norm + mamba / attn (a mixer layer), or mlp_norm + mlp / moe (an ffn layer)."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend,
                 switches: Switches = DEFAULT_SWITCHES, tp: TensorGroup | None = None) -> None:
        super().__init__()
        kind, moe = arch.layer_types[layer_idx], arch.moe
        h, eps = arch.hidden_size, arch.rms_norm_eps
        fused = getattr(backend, "fuses_layers", False)
        if kind == "linear":
            self.sublayer_name = "mamba"
            sublayer = Mamba2Mixer(h, arch.recurrent, eps, switches=switches, fused=fused)
        elif kind == "full":
            self.sublayer_name = "attn"
            sublayer = PositionlessAttention(h, arch.num_heads, arch.num_kv_heads, arch.head_dim, backend,
                                             switches=switches)
        elif moe is None or layer_idx in moe.dense_layers:
            self.sublayer_name = "mlp"
            sublayer = FusedRelu2MLP(h, arch.intermediate_size, switches, fused=fused)
        elif tp is not None:  # the experts split over the ranks
            self.sublayer_name = "moe"
            sublayer = ExpertParallelSigmoidMoe(h, moe, arch.hidden_act, tp, switches)
        else:
            self.sublayer_name = "moe"
            sublayer = SigmoidMoe(h, moe, arch.hidden_act, switches, fused=fused)
            if fused and sublayer.shared is not None:  # its relu2 in one launch too (same tensors, unbound yet)
                sublayer.shared = FusedRelu2MLP(h, moe.shared_expert_intermediate_size, switches, fused=True)
        self.kind = kind
        self.norm_name = "mlp_norm" if kind == "ffn" else "attn_norm"
        self.add_module(self.norm_name, RMSNorm(h, eps, multiply_in_float32=True))
        self.add_module(self.sublayer_name, sublayer)
        output = {"attn": "o", "mamba": "out", "mlp": "down"}.get(self.sublayer_name)  # the experts sum themselves
        if tp is not None and output:  # it reads this rank's heads / width and sums over the ranks
            setattr(sublayer, output, row_parallel(getattr(sublayer, output), tp))

    def forward(self, x: torch.Tensor, cache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        h = getattr(self, self.norm_name)(x)
        sublayer = getattr(self, self.sublayer_name)
        return x + (sublayer(h) if self.kind == "ffn" else sublayer(h, cache, meta))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cache,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # (output, stream before it)
        """forward() on the GPU path: the residual add and the norm after it in one launch (RMSNorm.forward_add);
        x is the previous block's output and residual the stream before its add (None for the first block)."""
        h, residual = getattr(self, self.norm_name).forward_add(x, residual, fused=True)
        sublayer = getattr(self, self.sublayer_name)
        return (sublayer(h) if self.kind == "ffn" else sublayer(h, cache, meta)), residual


class NemotronHForCausalLM(nn.Module):
    """forward's `caches` holds one entry per layer: the paged KV tensor of an attention layer, the (conv, ssm) state
    pair of a Mamba-2 one (helios.runner.state_cache), None for an ffn layer."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if arch.recurrent is not None and arch.recurrent.kind != "mamba2":
            raise ValueError(f"a nemotron_h architecture has mamba2 recurrent layers, not {arch.recurrent.kind}")
        if arch.position_embedding != "none" or arch.ffn_after_mixer or arch.hidden_act != "relu2":
            raise ValueError("a nemotron_h architecture has positionless attention, one sublayer per block and relu2")
        self.arch = arch
        self.switches = switches
        self.path = "fused" if getattr(backend, "fuses_layers", False) else "eager"  # chosen once, here
        self.tp = tp
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.layers = nn.ModuleList(NemotronHBlock(arch, i, backend, switches, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, head_rows, switches=switches)

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:  # [T, H]
        return pre_norm_stack(self.embed(token_ids), self.layers, caches, meta, self.norm, self.path == "fused")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, None, self.switches)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.arch.vocab_size)
