"""qwen3_5 / qwen3_5_moe / qwen3_next: hybrid decoders of gated-delta-rule layers (most of them: per-request
recurrent state, no KV) and gated full-attention layers (per-head q/k norms, partial rotary, a sigmoid output
gate; paged KV), a dense MLP or a softmax top-k MoE with a sigmoid-gated shared expert.

Pre-norm blocks: x += mixer(attn_norm(x)); x += ffn(mlp_norm(x)). The zero-centred norms of the checkpoint are
stored shifted (1 + w) and multiply in float32, as HF computes them. On the GPU path (a backend that fuses layers)
each residual add rides in the next norm's kernel, and at batch 1 the norm rides in the GEMV of the projection
after it, as in llama's fused path. Forward-only, no weights of its own.

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's attention
and KV heads, gated-delta heads and dense MLP width (the column-parallel projections are its rows); attention's o,
the gated delta rule's out and a dense MLP's down sum over the ranks, a MoE layer's experts split over them (the
shared expert replicated), the embedding and the head hold its vocabulary rows (compute_logits gathers them).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.linear_attention import GatedDeltaNet
from helios.layers.moe import SparseMoe, chain_moe_norms
from helios.layers.norm import RMSNorm, pre_norm_stack
from helios.layers.parallel import ExpertParallelMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.layers.rotary import RotaryEmbedding
from helios.switches import DEFAULT_SWITCHES, Switches


class SharedExpertMoe(SparseMoe):
    """SparseMoe plus a shared expert every token takes, scaled by sigmoid(shared_gate x) (qwen3_5_moe).
    Tensors bound: those of SparseMoe, shared.gate_up / shared.down, shared_gate.weight [1, H]."""

    def __init__(self, arch: Architecture, switches: Switches = DEFAULT_SWITCHES, fused: bool = False) -> None:
        moe = arch.moe
        super().__init__(arch.hidden_size, moe.num_experts, moe.moe_intermediate_size, moe.num_experts_per_tok,
                         moe.norm_topk_prob, arch.hidden_act, switches=switches, fused=fused)
        add_shared_expert(self, arch, switches)

    def forward(self, x: torch.Tensor, then_norm: tuple[torch.Tensor, RMSNorm] | None = None):  # [T, H] -> [T, H]
        """then_norm (residual, the next norm; fused path): (norm(residual + out), residual + out), SparseMoe's."""
        if self.fused:  # the gated shared expert added by the experts' combine launch (same roundings)
            weights, experts, gate = self.route_fused(x, self.shared_gate)  # the router's, the gate's: one launch
            return self._forward_fused(x, weights, experts, self.shared, gate, then_norm=then_norm)
        assert then_norm is None, "the torch path takes no next norm"
        return plus_shared_expert(self, x, super().forward(x))


class ExpertParallelSharedMoe(ExpertParallelMoe):
    """SharedExpertMoe under tensor parallelism: the routed experts split over the ranks (ExpertParallelMoe, their
    outputs summed over the ranks), then the shared expert added, on every rank. The same tensor names.

    NOTE: the shared expert and its gate replicated rather than column / row parallel: its products are the single
    rank's to the bit and it adds no collective (a split one would need its partial sum folded into the experts'
    all-reduce), for the memory of one expert per layer beside the layer's num_experts / world_size, and every rank
    computing one expert's rows that a split would share."""

    def __init__(self, arch: Architecture, tp: TensorGroup, switches: Switches = DEFAULT_SWITCHES) -> None:
        moe = arch.moe
        super().__init__(arch.hidden_size, moe.num_experts, moe.moe_intermediate_size, moe.num_experts_per_tok,
                         moe.norm_topk_prob, tp, arch.hidden_act, switches=switches)
        add_shared_expert(self, arch, switches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return plus_shared_expert(self, x, super().forward(x))


def add_shared_expert(moe: nn.Module, arch: Architecture, switches: Switches) -> None:
    """The shared expert (`shared`, a GatedMLP) and its gate (`shared_gate` [1, H]) as submodules of `moe`."""
    moe.shared = GatedMLP(arch.hidden_size, arch.moe.shared_expert_intermediate_size, arch.hidden_act,
                          switches=switches)
    moe.shared_gate = Linear(arch.hidden_size, 1, switches=switches)


def plus_shared_expert(moe: nn.Module, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:  # [T, H]
    """The routed experts' output plus the shared expert's, scaled by sigmoid(shared_gate x)."""
    return routed + torch.sigmoid(moe.shared_gate(x)) * moe.shared(x)


class HybridLayer(nn.Module):
    """One pre-norm block whose mixer is a GatedDeltaNet (`linear`) or a gated Attention (`attn`)."""

    def __init__(self, arch: Architecture, layer_idx: int, backend: AttentionBackend, ffn: nn.Module,
                 ffn_name: str, switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        self.switches = switches
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
        # the fused path at batch 1 (fold_norms switch): the mixer's input projection and a dense MLP's gate_up
        # take their norm and its add inside the GEMV (whether a step's row takes it is the projection's own rule)
        self.fold_norms = switches.fold_norms
        self.fold_mlp_norm = switches.fold_norms and isinstance(ffn, GatedMLP)
        # the fused path's MoE layers (helios.layers.moe.chain_moe_norms): this layer's MoE combine takes the next norm
        # (the next layer's attn_norm, or the model's final norm) and its add; the next layer then gets its input
        # normed and the stream added (input_normed)
        self.norms_output: RMSNorm | None = None
        self.input_normed = False

    def forward(self, x: torch.Tensor, cos_sin, cache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        h = self.attn_norm(x)
        x = x + self.mix(h, cos_sin, cache, meta)
        return x + getattr(self, self.ffn_name)(self.mlp_norm(x))

    def mix(self, h: torch.Tensor, cos_sin, cache, meta: AttentionMetadata,
            projected: torch.Tensor | None = None) -> torch.Tensor:  # [T, H]
        """The token mixer on the normed input (projected: its input projection, already computed)."""
        if self.is_linear:
            return self.linear(h, cache, meta, projected=projected)
        return self.attn(h, cos_sin, cache, meta, qkv=projected)

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, cache,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # (output, stream before it)
        """forward() on the GPU path, as llama's DecoderLayer.forward_fused: x is the previous layer's output and
        residual the stream before its add (None for the first layer)."""
        ffn = getattr(self, self.ffn_name)
        allow_pdl = self.switches.gemv_pdl
        projection = self.linear.in_proj if self.is_linear else self.attn.qkv
        if self.input_normed:  # the previous layer's combine took our add and norm: x normed, residual the stream
            a = self.mix(x, cos_sin, cache, meta)
        elif self.fold_norms and projection.serves_gemv(x):
            projected, residual = self.attn_norm.forward_add_gemv(x, residual, projection.weight, allow_pdl)
            a = self.mix(x, cos_sin, cache, meta, projected=projected)
        else:
            h, residual = self.attn_norm.forward_add(x, residual, fused=True)
            a = self.mix(h, cos_sin, cache, meta)
        if self.fold_mlp_norm and ffn.gate_up.serves_gemv(a):
            gate_up, residual = self.mlp_norm.forward_add_gemv(a, residual, ffn.gate_up.weight, allow_pdl)
            return ffn(a, gate_up=gate_up), residual
        h, residual = self.mlp_norm.forward_add(a, residual, fused=True)
        if self.norms_output is not None:  # (the next norm of the stream, the stream), one launch fewer
            return ffn(h, then_norm=(residual, self.norms_output))
        return ffn(h), residual


class Qwen3_5ForCausalLM(nn.Module):
    """qwen3_5 (dense), qwen3_5_moe and qwen3_next (MoE in every layer but arch.moe.dense_layers).

    forward's `caches` holds one entry per layer: the paged KV tensor of an attention layer, the (conv, recurrent)
    state pair of a linear one (helios.runner.state_cache)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if arch.recurrent is None or arch.recurrent.kind != "gated_delta":
            raise ValueError(f"a {arch.family} architecture needs gated_delta recurrent layers")
        self.arch = arch
        self.switches = switches
        self.tp = tp
        self.path = "fused" if getattr(backend, "fuses_layers", False) else "eager"  # chosen once, here
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.layers = nn.ModuleList(
            HybridLayer(arch, i, backend, *self._make_ffn(arch, i, switches, fused=self.path == "fused", tp=tp),
                        switches=switches)
            for i in range(arch.num_layers)
        )
        if tp is not None:
            for layer in self.layers:
                self._sum_outputs(layer, tp)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        if self.path == "fused" and tp is None:
            chain_moe_norms(self.layers, self.norm, lambda layer: getattr(layer, layer.ffn_name))
        head_rows = arch.vocab_size if tp is None else self.embed.end - self.embed.start
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, head_rows, switches=switches)
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
    def _make_ffn(arch: Architecture, layer_idx: int, switches: Switches, fused: bool,
                  tp: TensorGroup | None = None) -> tuple[nn.Module, str]:
        moe = arch.moe
        if moe is None or layer_idx in moe.dense_layers:
            return GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, fused=fused,
                            switches=switches), "mlp"
        if tp is not None:  # the experts split over the ranks (see ExpertParallelMoe's NOTE)
            if moe.shared_expert_intermediate_size:
                return ExpertParallelSharedMoe(arch, tp, switches), "moe"
            return (ExpertParallelMoe(arch.hidden_size, moe.num_experts, moe.moe_intermediate_size,
                                      moe.num_experts_per_tok, moe.norm_topk_prob, tp, arch.hidden_act,
                                      switches=switches), "moe")
        if moe.shared_expert_intermediate_size:
            return SharedExpertMoe(arch, switches, fused), "moe"
        return SparseMoe(arch.hidden_size, moe.num_experts, moe.moe_intermediate_size, moe.num_experts_per_tok,
                         moe.norm_topk_prob, arch.hidden_act, switches=switches, fused=fused), "moe"

    @staticmethod
    def _sum_outputs(layer: HybridLayer, tp: TensorGroup) -> None:
        """Tensor parallel: the mixer's output projection (attention's o, the gated delta rule's out) and a dense
        MLP's down read this rank's heads / width and sum over the ranks (a MoE layer sums inside itself)."""
        if layer.is_linear:
            layer.linear.out = row_parallel(layer.linear.out, tp)
        else:
            layer.attn.o = row_parallel(layer.attn.o, tp)
        ffn = getattr(layer, layer.ffn_name)
        if isinstance(ffn, GatedMLP):
            ffn.down = row_parallel(ffn.down, tp)

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)
        cos_sin = self.rotary.cos_sin(meta.positions, x.dtype)
        return pre_norm_stack(x, self.layers, caches, meta, self.norm, self.path == "fused", cos_sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, None, self.switches)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.arch.vocab_size)
