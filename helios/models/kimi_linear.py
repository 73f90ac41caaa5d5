"""kimi_linear: a hybrid decoder of Kimi delta attention layers (`linear`: per-request recurrent state, no KV) and
multi-head latent attention layers without position embeddings (`full`: paged latent KV), each followed by a dense
SwiGLU MLP (arch.moe.dense_layers) or DeepSeek-style sigmoid-routed experts with an ungated shared expert.

Pre-norm blocks: x += mixer(attn_norm(x)); x += ffn(mlp_norm(x)). Forward-only, no weights of its own.

With `tp` (tensor parallel, helios.runner.parallel) the model is one rank's: `arch` counts this rank's KDA heads
(arch.recurrent: its state slots hold those), MLA heads (q / q_b and kv_b rows; the latents, their norms and the rope
key whole, so every rank pages the same latents) and dense MLP width; KDA's out, MLA's o and down sum over the ranks,
the experts split over them (ExpertParallelSigmoidMoe: the router, its score bias and the shared experts replicated),
the embedding and the head hold its vocabulary rows (compute_logits gathers them).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture
from helios.layers.activation import GatedMLP
from helios.layers.attention import AttentionBackend, AttentionMetadata
from helios.layers.kda import KimiDeltaAttention
from helios.layers.linear import Embedding, Linear, linear
from helios.layers.mla import MlaAttention
from helios.layers.moe import SigmoidMoe, chain_moe_norms
from helios.layers.norm import RMSNorm, pre_norm_stack
from helios.layers.parallel import ExpertParallelSigmoidMoe, TensorGroup, VocabParallelEmbedding, row_parallel
from helios.switches import DEFAULT_SWITCHES, Switches


class KimiLinearLayer(nn.Module):
    """One pre-norm block: attn_norm + kda (a linear layer) or mla (a full one), then mlp_norm + mlp or moe."""

    def __init__(self, arch: Architecture, layer_idx: int, switches: Switches = DEFAULT_SWITCHES,
                 fused: bool = False, backend: AttentionBackend | None = None, tp: TensorGroup | None = None) -> None:
        super().__init__()
        h, eps, moe = arch.hidden_size, arch.rms_norm_eps, arch.moe
        self.is_linear = arch.layer_types[layer_idx] == "linear"
        self.attn_norm = RMSNorm(h, eps)
        if self.is_linear:
            self.kda = KimiDeltaAttention(h, arch.recurrent, eps, switches, fused=fused)
        else:
            self.mla = MlaAttention(h, arch.num_heads, arch.mla, switches, backend)  # Triton: the MLA decode kernel
        self.mlp_norm = RMSNorm(h, eps)
        if moe is None or layer_idx in moe.dense_layers:
            self.ffn_name = "mlp"
            ffn = GatedMLP(h, arch.intermediate_size, arch.hidden_act, switches=switches)
        elif tp is not None:  # the experts split over the ranks
            self.ffn_name = "moe"
            ffn = ExpertParallelSigmoidMoe(h, moe, arch.hidden_act, tp, switches)
        else:
            self.ffn_name = "moe"
            ffn = SigmoidMoe(h, moe, arch.hidden_act, switches, fused=fused)
        self.add_module(self.ffn_name, ffn)
        self.norms_output: RMSNorm | None = None  # the next norm the MoE's combine takes (chain_moe_norms)
        self.input_normed = False  # the previous layer's combine took this layer's add and norm
        if tp is not None:  # KDA's out, MLA's o and a dense MLP's down read this rank's heads / width, summed
            mixer = self.kda if self.is_linear else self.mla
            output = "out" if self.is_linear else "o"
            setattr(mixer, output, row_parallel(getattr(mixer, output), tp))
            if self.ffn_name == "mlp":
                ffn.down = row_parallel(ffn.down, tp)

    def forward(self, x: torch.Tensor, cache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        h = self.attn_norm(x)
        x = x + (self.kda(h, cache, meta) if self.is_linear else self.mla(h, cache, meta))
        return x + getattr(self, self.ffn_name)(self.mlp_norm(x))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cache,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:  # (output, stream before it)
        """forward() on the GPU path: each residual add and the norm after it in one launch (RMSNorm.forward_add)
        instead of five or six torch kernels; x is the previous layer's output and residual the stream before its
        add (None for the first layer). Same adds and norms, so the same values as forward()."""
        if self.input_normed:  # x normed, residual the stream (helios.layers.moe.chain_moe_norms)
            h = x
        else:
            h, residual = self.attn_norm.forward_add(x, residual, fused=True)
        a = self.kda(h, cache, meta) if self.is_linear else self.mla(h, cache, meta)
        h, residual = self.mlp_norm.forward_add(a, residual, fused=True)
        if self.norms_output is not None:  # (the next norm of the stream, the stream) from the combine launch
            return getattr(self, self.ffn_name)(h, then_norm=(residual, self.norms_output))
        return getattr(self, self.ffn_name)(h), residual


class KimiLinearForCausalLM(nn.Module):
    """forward's `caches` holds one entry per layer: the latent page tensor of an MLA layer (helios.runner.kv_cache),
    the (conv, recurrent) state pair of a KDA one (helios.runner.state_cache)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False,
                 tp: TensorGroup | None = None):
        super().__init__()
        if arch.recurrent is not None and arch.recurrent.kind != "kimi_delta":
            raise ValueError(f"a kimi_linear architecture has kimi_delta recurrent layers, not {arch.recurrent.kind}")
        if arch.attention_layers and arch.mla is None:
            raise ValueError("a kimi_linear architecture's attention layers are MLA (arch.mla)")
        if arch.position_embedding != "none":
            raise ValueError("a kimi_linear architecture's attention has no position embeddings")
        self.arch = arch
        self.switches = switches
        fused = getattr(backend, "fuses_layers", False)  # the Triton backend: KDA's, the MoE's and the norms' kernels
        self.path = "fused" if fused else "eager"  # chosen once, here
        self.tp = tp
        self.embed = (Embedding(arch.vocab_size, arch.hidden_size) if tp is None
                      else VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp))
        self.layers = nn.ModuleList(KimiLinearLayer(arch, i, switches, fused, backend, tp)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if self.path == "fused" and tp is None:
            chain_moe_norms(self.layers, self.norm, lambda layer: getattr(layer, layer.ffn_name))
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
