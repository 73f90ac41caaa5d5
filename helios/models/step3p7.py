"""step3p7 (Step-3.5 / Step-3.7 Flash, text): full and sliding-window attention layers (the sliding ones with their
own query head count, rope base and rotary width; both over the same KV heads), q/k norms, a sigmoid output gate per
head, query_pre_attn_scalar; dense SwiGLU MLPs in the first layers, then sigmoid-routed experts (score bias, top-k,
scaled) beside an always-on shared expert; per-layer SwiGLU clamps after the activation.

Pre-norm blocks: x += attn(attn_norm(x)); x += ffn(mlp_norm(x)). The zero-centred norms of the checkpoint are stored
shifted (1 + w) and multiply in float32, as HF computes them. Forward-only, no weights of its own.

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's query heads
(full and sliding: num_heads, sliding_num_heads) with their per-head gates, KV heads and dense MLP width; o and down
sum over the ranks, the routed experts split over them (helios.layers.parallel.ExpertParallelSigmoidMoe; the router,
its score bias and the shared expert replicated, each clamped as on one rank), the embedding and the head hold its
vocabulary rows (compute_logits gathers them).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.moe import SigmoidMoe
from helios.layers.norm import RMSNorm
from helios.layers.parallel import ExpertParallelSigmoidMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.layers.rotary import RotaryEmbedding
from helios.models.llama import is_sliding
from helios.switches import DEFAULT_SWITCHES, Switches


def _limit(limits: list[float], layer_idx: int) -> float | None:
    """A layer's SwiGLU clamp from arch.swiglu_limits(_shared): None where the entry is 0 or there is no list."""
    return (limits[layer_idx] or None) if limits else None


class Step3p7Moe(SigmoidMoe):
    """SigmoidMoe whose routed experts and shared expert clamp with the layer's own limits (after the activation).
    Tensors bound: SigmoidMoe's (router.weight, router.bias, gate_up, down, shared.gate_up / shared.down).
    NOTE: the router's logits are float32 (SigmoidMoe), as the release asks (need_fp32_gate); HF computes them in the
    weight dtype, so a 16-bit core may route a near-tie other than HF's 16-bit model (float32 cores match it)."""

    def __init__(self, arch: Architecture, layer_idx: int, switches: Switches = DEFAULT_SWITCHES,
                 fused: bool = False) -> None:
        super().__init__(arch.hidden_size, arch.moe, arch.hidden_act, switches,
                         limit=_limit(arch.swiglu_limits, layer_idx), clamp_after_act=True, fused=fused)
        self.shared = _shared_expert(arch, layer_idx, switches)


def _shared_expert(arch: Architecture, layer_idx: int, switches: Switches) -> GatedMLP:
    """The always-on shared expert, clamped with the layer's swiglu_limits_shared entry (not the routed experts')."""
    return GatedMLP(arch.hidden_size, arch.moe.shared_expert_intermediate_size, arch.hidden_act, switches=switches,
                    limit=_limit(arch.swiglu_limits_shared, layer_idx), clamp_after_act=True)


def _expert_parallel_moe(arch: Architecture, layer_idx: int, tp: TensorGroup,
                         switches: Switches) -> ExpertParallelSigmoidMoe:
    """Step3p7Moe with the routed experts split whole over the ranks (same clamps; the shared expert replicated)."""
    moe = ExpertParallelSigmoidMoe(arch.hidden_size, arch.moe, arch.hidden_act, tp, switches=switches,
                                   limit=_limit(arch.swiglu_limits, layer_idx), clamp_after_act=True)
    moe.shared = _shared_expert(arch, layer_idx, switches)
    return moe


class Step3p7Layer(nn.Module):
    """attn_norm, attn (gated per head), mlp_norm, then mlp (a dense layer) or moe."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend,
                 switches: Switches = DEFAULT_SWITCHES, tp: TensorGroup | None = None) -> None:
        super().__init__()
        h, eps, moe = arch.hidden_size, arch.rms_norm_eps, arch.moe
        sliding = is_sliding(arch, layer_idx)
        heads = arch.sliding_num_heads if sliding and arch.sliding_num_heads else arch.num_heads
        rotary_dim = arch.sliding_rotary_dim if sliding else arch.rotary_dim
        self.attn_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.attn = Attention(h, heads, arch.num_kv_heads, arch.head_dim, backend, qk_norm=True, norm_eps=eps,
                              norm_multiply_in_float32=True, scale=arch.query_scale,
                              sliding_window=arch.sliding_window if sliding else None, output_gate=True,
                              gate_per_head=True, rotary_dim=rotary_dim, switches=switches)
        self.mlp_norm = RMSNorm(h, eps, multiply_in_float32=True)
        if moe is None or layer_idx in moe.dense_layers:
            self.ffn_name = "mlp"
            ffn = GatedMLP(h, arch.intermediate_size, arch.hidden_act, switches=switches,
                           limit=_limit(arch.swiglu_limits_shared, layer_idx), clamp_after_act=True)
        elif tp is not None:
            self.ffn_name = "moe"
            ffn = _expert_parallel_moe(arch, layer_idx, tp, switches)
        else:
            self.ffn_name = "moe"
            ffn = Step3p7Moe(arch, layer_idx, switches, fused=getattr(backend, "fuses_layers", False))
        self.add_module(self.ffn_name, ffn)
        if tp is not None:  # o and a dense MLP's down read this rank's heads / width and sum over the ranks
            self.attn.o = row_parallel(self.attn.o, tp)
            if self.ffn_name == "mlp":
                self.mlp.down = row_parallel(self.mlp.down, tp)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, rotary dims of this layer]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = x + self.attn(self.attn_norm(x), cos_sin, kv_cache, meta)
        return x + getattr(self, self.ffn_name)(self.mlp_norm(x))

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, H] the previous layer's output (the embedding for the first)
        residual: torch.Tensor | None,  # [T, H] the stream before that output's add; None for the first layer
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the stream before its add)
        """forward with each residual add taken in its norm's launch (RMSNorm.forward_add): same values."""
        h, residual = self.attn_norm.forward_add(x, residual, fused=True)
        h, residual = self.mlp_norm.forward_add(self.attn(h, cos_sin, kv_cache, meta), residual, fused=True)
        return getattr(self, self.ffn_name)(h), residual


class Step3p7ForCausalLM(nn.Module):
    """One eager forward path (torch layers around the backend's attention); the full layers rotate with
    arch.rope_theta (+ rope_scaling) over rotary_dim, the sliding ones with rope_local_theta over sliding_rotary_dim."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if norms_folded:
            raise ValueError("step3p7 norm weights are never folded")
        if not (arch.attn_output_gate and arch.attn_gate_per_head and arch.qk_norm):
            raise ValueError("a step3p7 architecture has q/k norms and a per-head output gate")
        self.arch = arch
        self.switches = switches
        self.path = "eager"
        self.tp = tp
        # GPU path (Triton backend): each residual add rides in the next norm's kernel (forward_fused)
        self.is_fused = getattr(backend, "fuses_layers", False)
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.layers = nn.ModuleList(Step3p7Layer(arch, i, backend, switches, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, head_rows, switches=switches)
        max_pos = arch.max_position_embeddings
        self.rotary = RotaryEmbedding(arch.rotary_dim or arch.head_dim, arch.rope_theta, arch.rope_scaling, max_pos,
                                      device)
        local_theta = arch.rope_local_theta if arch.rope_local_theta is not None else arch.rope_theta
        self.local_rotary = RotaryEmbedding(arch.sliding_rotary_dim or arch.head_dim, local_theta, None, max_pos,
                                            device)

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_pages, page_size, Nkv, D]
    ) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)
        rope = self.rotary.cos_sin(meta.positions, x.dtype)
        local_rope = self.local_rotary.cos_sin(meta.positions, x.dtype)
        ropes = [local_rope if is_sliding(self.arch, i) else rope for i in range(len(self.layers))]
        if self.is_fused:
            residual = None
            for layer, cos_sin, kv_cache in zip(self.layers, ropes, kv_caches):
                x, residual = layer.forward_fused(x, residual, cos_sin, kv_cache, meta)
            return self.norm.forward_add(x, residual, fused=True)[0]
        for layer, cos_sin, kv_cache in zip(self.layers, ropes, kv_caches):
            x = layer(x, cos_sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, None, self.switches)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.arch.vocab_size)
