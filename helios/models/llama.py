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
from helios.layers.linear import Embedding, Linear, linear, one_row_gemv
from helios.layers.norm import RMSNorm
from helios.layers.norm_free import RowNorm, pdl_launches, product_add, stream_partials, wide_product
from helios.layers.parallel import RowParallelLinear, TensorGroup, VocabParallelEmbedding
from helios.layers.rotary import RotaryEmbedding
from helios.switches import DEFAULT_SWITCHES, Switches

# the forward paths a model picks from at construction (LlamaForCausalLM.path)
EAGER = "eager"  # torch ops and the torch attention backend (the CPU path, parity with transformers)
FUSED = "fused"  # the Triton backend's fused kernels: residual + norm, rotary + cache write, gated activation
NORM_FREE = "norm_free"  # FUSED, and one-row steps without norm kernels (the norms were folded at load)


def is_sliding(arch: Architecture, layer_idx: int) -> bool:
    return bool(arch.layer_types) and arch.layer_types[layer_idx] == "sliding"


class DecoderLayer(nn.Module):
    """One pre-norm block; `ffn` is a GatedMLP (bound as `mlp.*`) or a SparseMoe (bound as `moe.*`)."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend, ffn: nn.Module, ffn_name: str,
                 switches: Switches = DEFAULT_SWITCHES):
        super().__init__()
        sliding = is_sliding(arch, layer_idx)
        self.switches = switches
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
            switches=switches,
        )
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.ffn_name = ffn_name
        self.add_module(ffn_name, ffn)
        # the fused path at batch 1: each add + norm rides in the GEMV of the bias-free projection after it
        # (fold_norms switch; whether a step's row takes the GEMV is the projection's own per-call rule)
        self.fold_attn_norm = switches.fold_norms and self.attn.qkv.bias is None
        self.fold_mlp_norm = (switches.fold_norms and isinstance(ffn, GatedMLP) and ffn.fused
                              and ffn.gate_up.bias is None)

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
        the norm and its add ride in the GEMV of the projection after them (RMSNorm.forward_add_gemv)."""
        ffn = getattr(self, self.ffn_name)
        allow_pdl = self.switches.gemv_pdl
        if self.fold_attn_norm and self.attn.qkv.serves_gemv(x):
            qkv, residual = self.attn_norm.forward_add_gemv(x, residual, self.attn.qkv.weight, allow_pdl)
            a = self.attn(x, cos_sin, kv_cache, meta, qkv=qkv)
            if self.fold_mlp_norm and ffn.gate_up.serves_gemv(a):
                gate_up, residual = self.mlp_norm.forward_add_gemv(a, residual, ffn.gate_up.weight, allow_pdl)
                return ffn(a, gate_up=gate_up), residual
            h, residual = self.mlp_norm.forward_add(a, residual, fused=True)
            return ffn(h), residual
        h, residual = self.attn_norm.forward_add(x, residual, fused=True)
        h, residual = self.mlp_norm.forward_add(self.attn(h, cos_sin, kv_cache, meta), residual, fused=True)
        return ffn(h), residual

    def forward_norm_free(
        self,
        x: torch.Tensor,  # [1, H], the residual stream
        partials: torch.Tensor,  # [P] float32: the partial sums of x's squares (helios.layers.norm_free.RowNorm)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the stream after this layer, its partials)
        """forward() at batch-1 decode with no norm kernel: the norm weights are folded into the qkv and gate_up
        weights (helios.runner.norm_folding), so each projection reads the un-normed stream and its reader
        scales by the stream's rstd (the attention launch for qkv, the down GEMV for gate_up); the o and down
        GEMVs add into the stream and write the partial sums of its squares that rstd comes from."""
        mlp = getattr(self, self.ffn_name)
        dim, switches = x.shape[1], self.switches
        a = self.attn.attend_qkv(wide_product(x, self.attn.qkv.weight, switches), cos_sin, kv_cache, meta,
                                 row_norm=RowNorm(partials, dim, self.attn_norm.eps))
        x, partials = product_add(a, self.attn.o.weight, x, switches)
        return product_add(wide_product(x, mlp.gate_up.weight, switches), mlp.down.weight, x, switches,
                           gated=mlp.act, row_norm=RowNorm(partials, dim, self.mlp_norm.eps))


class LlamaForCausalLM(nn.Module):
    """llama / qwen2 / qwen3. Subclasses change the feed-forward of a layer via `make_ffn`.

    The forward path is picked once, here (`path`: EAGER, FUSED or NORM_FREE), from the backend, the device and
    dtype the weights are bound on, the switches and whether the runner folded the norm weights at load
    (`norms_folded`, helios.runner.norm_folding); a forward only asks whether its step is one row.

    With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's heads
    and MLP width (qkv and gate_up are its rows), o and down sum over the ranks, the embedding and the head hold
    its vocabulary rows (compute_logits gathers every rank's columns) and a MoE layer its experts."""

    # every Linear weight is read through helios.layers.linear.linear only (the GEMV paths read some on the GPU):
    # a 16-bit CPU runner may pack them for oneDNN (pack_cpu_linears)
    packs_cpu_linears = True
    # on the CPU a step with prompt rows runs oneDNN projections, SDPA's flash kernel (a row per thread) and
    # elementwise ops: bits independent of the thread count (tests/runner/test_thread_invariance.py), so the
    # runner's thread policy (helios.runner.cpu_threads) may time those steps too
    prompt_steps_thread_exact = True
    # its forward decides on shapes only (no host-side lengths): a prompt step's launches replay as a CUDA graph
    # (helios.runner.prompt_graphs); prompt_graph_reason still keeps MoE variants (qwen3_moe) eager
    prompt_graph_safe = True

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        self.arch = arch
        self.switches = switches
        self.tp = tp
        # GPU path (Triton backend): fused residual + norm, rotary + cache write and gated activation kernels
        self.is_fused = getattr(backend, "fuses_layers", False)
        self.norms_folded = norms_folded  # every attn / mlp norm weight is 1, multiplied into qkv / gate_up
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, backend, *self.make_ffn(arch, i), switches=switches) for i in range(arch.num_layers)
        )
        if tp is not None:
            for layer in self.layers:
                self._sum_outputs(layer, tp)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, head_rows, switches=switches)
        self.rotary = RotaryEmbedding(
            arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings, device
        )
        # a sliding layer of a llama-like model keeps the global rope unless a local base is declared
        self.local_rotary = (
            RotaryEmbedding(arch.head_dim, arch.rope_local_theta, None, arch.max_position_embeddings, device)
            if arch.rope_local_theta is not None
            else self.rotary
        )
        self.path = self._choose_path(device, dtype)
        # one-row launches take PDL (pdl switch): unset, in the norm-free steps only (every kernel there is ours)
        self.pdl = switches.pdl is True
        self.pdl_norm_free = switches.pdl is not False

    def _choose_path(self, device: torch.device | str, dtype: torch.dtype | None) -> str:
        if not self.is_fused:
            return EAGER
        # NOTE: not norm-free under tensor parallelism: its o and down products add into the stream unsummed
        if not (self.norms_folded and self.switches.defer_norms) or self.tp is not None:
            return FUSED
        # the norm-free layers need the GEMV for o and down (gemv_add): their one-row products must take it
        layer = self.layers[0]
        o, down = layer.attn.o.weight, getattr(layer, layer.ffn_name).down.weight
        if all(one_row_gemv(device, dtype, self.switches, *w.shape) for w in (o, down)):
            return NORM_FREE
        return FUSED

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        """Whether this family's layers can take norm weights folded into qkv / gate_up (the runner's load step,
        helios.runner.norm_folding, asks): plain gated MLPs and no qkv bias (o and MLP projections never have
        one in this family); qwen3_moe's experts cannot."""
        return not arch.attention_bias

    def make_ffn(self, arch: Architecture, layer_idx: int) -> tuple[nn.Module, str]:
        return (GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, fused=self.is_fused,
                         switches=self.switches), "mlp")

    @staticmethod
    def _sum_outputs(layer: DecoderLayer, tp: TensorGroup) -> None:
        """Tensor parallel: the layer's o and its MLP's down read this rank's heads / width and sum over the ranks
        (a MoE layer's experts sum inside the layer)."""
        o = layer.attn.o
        layer.attn.o = RowParallelLinear(o.in_features, o.out_features, tp, o.switches)
        ffn = getattr(layer, layer.ffn_name)
        if isinstance(ffn, GatedMLP):
            ffn.down = RowParallelLinear(ffn.down.in_features, ffn.down.out_features, tp, ffn.down.switches)

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
        ropes = [local_rope if is_sliding(self.arch, i) else rope for i in range(len(self.layers))]
        if self.path == EAGER:
            for layer, cos_sin, kv_cache in zip(self.layers, ropes, kv_caches):
                x = layer(x, cos_sin, kv_cache, meta)
            return self.norm(x)
        if self.path == NORM_FREE and x.shape[0] == 1:
            with pdl_launches(self.pdl_norm_free):  # every kernel of the step is ours: each may start early
                partials = stream_partials(x, self.layers[0].attn.o.weight)
                for layer, cos_sin, kv_cache in zip(self.layers, ropes, kv_caches):
                    x, partials = layer.forward_norm_free(x, partials, cos_sin, kv_cache, meta)
                return self.norm.forward_add(x, None, fused=True)[0]
        with pdl_launches(self.pdl):
            residual = None
            for layer, cos_sin, kv_cache in zip(self.layers, ropes, kv_caches):
                x, residual = layer.forward_fused(x, residual, cos_sin, kv_cache, meta)
            return self.norm.forward_add(x, residual, fused=True)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if self.path == NORM_FREE and hidden.shape[0] == 1:
            with pdl_launches(self.pdl_norm_free):
                logits = wide_product(hidden, weight, self.switches)
        else:
            with pdl_launches(self.pdl):
                logits = linear(hidden, weight, None, self.switches)
        logits = softcap_logits(logits, self.arch.final_logit_softcapping)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.arch.vocab_size)


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:  # [N, V]
    """cap * tanh(logits / cap) when the architecture declares a final soft-cap (gemma)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
