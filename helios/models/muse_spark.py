"""muse_spark (text): sliding and full GQA layers (rotary per layer: arch.nope_layers have none), weightless q/k and
output norms, an elementwise sigmoid gate before o, dense SwiGLU MLPs or a sigmoid-routed latent MoE with normed
latents, and residual gates in place of residual adds; the embedding is RMS-normed (no weight), the logits
soft-capped (ignition folded output_multiplier into lm_head and the routers).

Per layer: x = gate_a(x, norm(attn(attn_norm(x)))); x = gate_m(x, mlp_post_norm(ffn(mlp_norm(x)))), where
gate(r, h) = alpha * r + beta * h in float32 (alpha, beta stored per channel) and the norms are centred (1 + w
stored, float32 multiply), weightless (after attention) and input-scaled (after the ffn: norm(x * w)).
Forward-only. On the Triton backend (path "fused") each norm is one launch, q's and k's with their rotary, the output
norm with the sigmoid gate, and each post-norm, residual gate and the next norm are one
(helios.layers.norm.post_norm_add).

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's query heads
(with their gate rows) and KV heads and the dense MLP width; o and down sum over the ranks before the weightless
output norms and the residual gates (replicated, as the centred norms and NoPE layers are), the latent MoE's experts
split whole over them (helios.layers.parallel.ExpertParallelSigmoidMoe: router, score bias, latent projections and
norms replicated), the embedding and the head hold its vocabulary rows (compute_logits gathers them, then
soft-caps).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear, meta_parameter
from helios.layers.moe import SigmoidMoe
from helios.layers.norm import RMSNorm, norm_rotate_heads, post_norm_add
from helios.layers.parallel import ExpertParallelSigmoidMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.layers.rotary import RotaryEmbedding
from helios.models.llama import is_sliding, softcap_logits
from helios.switches import DEFAULT_SWITCHES, Switches


class MuseSparkAttention(Attention):
    """GQA with weightless per-head RMSNorms on q and k (the query's qk_scale_factor is in arch.query_scale), rotary
    only when given cos/sin (None: a NoPE layer), a weightless per-head RMSNorm over the attention output, then
    o *= sigmoid(gate x) elementwise (the gate rows follow v's in qkv, as qwen3_5's output_gate) and o. With `fused`
    (the Triton path) q's and k's norms and rotary are one launch (adjacent in qkv) and the output norm takes the gate
    in its launch."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend, switches: Switches):
        super().__init__(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, backend,
                         scale=arch.query_scale, output_gate=True, switches=switches,
                         sliding_window=arch.sliding_window if is_sliding(arch, layer_idx) else None)
        self.qk_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, has_weight=False)  # per head, q's and k's
        self.o_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, has_weight=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,  # each [T, D]; None: no rotary
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> torch.Tensor:  # [T, H]
        num_tokens, d, nq, nkv = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qk_size, kv_size = (nq + nkv) * d, nkv * d
        qk, v, gate = self.qkv(x).split([qk_size, kv_size, nq * d], dim=-1)
        q, k = norm_rotate_heads(qk.view(num_tokens, nq + nkv, d), nq, self.qk_norm, self.qk_norm, cos_sin, fused)
        v = v.reshape(num_tokens, nkv, d)
        o = self.backend.forward(q, k, v, kv_cache, meta.for_window(self.sliding_window), self.scale,
                                 self.sliding_window, None)
        o = self.o_norm.forward_gated(o, gate.view(num_tokens, nq, d), fused)
        return self.o(o.reshape(num_tokens, nq * d))


class ResidualGate(nn.Module):
    """alpha * residual + beta * h in float32, rounded to the stream's dtype (MuseSparkResidualGate). weight [2, H]:
    rows alpha, beta, computed by ignition from the gate, its temperature and eps."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = meta_parameter(2, hidden_size)

    def forward(self, residual: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # [T, H]
        alpha, beta = self.weight.float()
        return (alpha * residual.float() + beta * h.float()).to(residual.dtype)


class MuseSparkDecoderLayer(nn.Module):
    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend,
                 switches: Switches = DEFAULT_SWITCHES, tp: TensorGroup | None = None):
        super().__init__()
        h, eps, moe = arch.hidden_size, arch.rms_norm_eps, arch.moe
        post_eps = arch.post_norm_eps if arch.post_norm_eps is not None else eps
        self.attn_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.attn = MuseSparkAttention(arch, layer_idx, backend, switches)
        self.attn_post_norm = RMSNorm(h, post_eps, has_weight=False)
        self.attn_residual = ResidualGate(h)
        self.mlp_norm = RMSNorm(h, eps, multiply_in_float32=True)
        if moe is None or layer_idx in moe.dense_layers:
            self.ffn_name = "mlp"
            ffn = GatedMLP(h, arch.intermediate_size, arch.hidden_act, switches=switches)
        elif tp is not None:  # the experts split over the ranks
            self.ffn_name = "moe"
            ffn = ExpertParallelSigmoidMoe(h, moe, arch.hidden_act, tp, switches, norm_eps=(eps, post_eps))
        else:
            self.ffn_name = "moe"
            ffn = SigmoidMoe(h, moe, arch.hidden_act, switches, norm_eps=(eps, post_eps),
                             fused=getattr(backend, "fuses_layers", False))  # the experts inside the latents
        self.add_module(self.ffn_name, ffn)
        if tp is not None:  # o and a dense MLP's down read this rank's heads / width and sum over the ranks
            self.attn.o = row_parallel(self.attn.o, tp)
            if self.ffn_name == "mlp":
                self.mlp.down = row_parallel(self.mlp.down, tp)
        self.mlp_post_norm = RMSNorm(h, post_eps, scale_first=True)
        self.mlp_residual = ResidualGate(h)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,  # None: a NoPE layer
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        a = self.attn(self.attn_norm(x), cos_sin, kv_cache, meta)
        x = self.attn_residual(x, self.attn_post_norm(a))
        f = getattr(self, self.ffn_name)(self.mlp_norm(x))
        return self.mlp_residual(x, self.mlp_post_norm(f))

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, H] the stream
        h: torch.Tensor,  # [T, H] attn_norm(x), from the launch that wrote x
        next_norm: RMSNorm,  # the next layer's attn_norm, or the final norm
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (next_norm(x'), x') of forward's output x'
        """forward() on the Triton path: each post-norm, residual gate and the norm after it in one launch."""
        a = self.attn(h, cos_sin, kv_cache, meta, fused=True)
        h, x = post_norm_add(a, x, self.attn_post_norm, self.mlp_norm, True, gate=self.attn_residual.weight)
        f = getattr(self, self.ffn_name)(h)
        return post_norm_add(f, x, self.mlp_post_norm, next_norm, True, gate=self.mlp_residual.weight)


class MuseSparkForCausalLM(nn.Module):
    """The eager forward path (torch layers around the backend's attention), or on the Triton backend the fused one
    (MuseSparkDecoderLayer.forward_fused: the same values within float32 rounding); norm weights are never folded
    (centred and input-scaled norms)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if norms_folded:
            raise ValueError("muse_spark norm weights are never folded")
        if not arch.attn_output_gate or (arch.moe is not None and (arch.moe.scoring != "sigmoid"
                                                                    or not arch.moe.latent_norms)):
            raise ValueError("a muse_spark architecture has gated attention and a sigmoid-routed MoE with normed latents")
        self.arch = arch
        self.switches = switches
        self.path = "fused" if getattr(backend, "fuses_layers", False) else "eager"  # chosen once, here
        self.tp = tp
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.embed_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, has_weight=False)  # HF's normed embedding
        self.layers = nn.ModuleList(MuseSparkDecoderLayer(arch, i, backend, switches, tp)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = Linear(arch.hidden_size, head_rows, switches=switches)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings,
                                      device)
        self.nope = set(arch.nope_layers)

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
        if self.path == "fused":
            return self._forward_fused(x, rope, kv_caches, meta)
        x = self.embed_norm(x)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, None if i in self.nope else rope, kv_cache, meta)
        return self.norm(x)

    def _forward_fused(self, x: torch.Tensor, rope, kv_caches: list[torch.Tensor], meta: AttentionMetadata):
        """The layers on the Triton path: each layer's last launch writes the stream and the next norm of it."""
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        h, x = post_norm_add(x, None, self.embed_norm, self.layers[0].attn_norm, True)
        for i, (layer, kv_cache, next_norm) in enumerate(zip(self.layers, kv_caches, norms)):
            h, x = layer.forward_fused(x, h, next_norm, None if i in self.nope else rope, kv_cache, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        logits = linear(hidden, self.lm_head.weight, None, self.switches)
        if self.tp is not None:  # the cap after the gather, on the whole vocabulary as on one rank
            logits = self.tp.gather_vocab(logits, self.arch.vocab_size)
        return softcap_logits(logits, self.arch.final_logit_softcapping)
