"""nemotron_h: hybrid blocks of one mixer each: Mamba-2 (linear), attention without rotary (full), a relu2 MLP or a
sigmoid-routed relu2 MoE with a shared expert and optional latent projections (both ffn).

model_type nemotron_h (NemotronHConfig); tensors under backbone. (the released checkpoints) or model. (as
transformers renames them), experts one tensor per expert or stacked. The layer pattern is layers_block_type, its
alias layer_types, or the legacy hybrid_override_pattern (M, *, -, E). MTP layers (mtp.*) are ignored.
"""

from __future__ import annotations

import math

from helios.core.layout import layer
from helios.core.manifest import Architecture, MoeConfig, RecurrentConfig
from ignition.archs import Plan, Producer, Weights
from ignition.archs.llama import load, load_fused
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast, stack_experts

# HF block type (and the legacy names transformers remaps) -> core layer type
_LAYER_TYPES = {
    "linear_attention": "linear", "mamba": "linear", "full_attention": "full", "attention": "full",
    "mlp": "ffn", "moe": "ffn",
}
_LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# older config names NemotronHConfig.__post_init__ reads in place of the current ones (they win when both are set)
_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
            "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
# NemotronHConfig's defaults for the fields read here
_DEFAULTS = {
    "head_dim": 128, "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "intermediate_size": 21504,
    "mlp_hidden_act": "relu2", "mlp_bias": False, "ssm_state_size": 128, "mamba_num_heads": 128,
    "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4, "use_conv_bias": True,
    "chunk_size": 128, "time_step_limit": [0.0, math.inf], "use_bias": False, "n_routed_experts": 8,
    "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688, "moe_latent_size": None,
    "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
}
_IGNORED = ("mtp.", "backbone.mtp.", "model.mtp.")


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg = {**_DEFAULTS, **ckpt.config}
    for old, new in _ALIASES.items():
        if old in ckpt.config:
            cfg[new] = ckpt.config[old]
    _check_supported(cfg, where)
    hf_types = _block_types(cfg, where)
    types = [_LAYER_TYPES[t] for t in hf_types]
    heads = int(_required(cfg, "num_attention_heads", where))
    arch = Architecture(
        family="nemotron_h",
        vocab_size=int(_required(cfg, "vocab_size", where)),
        hidden_size=int(_required(cfg, "hidden_size", where)),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=len(types),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg["head_dim"]),
        rms_norm_eps=float(cfg["layer_norm_epsilon"]),
        rope_theta=0.0,  # no rotary (position_embedding "none")
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        # NOTE: NemotronHForCausalLM ties nothing (_tied_weights_keys = {}): its lm_head is always its own tensor
        tie_word_embeddings=False,
        hidden_act="relu2",
        layer_types=types,
        moe=_moe(cfg, hf_types, where) if "moe" in hf_types else None,
        recurrent=_recurrent(cfg, where) if "linear" in types else None,
        position_embedding="none",
        ffn_after_mixer=False,
    )
    w = _Weights(ckpt)
    plan: Plan = {}
    _add_embedding_and_head(w, plan, arch, dtype)
    for i, kind in enumerate(hf_types):
        norm = "mlp_norm" if types[i] == "ffn" else "attn_norm"
        plan[layer(i, f"{norm}.weight")] = load(w.take(f"layers.{i}.norm.weight", (arch.hidden_size,)), dtype)
        _ADD_BLOCK[kind](w, plan, arch, i, dtype)
    w.check_all_used()
    return arch, plan


# ---- config reading -----------------------------------------------------------------------------------------


def _required(cfg: dict, key: str, where: str):
    if cfg.get(key) is None:
        raise ExportError(f"{where}: config.json lacks '{key}'")
    return cfg[key]


def _check_supported(cfg: dict, where: str) -> None:
    """Config features the runtime does not implement (HF ignores attention_bias, sliding_window and
    residual_in_fp32 in this family's forward, so they are ignored here too)."""
    if cfg["mlp_hidden_act"] != "relu2":
        raise ExportError(f"{where}: mlp_hidden_act '{cfg['mlp_hidden_act']}' is not supported (only relu2)")
    if cfg["mamba_hidden_act"] not in ("silu", "swish"):
        raise ExportError(f"{where}: mamba_hidden_act '{cfg['mamba_hidden_act']}' is not supported (only silu)")
    for key in ("use_bias", "mlp_bias"):
        if cfg.get(key):
            raise ExportError(f"{where}: {key}=true is not supported")


def _block_types(cfg: dict, where: str) -> list[str]:
    """The HF block type of each layer, as NemotronHConfig resolves them (legacy names remapped)."""
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types and cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        bad = sorted(set(pattern) - set(_PATTERN))
        if bad:
            raise ExportError(f"{where}: hybrid_override_pattern has unknown block symbols {bad} (known: M E * -)")
        types = [_PATTERN[c] for c in pattern]
    if not types:  # NemotronHConfig's default
        types = ["linear_attention", "moe", "full_attention", "mlp"]
    for t in types:
        if t not in _LAYER_TYPES:
            raise ExportError(f"{where}: block type '{t}' is not supported (supported: {', '.join(_LAYER_TYPES)})")
    return [_LEGACY_TYPES.get(t, t) for t in types]


def _float(value, where: str) -> float:
    """A config float; transformers 5 writes infinity as {"__float__": "Infinity"}, Python's json as Infinity."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ExportError(f"{where}: '{value}' is not a number") from None


def _time_step_limit(cfg: dict, where: str) -> tuple[float, float] | None:
    limit = cfg["time_step_limit"]
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ExportError(f"{where}: time_step_limit must be [min, max], got {limit!r}")
    low, high = (_float(v, where) for v in limit)
    if not 0.0 <= low <= high:
        raise ExportError(f"{where}: time_step_limit {limit!r} is not 0 <= min <= max")
    return None if (low, high) == (0.0, math.inf) else (low, high)


def _recurrent(cfg: dict, where: str) -> RecurrentConfig:
    heads, groups, head_dim = int(cfg["mamba_num_heads"]), int(cfg["n_groups"]), int(cfg["mamba_head_dim"])
    if groups <= 0 or heads % groups:
        raise ExportError(f"{where}: mamba_num_heads={heads} is not a multiple of n_groups={groups}")
    return RecurrentConfig(
        kind="mamba2",
        num_heads=heads,
        num_key_heads=groups,
        key_head_dim=int(cfg["ssm_state_size"]),
        value_head_dim=head_dim,
        conv_kernel=int(cfg["conv_kernel"]),
        chunk_size=int(cfg["chunk_size"]),
        conv_bias=bool(cfg["use_conv_bias"]),
        time_step_limit=_time_step_limit(cfg, where),
        norm_group_size=heads * head_dim // groups,
    )


def _moe(cfg: dict, hf_types: list[str], where: str) -> MoeConfig:
    experts, groups, top_groups = int(cfg["n_routed_experts"]), int(cfg["n_group"]), int(cfg["topk_group"])
    top_k, shared = int(cfg["num_experts_per_tok"]), int(cfg["moe_shared_expert_intermediate_size"])
    # the router ranks a group by its two best scores and picks top_k among the chosen groups' experts
    if groups <= 0 or experts % groups or experts // groups < 2:
        raise ExportError(f"{where}: n_routed_experts={experts} does not split into n_group={groups} groups of >= 2")
    if not 0 < top_groups <= groups or top_k > top_groups * (experts // groups):
        raise ExportError(f"{where}: topk_group={top_groups} of n_group={groups} cannot hold "
                          f"num_experts_per_tok={top_k} experts")
    if shared <= 0:  # NemotronHMoE always builds its shared expert
        raise ExportError(f"{where}: moe_shared_expert_intermediate_size={shared} is not supported (must be > 0)")
    return MoeConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        dense_layers=[i for i, t in enumerate(hf_types) if t == "mlp"],
        shared_expert_intermediate_size=shared,
        shared_expert_gate=False,
        scoring="sigmoid",
        score_bias=True,
        num_groups=groups,
        num_topk_groups=top_groups,
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
        latent_size=int(cfg["moe_latent_size"] or 0),
    )


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """Parameters of layer i (ignition.archs.num_params / decode_weight_bytes): its norm and its one sublayer; an
    MoE layer counts `experts_read` routed experts (None: all of them) beside its router, latent projections and
    shared expert."""
    h, kind, moe, r = arch.hidden_size, arch.layer_types[i], arch.moe, arch.recurrent
    n = h  # the block's norm
    if kind == "linear":
        inner, c = r.num_heads * r.value_head_dim, r.conv_dim
        n += (inner + c + r.num_heads) * h + c * (r.conv_kernel + int(r.conv_bias)) + 3 * r.num_heads
        return n + inner + h * inner  # gated norm, out
    if kind == "full":
        return n + (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim * h + h * arch.num_heads * arch.head_dim
    if moe is None or i in moe.dense_layers:
        return n + 2 * h * arch.intermediate_size
    width = moe.latent_size or h
    experts = moe.num_experts if experts_read is None else experts_read
    n += moe.num_experts * (h + int(moe.score_bias)) + experts * 2 * width * moe.moe_intermediate_size
    n += 2 * h * moe.latent_size + 2 * h * moe.shared_expert_intermediate_size
    return n


# ---- tensor plans ---------------------------------------------------------------------------------------------


class _Weights(Weights):
    """Weights whose decoder is found by `embeddings.weight` (this family's name for the token embedding)."""

    def __init__(self, ckpt: Checkpoint):
        self.tensors = ckpt.tensors
        self.identifier = ckpt.identifier
        self.ignore = _IGNORED
        self.used: set[str] = set()
        found = [p for p in ("backbone.", "model.") if p + "embeddings.weight" in self.tensors]
        if not found:
            raise ExportError(f"{self.identifier}: no embedding tensor (looked for backbone.embeddings.weight, "
                              "model.embeddings.weight)")
        self.prefix = found[0]


def _add_embedding_and_head(w: Weights, plan: Plan, arch: Architecture, dtype) -> None:
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embeddings.weight", (v, h)), dtype)
    plan["norm.weight"] = load(w.take("norm_f.weight", (h,)), dtype)
    plan["lm_head.weight"] = load(w.take("lm_head.weight", (v, h), root=True), dtype)


def _add_mamba(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """in_proj's rows are already the layout's [z, x, B, C, dt]; the conv's [C, 1, K] loses its middle dim."""
    r, h = arch.recurrent, arch.hidden_size
    inner, c = r.num_heads * r.value_head_dim, r.conv_dim
    src = f"layers.{i}.mixer."
    plan[layer(i, "mamba.in_proj.weight")] = load(w.take(f"{src}in_proj.weight", (inner + c + r.num_heads, h)), dtype)
    conv = w.take(f"{src}conv1d.weight", (c, 1, r.conv_kernel))
    plan[layer(i, "mamba.conv.weight")] = lambda: cast(conv.load().reshape(c, r.conv_kernel), dtype)
    if r.conv_bias:
        plan[layer(i, "mamba.conv.bias")] = load(w.take(f"{src}conv1d.bias", (c,)), dtype)
    for name in ("dt_bias", "A_log", "D"):
        plan[layer(i, f"mamba.{name}")] = load(w.take(f"{src}{name}", (r.num_heads,)), dtype)
    plan[layer(i, "mamba.norm.weight")] = load(w.take(f"{src}norm.weight", (inner,)), dtype)
    plan[layer(i, "mamba.out.weight")] = load(w.take(f"{src}out_proj.weight", (h, inner)), dtype)


def _add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """attn.qkv (q, k, v rows; no biases in this family) and attn.o."""
    h, d = arch.hidden_size, arch.head_dim
    src = f"layers.{i}.mixer."
    rows = {"q": arch.num_heads * d, "k": arch.num_kv_heads * d, "v": arch.num_kv_heads * d}
    plan[layer(i, "attn.qkv.weight")] = load_fused([w.take(f"{src}{p}_proj.weight", (n, h)) for p, n in rows.items()],
                                                   dtype)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, arch.num_heads * d)), dtype)


def _add_up_down(w: Weights, plan: Plan, src: str, dst: str, hidden: int, intermediate: int, dtype) -> None:
    plan[f"{dst}.up.weight"] = load(w.take(f"{src}.up_proj.weight", (intermediate, hidden)), dtype)
    plan[f"{dst}.down.weight"] = load(w.take(f"{src}.down_proj.weight", (hidden, intermediate)), dtype)


def _add_mlp(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    _add_up_down(w, plan, f"layers.{i}.mixer", layer(i, "mlp"), arch.hidden_size, arch.intermediate_size, dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """moe.router (+ its score bias), the latent projections, the stacked non-gated experts, the shared expert."""
    moe, h = arch.moe, arch.hidden_size
    e, fm, width = moe.num_experts, moe.moe_intermediate_size, moe.latent_size or h
    src = f"layers.{i}.mixer."
    plan[layer(i, "moe.router.weight")] = load(w.take(f"{src}gate.weight", (e, h)), dtype)
    plan[layer(i, "moe.router.bias")] = load(w.take(f"{src}gate.e_score_correction_bias", (e,)), dtype)
    if moe.latent_size:
        plan[layer(i, "moe.latent_in.weight")] = load(w.take(f"{src}fc1_latent_proj.weight", (width, h)), dtype)
        plan[layer(i, "moe.latent_out.weight")] = load(w.take(f"{src}fc2_latent_proj.weight", (h, width)), dtype)
    for p, shape in (("up", (fm, width)), ("down", (width, fm))):
        if w.has(f"{src}experts.{p}_proj"):  # transformers' stacked layout
            plan[layer(i, f"moe.{p}.weight")] = load(w.take(f"{src}experts.{p}_proj", (e, *shape)), dtype)
        else:
            parts = [w.take(f"{src}experts.{j}.{p}_proj.weight", shape) for j in range(e)]
            plan[layer(i, f"moe.{p}.weight")] = _stacked(parts, dtype)
    _add_up_down(w, plan, f"{src}shared_experts", layer(i, "moe.shared"), h, moe.shared_expert_intermediate_size,
                 dtype)


def _stacked(parts: list[LazyTensor], dtype) -> Producer:
    # NOTE: each expert is cast before stacking, so the peak is one layer's experts in the target dtype
    return lambda: stack_experts([cast(p.load(), dtype) for p in parts])


_ADD_BLOCK = {"linear_attention": _add_mamba, "full_attention": _add_attention, "mlp": _add_mlp, "moe": _add_moe}
