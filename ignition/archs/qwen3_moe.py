"""qwen3_moe: qwen3 attention (q/k norms) with sparse expert MLPs, experts stacked into [E, ...] tensors.

Reads per-expert checkpoints (mlp.experts.{e}.gate_proj/up_proj/down_proj, the hub layout that transformers 5
still writes) and the fused layout (mlp.experts.gate_up_proj [E, 2*Fm, H], mlp.experts.down_proj [E, H, Fm]).
"""

from __future__ import annotations

from helios.core.layout import layer
from helios.core.manifest import Architecture, MoeConfig
from ignition.archs import Plan, Producer, Weights
from ignition.archs.llama import (
    add_attention,
    add_dense_mlp,
    add_embedding_and_head,
    add_llama_norms,
    config_value,
    load,
    read_dims,
    read_rope,
)
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast, fuse_rows, stack_experts

_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,  # transformers' default; real Qwen3 MoE configs set true
}


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    cfg = {"hidden_act": "silu", **_DEFAULTS, **ckpt.config}
    where = ckpt.identifier
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true (an o_proj bias) is not supported")
    dims = read_dims(cfg, where)
    theta, scaling = read_rope(cfg, where, default_theta=10000.0)
    # transformers 5 writes num_local_experts (num_experts is its alias); hub configs write num_experts
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not num_experts:
        raise ExportError(f"{where}: config.json lacks 'num_experts'")
    if cfg.get("use_sliding_window"):
        raise ExportError(f"{where}: use_sliding_window=true is not supported for qwen3_moe")
    step = int(cfg["decoder_sparse_step"])
    only_dense = set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(dims["num_layers"]) if i in only_dense or (i + 1) % step != 0]
    moe = MoeConfig(
        num_experts=int(num_experts),
        num_experts_per_tok=int(config_value(cfg, "num_experts_per_tok", where)),
        moe_intermediate_size=int(config_value(cfg, "moe_intermediate_size", where)),
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        dense_layers=dense,
    )
    arch = Architecture(family="qwen3_moe", **dims, rope_theta=theta, rope_scaling=scaling, qk_norm=True, moe=moe)
    w = Weights(ckpt, ("model.",))
    plan: Plan = {}
    add_embedding_and_head(w, plan, arch, dtype, gemma_norm=False)
    for i in range(arch.num_layers):
        add_attention(w, plan, arch, i, dtype, gemma_norm=False)
        add_llama_norms(w, plan, arch, i, dtype)
        if i in dense:
            add_dense_mlp(w, plan, i, arch.hidden_size, arch.intermediate_size, dtype)
        else:
            add_experts(w, plan, arch, i, dtype)
    w.check_all_used()
    return arch, plan


def add_experts(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """moe.router [E, H], moe.gate_up [E, 2*Fm, H] (per expert: gate rows, then up rows), moe.down [E, H, Fm]."""
    e, h, fm = arch.moe.num_experts, arch.hidden_size, arch.moe.moe_intermediate_size
    src = f"layers.{i}.mlp."
    plan[layer(i, "moe.router.weight")] = load(w.take(f"{src}gate.weight", (e, h)), dtype)
    if w.has(f"{src}experts.gate_up_proj"):
        plan[layer(i, "moe.gate_up.weight")] = load(w.take(f"{src}experts.gate_up_proj", (e, 2 * fm, h)), dtype)
        plan[layer(i, "moe.down.weight")] = load(w.take(f"{src}experts.down_proj", (e, h, fm)), dtype)
        return
    gate_up = [
        [w.take(f"{src}experts.{j}.{p}_proj.weight", (fm, h)) for p in ("gate", "up")] for j in range(e)
    ]
    down = [w.take(f"{src}experts.{j}.down_proj.weight", (h, fm)) for j in range(e)]
    plan[layer(i, "moe.gate_up.weight")] = _stacked_fused(gate_up, dtype)
    plan[layer(i, "moe.down.weight")] = _stacked(down, dtype)


def _stacked_fused(parts: list[list[LazyTensor]], dtype) -> Producer:
    # NOTE: each expert is cast before stacking, so the peak is one layer's experts in the target dtype.
    return lambda: stack_experts([cast(fuse_rows(*(p.load() for p in pair)), dtype) for pair in parts])


def _stacked(parts: list[LazyTensor], dtype) -> Producer:
    return lambda: stack_experts([cast(p.load(), dtype) for p in parts])
