"""The llama family and its close relatives: llama (incl. llama3 rope scaling), qwen2 (qkv bias) and
qwen3 (per-head q/k RMSNorm), selected by Architecture flags rather than separate classes.

Pre-norm decoder: x += attn(attn_norm(x)); x += mlp(mlp_norm(x)). Forward-only, no weights of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.norm import RMSNorm
from helios.layers.rotary import RotaryEmbedding


def folds_norms(x: torch.Tensor, projection: Linear) -> bool:
    """Whether the GPU path folds a layer's norms into its GEMVs: one row on the GEMV's terms, no bias, and
    HELIOS_FOLD_NORMS not "0" (benchmarks compare)."""
    from helios.kernels._triton import switched_on
    from helios.kernels.gemv import gemv_serves

    return projection.bias is None and gemv_serves(x, projection.weight) and switched_on("HELIOS_FOLD_NORMS")


def runs_norm_free(x: torch.Tensor, model: "LlamaForCausalLM") -> bool:
    """Whether this forward takes the norm-free batch-1 decode layers (DecoderLayer.forward_norm_free): the norm
    weights are folded (LlamaForCausalLM.fold_norm_weights), one row, the o and down products on the GEMV's
    terms (helios.kernels.gemv.gemv_serves), HELIOS_DEFER_NORMS not "0" (read at each capture: benchmarks
    compare)."""
    from helios.kernels._triton import switched_on
    from helios.kernels.gemv import gemv_serves

    if not model.norms_folded or x.shape[0] != 1:
        return False
    layer = model.layers[0]
    return (gemv_serves(x, layer.attn.o.weight) and gemv_serves(x, getattr(layer, layer.ffn_name).down.weight)
            and switched_on("HELIOS_DEFER_NORMS"))


def _wide(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A wide one-row product of the norm-free path (qkv, gate_up, the lm_head): the GEMV whatever HELIOS_GEMV
    admits (helios.kernels.gemv.NORM_FREE_WIDE), or `linear`'s choice."""
    from helios.kernels import gemv

    return gemv.gemv(x, weight) if gemv.NORM_FREE_WIDE else linear(x, weight)


def is_sliding(arch: Architecture, layer_idx: int) -> bool:
    return bool(arch.layer_types) and arch.layer_types[layer_idx] == "sliding"


class DecoderLayer(nn.Module):
    """One pre-norm block; `ffn` is a GatedMLP (bound as `mlp.*`) or a SparseMoe (bound as `moe.*`)."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend, ffn: nn.Module, ffn_name: str):
        super().__init__()
        sliding = is_sliding(arch, layer_idx)
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = Attention(
            arch.hidden_size,
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            backend,
            bias=arch.attention_bias,
            qk_norm=arch.qk_norm,
            norm_eps=arch.rms_norm_eps,
            scale=arch.query_scale,
            sliding_window=arch.sliding_window if sliding else None,
            softcap=arch.attn_logit_softcapping,
        )
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, D]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = x + self.attn(self.attn_norm(x), cos_sin, kv_cache, meta)
        return x + getattr(self, self.ffn_name)(self.mlp_norm(x))

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, H], the previous layer's output (the embedding for the first layer)
        residual: torch.Tensor | None,  # [T, H], the stream before that output's add; None for the first
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the stream before its add)
        """forward() on the GPU path: each residual add rides in the next norm's kernel; same values. At batch 1
        the norm and its add ride in the GEMV of the projection after them (helios.kernels.gemv)."""
        ffn = getattr(self, self.ffn_name)
        if folds_norms(x, self.attn.qkv):
            qkv, residual = self.attn_norm.forward_add_gemv(x, residual, self.attn.qkv.weight)
            a = self.attn(x, cos_sin, kv_cache, meta, qkv=qkv)
            if isinstance(ffn, GatedMLP) and ffn.fused and folds_norms(a, ffn.gate_up):
                gate_up, residual = self.mlp_norm.forward_add_gemv(a, residual, ffn.gate_up.weight)
                return ffn(a, gate_up=gate_up), residual
            h, residual = self.mlp_norm.forward_add(a, residual, fused=True)
            return ffn(h), residual
        h, residual = self.attn_norm.forward_add(x, residual, fused=True)
        h, residual = self.mlp_norm.forward_add(self.attn(h, cos_sin, kv_cache, meta), residual, fused=True)
        return ffn(h), residual

    def forward_norm_free(
        self,
        x: torch.Tensor,  # [1, H], the residual stream
        partials: torch.Tensor,  # [P] float32: the partial sums of x's squares (helios.kernels.gemv.RowNorm)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the stream after this layer, its partials)
        """forward() at batch-1 decode with no norm kernel: the norm weights are folded into the qkv and gate_up
        weights (LlamaForCausalLM.fold_norm_weights), so each projection reads the un-normed stream and its
        reader scales by the stream's rstd (the attention launch for qkv, the down GEMV for gate_up); the o and
        down GEMVs add into the stream and write the partial sums of its squares that rstd comes from."""
        from helios.kernels.gemv import RowNorm, gemv_add

        mlp = getattr(self, self.ffn_name)
        dim = x.shape[1]
        a = self.attn.attend_qkv(_wide(x, self.attn.qkv.weight), cos_sin, kv_cache, meta,
                                 row_norm=RowNorm(partials, dim, self.attn_norm.eps))
        x, partials = gemv_add(a, self.attn.o.weight, x)
        return gemv_add(_wide(x, mlp.gate_up.weight), mlp.down.weight, x, gated=mlp.act,
                        row_norm=RowNorm(partials, dim, self.mlp_norm.eps))


class LlamaForCausalLM(nn.Module):
    """llama / qwen2 / qwen3. Subclasses change the feed-forward of a layer via `make_ffn`."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu"):
        super().__init__()
        self.arch = arch
        # GPU path (Triton backend): fused residual + norm, rotary + cache write and gated activation kernels
        self.is_fused = getattr(backend, "fuses_layers", False)
        self.norms_folded = False  # fold_norm_weights ran: every attn / mlp norm weight is 1
        self.embed = Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, backend, *self.make_ffn(arch, i)) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size)
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings, device
        )
        # a sliding layer of a llama-like model keeps the global rope unless a local base is declared
        self.local_rotary = (
            RotaryEmbedding(arch.head_dim, arch.rope_local_theta, None, arch.max_position_embeddings, device)
            if arch.rope_local_theta is not None
            else self.rotary
        )

    def fold_norm_weights(self, force: bool = False) -> None:
        """On the GPU path of a 16-bit model with plain gated-MLP layers and no qkv / o / MLP biases: multiply each
        layer's attn and mlp norm weights into the columns of its qkv and gate_up weights (new tensors; the
        bound ones may be shared) and set the norm weights to 1, so that a projection of the un-normed stream
        times its rstd is the projection of the normed one (runs_norm_free). Every path then reads the folded
        weights: the norm kernels multiply by 1. Numerics: the weight products are rounded to 16 bits once, where
        the unfolded path rounds the normed row times its weight; both within the dtype's tolerance.
        HELIOS_DEFER_NORMS=0 at load keeps the weights as bound. force: any device and dtype (tests run the
        norm-free layers in the Triton interpreter on the CPU)."""
        from helios.kernels._triton import HAS_TRITON, interpret_mode, switched_on

        weight = self.layers[0].attn.qkv.weight
        on_gpu = (weight.device.type == "cuda" and weight.dtype in (torch.bfloat16, torch.float16) and HAS_TRITON
                  and not interpret_mode())
        eligible = (
            (force or on_gpu)
            and self.is_fused
            and switched_on("HELIOS_DEFER_NORMS")
            and all(self._folds(layer) for layer in self.layers)
        )
        if not eligible or self.norms_folded:
            return
        for layer in self.layers:
            mlp = getattr(layer, layer.ffn_name)
            for norm, projection in ((layer.attn_norm, layer.attn.qkv), (layer.mlp_norm, mlp.gate_up)):
                w = projection.weight
                projection._parameters["weight"] = nn.Parameter(w * norm.weight.to(w.dtype), requires_grad=False)
                norm._parameters["weight"] = nn.Parameter(torch.ones_like(norm.weight), requires_grad=False)
        self.norms_folded = True

    @staticmethod
    def _folds(layer: DecoderLayer) -> bool:
        mlp = getattr(layer, layer.ffn_name)
        return (isinstance(mlp, GatedMLP) and mlp.fused and mlp.gate_up.bias is None and mlp.down.bias is None
                and layer.attn.qkv.bias is None and layer.attn.o.bias is None
                and not layer.attn_norm.multiply_in_float32 and not layer.mlp_norm.multiply_in_float32)

    def make_ffn(self, arch: Architecture, layer_idx: int) -> tuple[nn.Module, str]:
        return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, fused=self.is_fused), "mlp"

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_pages, page_size, Nkv, D]
    ) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)
        if self.arch.embedding_scale is not None:
            x = x * torch.tensor(self.arch.embedding_scale, dtype=x.dtype)
        rope = self.rotary.cos_sin(meta.positions, x.dtype)
        local_rope = rope if self.local_rotary is self.rotary else self.local_rotary.cos_sin(meta.positions, x.dtype)
        if runs_norm_free(x, self):  # norms are folded only on the fused path
            from helios.kernels._triton import pdl_scope
            from helios.kernels.gemv import num_partials
            from helios.kernels.rmsnorm import row_sum_squares

            o = self.layers[0].attn.o.weight  # the embedding's partials in the o / down GEMVs' count
            with pdl_scope():  # every kernel of the step is ours: each may start beside the one before it
                partials = row_sum_squares(x, num_partials(*o.shape, o.dtype))
                for i, layer in enumerate(self.layers):
                    x, partials = layer.forward_norm_free(x, partials, local_rope if is_sliding(self.arch, i) else rope,
                                                          kv_caches[i], meta)
                return self.norm.forward_add(x, None, fused=True)[0]
        if self.is_fused:
            residual = None
            for i, layer in enumerate(self.layers):
                x, residual = layer.forward_fused(x, residual, local_rope if is_sliding(self.arch, i) else rope,
                                                  kv_caches[i], meta)
            return self.norm.forward_add(x, residual, fused=True)[0]
        for i, layer in enumerate(self.layers):
            x = layer(x, local_rope if is_sliding(self.arch, i) else rope, kv_caches[i], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if runs_norm_free(hidden, self):
            from helios.kernels._triton import pdl_scope

            with pdl_scope():
                logits = _wide(hidden, weight)
        else:
            logits = linear(hidden, weight)
        return softcap_logits(logits, self.arch.final_logit_softcapping)


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:  # [N, V]
    """cap * tanh(logits / cap) when the architecture declares a final soft-cap (gemma)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
