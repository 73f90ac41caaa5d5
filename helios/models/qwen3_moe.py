"""qwen3-moe: the qwen3 decoder (q/k norms, no bias) with a sparse MoE feed-forward in every layer except
`arch.moe.dense_layers`, which keep a dense GatedMLP of `intermediate_size`.
"""

from __future__ import annotations

from torch import nn

from helios.core.manifest import Architecture
from helios.layers.moe import SparseMoe
from helios.layers.parallel import ExpertParallelMoe
from helios.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False  # an expert's gate_up cannot take the MLP norm (each token picks other experts)

    def make_ffn(self, arch: Architecture, layer_idx: int) -> tuple[nn.Module, str]:
        moe = arch.moe
        if moe is None:
            raise ValueError("a qwen3_moe architecture needs arch.moe")
        if layer_idx in moe.dense_layers:
            return super().make_ffn(arch, layer_idx)
        if self.tp is not None:  # the experts split over the ranks (see ExpertParallelMoe's NOTE)
            return (ExpertParallelMoe(arch.hidden_size, moe.num_experts, moe.moe_intermediate_size,
                                      moe.num_experts_per_tok, moe.norm_topk_prob, self.tp, arch.hidden_act,
                                      switches=self.switches), "moe")
        return (
            SparseMoe(
                arch.hidden_size,
                moe.num_experts,
                moe.moe_intermediate_size,
                moe.num_experts_per_tok,
                moe.norm_topk_prob,
                arch.hidden_act,
                switches=self.switches,
                fused=self.is_fused,  # the Triton backend: routing, sort and grouped GEMMs on the device
            ),
            "moe",
        )
