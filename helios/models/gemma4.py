"""gemma4 (text): gemma3's sandwich-normed layers plus what Gemma4TextModel adds (arch.gemma4 lists it): full layers
with their own head dim, kv heads and proportional rope, a weightless v norm and attention scale 1, k = v on full
layers, KV-shared layers reading an earlier layer's pages, double-wide MLPs, the MoE block beside the MLP,
per-layer embeddings (PLE) gating a branch after the feed-forward, a scalar on every layer's output.

Norm weights are the multiplier itself (gemma4 has no 1 + w), multiplied in float32 as HF does. On the Triton backend
(path "fused") q's and k's norms and rotary are one launch (helios.layers.norm.norm_rotate_heads), and so are each
post-norm, residual add (and layer scalar) and the norm after it (helios.layers.norm.post_norm_add).

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's query heads,
its KV heads of each layer kind (num_kv_heads, full_num_kv_heads: a share, or one replicated) and its MLP width (a
double-wide MLP's too); a KV-shared layer reads its source layer's pages on the same rank, which hold the KV heads its
query heads read. o and down sum over the ranks, the MoE block's experts split whole over them
(helios.layers.parallel.ExpertParallelMoe, its router replicated), the embedding and the tied head hold its
vocabulary rows (compute_logits gathers them, then soft-caps). The per-layer embeddings (ple.*, each layer's
ple_gate / ple_proj), the norms and the layer scalars are replicated: every rank computes the same PLE branch.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture, RopeScaling
from helios.layers.activation import ACTIVATIONS, GatedMLP, act_and_mul, softcap
from helios.layers.attention import AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear, meta_parameter
from helios.layers.moe import SparseMoe
from helios.layers.norm import RMSNorm, norm_rotate_heads, post_norm_add
from helios.layers.norm_free import pdl_launches
from helios.layers.parallel import ExpertParallelMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.layers.gemma4_inputs import per_layer_inputs
from helios.layers.rotary import RotaryEmbedding
from helios.models.llama import is_sliding
from helios.switches import DEFAULT_SWITCHES, Switches


def reads_shared_kv(arch: Architecture, layer_idx: int) -> bool:
    """Whether the layer reads another layer's KV pages (and writes none)."""
    return bool(arch.kv_sources) and arch.kv_sources[layer_idx] != layer_idx


class Gemma4Attention(nn.Module):
    """q (and, keeping its own KV, k and v) from one projection; q/k RMSNorms, rotary, v's weightless RMSNorm (HF's
    Gemma4RMSNorm without a weight); scale 1. With `fused` (the Triton path) q's and k's norms and rotary: one launch.

    Tensors bound: qkv.weight [(Nq + Nkv*(2, or 1 with k = v, or 0 when KV-shared))*D, H], q_norm.weight [D],
    k_norm.weight [D] (own KV only), o.weight [H, Nq*D]. A KV-shared layer reads the pages its source layer wrote this
    step (the same cache tensor and, for a sliding layer, the same window group).
    """

    attends_through_backend = True  # device work only around the backend: CUDA graphs (runner.cuda_graphs)

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend,
                 switches: Switches = DEFAULT_SWITCHES):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.num_kv_heads, self.head_dim = arch.kv_shape(layer_idx)
        self.num_heads, self.backend = arch.num_heads, backend
        self.shared = reads_shared_kv(arch, layer_idx)
        self.k_eq_v = arch.gemma4.k_eq_v and not is_sliding(arch, layer_idx)
        self.sliding_window = arch.sliding_window if is_sliding(arch, layer_idx) else None
        kv_rows = 0 if self.shared else self.num_kv_heads * self.head_dim * (1 if self.k_eq_v else 2)
        self.qkv = Linear(h, self.num_heads * self.head_dim + kv_rows, switches=switches)
        self.q_norm = RMSNorm(self.head_dim, eps, multiply_in_float32=True)
        self.k_norm = None if self.shared else RMSNorm(self.head_dim, eps, multiply_in_float32=True)
        self.v_norm = None if self.shared else RMSNorm(self.head_dim, eps, has_weight=False)
        self.o = Linear(self.num_heads * self.head_dim, h, switches=switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, D]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]: its own, or its source layer's
        meta: AttentionMetadata,
        fused: bool = False,
    ) -> torch.Tensor:  # [T, H]
        num_tokens, d = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        meta = meta.for_window(self.sliding_window)
        qkv = self.qkv(x)
        if self.shared:
            # NOTE: the backends write K/V, then attend; a shared layer hands them the rows its source layer wrote
            # at these slots this step, so the write changes nothing and every backend serves it unchanged
            flat = kv_cache.view(2, -1, self.num_kv_heads, d)
            k, v = flat[0, meta.slot_mapping], flat[1, meta.slot_mapping]
            q, _ = norm_rotate_heads(qkv.view(num_tokens, self.num_heads, d), self.num_heads, self.q_norm, None,
                                     cos_sin, fused)
        else:
            heads = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, d)
            q, k = norm_rotate_heads(heads, self.num_heads, self.q_norm, self.k_norm, cos_sin, fused)
            raw_v = heads[:, self.num_heads :] if self.k_eq_v else qkv[:, q_size + kv_size :].view(
                num_tokens, self.num_kv_heads, d)
            v = self.v_norm(raw_v)
        o = self.backend.forward(q, k, v, kv_cache, meta, 1.0, self.sliding_window, None)
        return self.o(o.reshape(num_tokens, q_size))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend,
                 switches: Switches = DEFAULT_SWITCHES, tp: TensorGroup | None = None):
        super().__init__()
        h, eps, g = arch.hidden_size, arch.rms_norm_eps, arch.gemma4
        self.attn_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.attn = Gemma4Attention(arch, layer_idx, backend, switches)
        self.attn_post_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.mlp_norm = RMSNorm(h, eps, multiply_in_float32=True)
        wide = 2 if g.double_wide_mlp and reads_shared_kv(arch, layer_idx) else 1
        self.mlp = GatedMLP(h, arch.intermediate_size * wide, arch.hidden_act, switches=switches)
        self.mlp_post_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.moe = None
        if arch.moe is not None:  # beside the MLP: its own pre and post norms, then the sum's post norm
            m = arch.moe
            self.mlp_post_norm_1 = RMSNorm(h, eps, multiply_in_float32=True)
            self.moe_norm = RMSNorm(h, eps, multiply_in_float32=True)
            if tp is not None:  # the experts split over the ranks
                self.moe = ExpertParallelMoe(h, m.num_experts, m.moe_intermediate_size, m.num_experts_per_tok,
                                             m.norm_topk_prob, tp, arch.hidden_act, switches)
            else:
                self.moe = SparseMoe(h, m.num_experts, m.moe_intermediate_size, m.num_experts_per_tok,
                                     m.norm_topk_prob, arch.hidden_act, switches,
                                     fused=getattr(backend, "fuses_layers", False))
            self.moe_post_norm = RMSNorm(h, eps, multiply_in_float32=True)
            self.router_norm = RMSNorm(h, eps, has_weight=False)  # its scale is folded into the router
        self.act = ACTIVATIONS[arch.hidden_act]
        self.act_name = arch.hidden_act
        if g.ple_dim:
            self.ple_gate = Linear(h, g.ple_dim, switches=switches)
            self.ple_proj = Linear(g.ple_dim, h, switches=switches)
            self.ple_post_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.layer_scalar = meta_parameter(1)
        if tp is not None:  # o and down read this rank's heads / width and sum over the ranks
            self.attn.o = row_parallel(self.attn.o, tp)
            self.mlp.down = row_parallel(self.mlp.down, tp)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        ple: torch.Tensor | None,  # [T, P]: this layer's per-layer input
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), cos_sin, kv_cache, meta))
        y = self.mlp(self.mlp_norm(x))
        if self.moe is not None:
            moe = self.moe(self.moe_norm(x), router_input=self.router_norm(x))
            y = self.mlp_post_norm_1(y) + self.moe_post_norm(moe)
        x = x + self.mlp_post_norm(y)
        if ple is not None:
            x = x + self.ple_post_norm(self.ple_proj(self.act(self.ple_gate(x)) * ple))
        return x * self.layer_scalar

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, H] the stream
        h: torch.Tensor,  # [T, H] attn_norm(x), from the launch that wrote x
        next_norm: RMSNorm,  # the next layer's attn_norm, or the final norm
        ple: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (next_norm(x'), x') of forward's output x'
        """forward() on the Triton path: each post-norm, residual add (the last with the layer scalar) and the norm
        after it in one launch."""
        a = self.attn(h, cos_sin, kv_cache, meta, fused=True)
        h, x = post_norm_add(a, x, self.attn_post_norm, self.mlp_norm, True)
        y = self.mlp(h)
        if self.moe is not None:
            moe = self.moe(self.moe_norm(x), router_input=self.router_norm(x))
            _, y = post_norm_add(moe, self.mlp_post_norm_1(y), self.moe_post_norm, None, True)
        if ple is None:
            return post_norm_add(y, x, self.mlp_post_norm, next_norm, True, scale=self.layer_scalar)
        _, x = post_norm_add(y, x, self.mlp_post_norm, None, True)
        p = self.ple_proj(act_and_mul(self.ple_gate(x), ple, self.act_name, kernel=True))  # one launch, same values
        return post_norm_add(p, x, self.ple_post_norm, next_norm, True, scale=self.layer_scalar)


class Gemma4ForCausalLM(nn.Module):
    """The eager forward path (torch layers around the backend's attention), or on the Triton backend the fused one
    (Gemma4DecoderLayer.forward_fused, the MoE block's helios.kernels.fused_moe: the same values within float32
    rounding); norms never fold."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if norms_folded:
            raise ValueError("gemma4 norm weights are never folded")
        g = arch.gemma4
        self.arch, self.switches, self.pdl, self.tp = arch, switches, switches.pdl is True, tp
        self.path = "fused" if getattr(backend, "fuses_layers", False) else "eager"  # chosen once, here
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        if g.ple_dim:
            self.ple = nn.Module()
            self.ple.embed = Embedding(g.ple_vocab_size, arch.num_layers * g.ple_dim)
            self.ple.proj = Linear(arch.hidden_size, arch.num_layers * g.ple_dim, switches=switches)
            self.ple.norm = RMSNorm(g.ple_dim, arch.rms_norm_eps, multiply_in_float32=True)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(arch, i, backend, switches, tp)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, head_rows, switches=switches)
        full_dim = arch.full_head_dim or arch.head_dim
        scaling = None
        if g.rope_factor != 1.0:  # the proportional rope's factor divides every frequency, as linear scaling does
            scaling = RopeScaling(type="linear", factor=g.rope_factor)
        self.rotary = RotaryEmbedding(full_dim, arch.rope_theta, scaling, arch.max_position_embeddings, device,
                                      rotated_pairs=g.rotated_pairs)
        self.local_rotary = RotaryEmbedding(arch.head_dim, arch.rope_local_theta, None, arch.max_position_embeddings,
                                            device)

    @staticmethod
    def host_tables(arch: Architecture) -> list[str]:
        """The tables helios.runner.host_embedding may keep in host memory (a step reads a few rows of each): the
        PLE table, [ple_vocab_size, L*P], as large as the rest of an E2B/E4B model. Its rows are then read from the
        device row cache by slot (HostRows stands in for ple.embed; graph-safe)."""
        return ["ple.embed.weight"] if arch.gemma4.ple_dim else []

    @staticmethod
    def host_table_rows(arch: Architecture, token_ids: torch.Tensor, context, query_start_loc) -> dict:
        """The rows of each host table a batch reads, on the host: the PLE table's are the token ids."""
        return {"ple.embed.weight": token_ids}

    def per_layer_inputs(self, token_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # -> [T, L, P]
        """HF's PLE inputs: (norm(proj(x) / sqrt(H)) + table rows * sqrt(P)) / sqrt(2), x the scaled embedding."""
        g, num_tokens = self.arch.gemma4, token_ids.shape[0]
        rows = self.ple.embed(token_ids).reshape(num_tokens, -1)
        # the fused path: the scales, norm, add and final scale in one launch, same values
        return per_layer_inputs(self.ple.proj(x), rows, self.ple.norm, self.arch.num_layers,
                                self.arch.hidden_size**-0.5, g.ple_dim**0.5, kernel=self.path == "fused")

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer its KV tensor (a KV-shared layer: its source's)
    ) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids) * torch.tensor(self.arch.embedding_scale, dtype=self.embed.weight.dtype)
        ple = self.per_layer_inputs(token_ids, x) if self.arch.gemma4.ple_dim else None
        rope = self.rotary.cos_sin(meta.positions, x.dtype)
        local_rope = self.local_rotary.cos_sin(meta.positions, x.dtype)
        ropes = [local_rope if is_sliding(self.arch, i) else rope for i in range(len(self.layers))]
        ples = [ple[:, i] if ple is not None else None for i in range(len(self.layers))]
        with pdl_launches(self.pdl):
            if self.path == "fused":
                return self._forward_fused(x, ples, ropes, kv_caches, meta)
            for layer, layer_ple, cos_sin, kv_cache in zip(self.layers, ples, ropes, kv_caches):
                x = layer(x, layer_ple, cos_sin, kv_cache, meta)
        return self.norm(x)

    def _forward_fused(self, x: torch.Tensor, ples: list, ropes: list, kv_caches: list, meta: AttentionMetadata):
        """The layers on the Triton path: each layer's last launch writes the stream and the next norm of it."""
        norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        h = self.layers[0].attn_norm(x)
        for layer, next_norm, layer_ple, cos_sin, kv_cache in zip(self.layers, norms, ples, ropes, kv_caches):
            h, x = layer.forward_fused(x, h, next_norm, layer_ple, cos_sin, kv_cache, meta)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        """The tied (or own) lm_head, then the final soft-cap (gemma3's, over the same attributes); under tensor
        parallelism the vocabulary gathered before the cap."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if self.tp is None:
            with pdl_launches(self.pdl):  # gemma3's
                logits = linear(hidden, weight, None, self.switches)
        else:
            logits = self.tp.gather_vocab(linear(hidden, weight, None, self.switches), self.arch.vocab_size)
        # the fused path: the cap's div, tanh and mul in one launch, same values
        return softcap(logits, self.arch.final_logit_softcapping, kernel=self.path == "fused")
