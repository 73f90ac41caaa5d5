"""step3p7 (Step-3.7 Flash; Step-3.5 Flash as step3p5), text only: full and sliding-window attention layers (the
sliding ones with their own query head count, rope base and rotary width, over the same KV heads), zero-centred q/k
and layer norms (stored 1 + w), a sigmoid output gate per head (g_proj, fused into qkv as its last rows),
query_pre_attn_scalar; dense SwiGLU MLPs first, then sigmoid-routed experts with a score bias beside an always-on
shared expert; per-layer SwiGLU clamps (after the activation) of the routed and of the dense / shared experts.

model_type step3p7 (Step3p7ForConditionalGeneration: its text_config; tensors under model.) or step3p5 (the text
config at the top level, as Step-3.5 Flash ships it). Either tensor naming: the release's, which transformers also
saves (model.layers.N.moe.gate.weight / router_bias / gate_proj / up_proj / down_proj stacked [E, ...],
share_expert.*), or the one transformers holds in memory (model.language_model.layers.N.mlp.gate.weight /
e_score_correction_bias, mlp.experts.gate_up_proj / down_proj, mlp.shared_experts.*). Either config spelling: the
release's (num_attention_groups, moe_num_experts, moe_top_k, moe_layers_enum, attention_other_setting, per-layer
rope_theta / partial_rotary_factors, per-layer lists padded with the MTP layers' entries) or transformers' (its
Step3p7TextConfig aliases and derivations, per_layer_config, rope_parameters per layer type).
The MTP layers (layers.N with N >= num_hidden_layers, num_nextn_predict_layers of them) go to the core's mtp.{k}.*
(ignition/archs/mtp.py, _add_mtp). NOTE: the vision tower and projector are ignored (images are a later issue). The
config's dead MiniMax sparse-attention fields (sparse_attention_config, index_*) are not read, as the modeling code
reads none.
"""

from __future__ import annotations

import re

import msgspec
import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, MoeConfig, MtpConfig, RopeScaling
from ignition.archs import Plan, Producer, Weights, kimi_linear, mtp
from ignition.archs.llama import (
    add_dense_mlp,
    add_embedding_and_head,
    add_norm,
    load,
    load_fused,
    parse_rope_scaling,
    read_dims,
    to_layer_types,
)
from ignition.archs.qwen3_moe import add_experts
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast

# Step3p7TextConfig's defaults for the fields read here that a config may omit
_DEFAULTS = {
    "vocab_size": 128815, "hidden_size": 4096, "intermediate_size": 11264, "num_hidden_layers": 45,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-5, "num_experts_per_tok": 8, "moe_intermediate_size": 1280, "n_routed_experts": 288,
    "share_expert_dim": 1280, "moe_router_scaling_factor": 1.0, "num_nextn_predict_layers": 0,
}
# Step3p7TextConfig.attribute_map: the release's spellings -> transformers'
_ALIASES = {"num_attention_groups": "num_key_value_heads", "moe_num_experts": "n_routed_experts",
            "num_local_experts": "n_routed_experts", "moe_top_k": "num_experts_per_tok",
            "share_expert_dims": "share_expert_dim", "num_mtp_layers": "num_nextn_predict_layers"}
# per-layer lists the release pads with the MTP layers' entries (Step3p7TextConfig.__post_init__ cuts them)
_PADDED = ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared", "rope_theta",
           "partial_rotary_factors")
_VISION = ("vision_model.", "vit_large_projector.", "model.vision_model.", "model.multi_modal_projector.")
_PREFIXES = ("model.language_model.", "model.")
_DEFAULT_THETA = 10000.0


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg = _text_config(ckpt.config, where)
    _check_supported(cfg, where)
    num_layers = int(cfg["num_hidden_layers"])
    types = _hf_layer_types(cfg, num_layers, where)
    dims = read_dims({**cfg, "hidden_act": "silu"}, where)  # NOTE: HF computes silu whatever hidden_act says
    heads, sliding_heads = _head_counts(cfg, types, where)
    rope = _rope(cfg, types, dims["head_dim"], where)
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and window is None:
        raise ExportError(f"{where}: sliding_attention layers without a sliding_window")
    dense = _dense_layers(cfg, num_layers, where)
    arch = Architecture(
        family="step3p7",
        **{**dims, "num_heads": heads},
        **rope,
        qk_norm=True,
        query_scale=float(cfg.get("query_pre_attn_scalar") or dims["head_dim"]) ** -0.5,
        sliding_window=int(window) if "sliding_attention" in types else None,
        layer_types=to_layer_types(types, where),
        moe=_moe(cfg, dense, where) if len(dense) < num_layers else None,
        attn_output_gate=True,
        sliding_num_heads=sliding_heads if sliding_heads != heads else None,
        attn_gate_per_head=True,
        swiglu_limits=_limits(cfg, "swiglu_limits", num_layers, where),
        swiglu_limits_shared=_limits(cfg, "swiglu_limits_shared", num_layers, where),
    )
    w = Weights(ckpt, _PREFIXES, _ignored(ckpt, num_layers))
    plan: Plan = {}
    add_embedding_and_head(w, plan, arch, dtype, gemma_norm=True)
    for i in range(num_layers):
        _add_layer(w, plan, arch, i, dtype)
    w.check_all_used()
    return _add_mtp(ckpt, cfg, arch, plan, dtype), plan


def _add_layer(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """Layer i: its two norms (1 + w), the gated attention, a dense MLP or the experts with the shared one."""
    add_norm(w, plan, f"layers.{i}.input_layernorm.weight", layer(i, "attn_norm.weight"), arch, dtype, True)
    add_norm(w, plan, f"layers.{i}.post_attention_layernorm.weight", layer(i, "mlp_norm.weight"), arch, dtype, True)
    _add_attention(w, plan, arch, i, dtype)
    if arch.moe is None or i in arch.moe.dense_layers:
        add_dense_mlp(w, plan, i, arch.hidden_size, arch.intermediate_size, dtype)
    else:
        _add_moe(w, plan, arch, i, dtype)


def _add_mtp(ckpt: Checkpoint, cfg: dict, arch: Architecture, plan: Plan, dtype) -> Architecture:
    """The MTP layers (layers.{N + k}. under model. or model.language_model.): enorm, hnorm, shared_head.norm (all
    1 + w, -> enorm, hnorm, norm), eh_proj [H, 2H] and a decoder layer mapped by _add_layer as layer N + k of its
    mtp_layer_types kind with its mtp_mlp_layer_types MLP -> mtp.{k}.*; the embedding / head copies are checked, not
    stored (mtp.take_copies). Its rope is its type's main layers' (as transformers' get_mtp_config builds it); its
    SwiGLU clamps are the release's padded lists' MTP entries. The architecture with Architecture.mtp if any."""
    n, where = arch.num_layers, ckpt.identifier
    sources = mtp.layer_modules(ckpt, _PREFIXES, n)
    if not sources:
        return arch
    mtp.check_count(ckpt, cfg, ("num_nextn_predict_layers",), len(sources))
    kinds, dense = _mtp_kinds(ckpt.config, cfg, n, len(sources), where)
    types = arch.layer_types or ["full"] * n
    if set(kinds) - set(types) or (arch.moe is None and len(dense) < len(sources)):
        raise ExportError(f"{where}: MTP layers of kinds {kinds} (MLPs dense at {dense}) need main layers of those "
                          f"kinds ({sorted(set(types))}) and, for an MoE one, the model's experts")
    moe = arch.moe and msgspec.structs.replace(arch.moe, dense_layers=[*arch.moe.dense_layers, *(n + k for k in dense)])
    draft = msgspec.structs.replace(arch, num_layers=n + len(sources), layer_types=[*types, *kinds], moe=moe)
    h = arch.hidden_size
    for k, src in enumerate(sources):
        view, own = mtp.ModuleView(ckpt, src, "", n + k), f"{mtp.MTP_PREFIX}{k}."
        for role, name in (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                           ("norm.weight", "shared_head.norm.weight")):
            add_norm(view, plan, name, own + role, arch, dtype, True)
        plan[own + "eh_proj.weight"] = load(view.take("eh_proj.weight", (h, 2 * h)), dtype)
        mtp.take_copies(view, arch.vocab_size, h)
        layer_plan: Plan = {}
        _add_layer(view.weights, layer_plan, draft, n + k, dtype)
        mtp.add_module_layer(plan, layer_plan, n + k, k)
        view.check_all_used()
    limits = {key: _mtp_limits(ckpt.config, key, n, len(sources), where)
              for key in ("swiglu_limits", "swiglu_limits_shared")}
    return msgspec.structs.replace(arch, mtp=MtpConfig(
        num_modules=len(sources), layout="step3p7", layer_kinds=kinds,
        moe_modules=[k for k in range(len(sources)) if k not in dense], **limits))


def _mtp_kinds(top: dict, cfg: dict, n: int, m: int, where: str) -> tuple[list[str], list[int]]:
    """(the MTP layers' attention kinds, the modules whose MLP is dense), as Step3p7TextConfig splits them off:
    mtp_layer_types (transformers' saved form) or the release's layer_types padded past n (all full when the config
    has no layer_types); mtp_mlp_layer_types, the padded mlp_layer_types, or moe_layers_enum read over the padded
    range (dense by default)."""
    raw = _raw_text(top)
    types = cfg.get("mtp_layer_types") or _padded_tail(raw.get("layer_types"), n, m)
    if types is None and raw.get("layer_types") is None:
        types = ["full_attention"] * m
    mlp = cfg.get("mtp_mlp_layer_types") or _padded_tail(raw.get("mlp_layer_types"), n, m)
    if mlp is None and raw.get("mlp_layer_types") is None:
        enum = raw.get("moe_layers_enum")
        items = (enum.split(",") if isinstance(enum, str) else enum) if enum is not None else []
        mlp = ["sparse" if n + k in {int(i) for i in items if str(i).strip()} else "dense" for k in range(m)]
    if types is None or mlp is None or len(types) != m or len(mlp) != m or set(mlp) - {"dense", "sparse"}:
        raise ExportError(f"{where}: the {m} MTP layers' types are not given (mtp_layer_types / mtp_mlp_layer_types, "
                          f"or layer_types / mlp_layer_types padded with their entries): {types}, {mlp}")
    kinds = [{"full_attention": "full", "sliding_attention": "sliding"}.get(t) for t in types]
    if None in kinds:
        raise ExportError(f"{where}: MTP layer types {types} must be full_attention or sliding_attention")
    return kinds, [k for k, kind in enumerate(mlp) if kind == "dense"]


def _mtp_limits(top: dict, key: str, n: int, m: int, where: str) -> list[float]:
    """The MTP layers' SwiGLU clamps: the release's `key` list padded past n (transformers drops those entries),
    0 for none; [] when it has none."""
    tail = _padded_tail(_raw_text(top).get(key), n, m) or []
    limits = [float(v or 0) for v in tail]
    if limits and min(limits) < 0:
        raise ExportError(f"{where}: {key} has a negative clamp for an MTP layer ({tail})")
    return limits if any(limits) else []


def _raw_text(top: dict) -> dict:
    """The text config as written (the release's padded lists uncut)."""
    return top["text_config"] if top["model_type"] == "step3p7" else top


def _padded_tail(value, n: int, m: int) -> list | None:
    return list(value[n:n + m]) if isinstance(value, list) and len(value) == n + m else None


# ---- config reading -----------------------------------------------------------------------------------------


def _text_config(top: dict, where: str) -> dict:
    """The text model's config: Step3p7TextConfig's defaults and aliases applied, the per-layer lists cut to
    num_hidden_layers; tie_word_embeddings as the model ties (a wrapper's own field decides, HF ties by it)."""
    if top["model_type"] == "step3p7":
        text = top.get("text_config")
        if not isinstance(text, dict):
            raise ExportError(f"{where}: model_type step3p7 without a text_config table")
        raw = {**text, "tie_word_embeddings": bool(top.get("tie_word_embeddings", False))}
    else:  # step3p5: the text model's fields at the top level
        raw = dict(top)
    cfg = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    for alias, name in _ALIASES.items():
        if alias in raw and name not in raw:
            cfg[name] = raw[alias]
    cfg.setdefault("tie_word_embeddings", False)
    num_layers, num_mtp = int(cfg["num_hidden_layers"]), int(cfg["num_nextn_predict_layers"])
    for key in _PADDED:  # lists padded with the MTP layers' entries lose them (as HF cuts them)
        value = cfg.get(key)
        if num_mtp and isinstance(value, list) and len(value) == num_layers + num_mtp:
            cfg[key] = value[:num_layers]
    return cfg


def _check_supported(cfg: dict, where: str) -> None:
    """Config features the runtime does not implement, or that transformers' Step3p7 model does not honour (it
    would run another model than the checkpoint's)."""
    checks = (
        (cfg.get("use_bidirectional_attention"), "use_bidirectional_attention=true (an encoder) is not supported"),
        (cfg.get("attention_bias"), "attention_bias=true (q/k/v/o biases) is not supported"),
        (cfg.get("mlp_bias"), "mlp_bias=true is not supported"),
        # HF's g_proj is per head for gating True / "per-head"; any other value builds a gate its forward cannot apply
        (cfg.get("gating", True) not in (True, "per-head"), f"gating={cfg.get('gating')!r} is not supported "
                                                            "(only the per-head output gate)"),
        (cfg.get("use_head_wise_attn_gate") is False, "use_head_wise_attn_gate=false (no output gate) is not "
                                                      "supported"),
        (cfg.get("use_qk_norm") is False, "use_qk_norm=false is not supported (the model always norms q and k)"),
        (cfg.get("moe_router_activation", "sigmoid") != "sigmoid",
         f"moe_router_activation={cfg.get('moe_router_activation')!r} is not supported (only sigmoid)"),
        (cfg.get("use_moe_router_bias") is False, "use_moe_router_bias=false is not supported (the router adds its "
                                                  "score bias)"),
        (cfg.get("norm_expert_weight") is False, "norm_expert_weight=false is not supported (the chosen experts' "
                                                 "weights are renormalised)"),
        (cfg.get("zero_centered") is False, "zero_centered=false is not supported (the norms multiply by 1 + w)"),
        (cfg.get("att_impl_type", "GQA") != "GQA", f"att_impl_type={cfg.get('att_impl_type')!r} is not supported "
                                                   "(only GQA)"),
        # the release's rope scaling applies to yarn_only_types; HF scales the full layers only
        (set(cfg.get("yarn_only_types") or ["full_attention"]) != {"full_attention"},
         f"yarn_only_types={cfg.get('yarn_only_types')} is not supported (rope scaling on the full layers only)"),
        (not all(cfg.get("use_rope_layers") or [True]), "use_rope_layers with a layer without rope is not supported"),
    )
    for failed, message in checks:
        if failed:
            raise ExportError(f"{where}: {message}")


def _hf_layer_types(cfg: dict, num_layers: int, where: str) -> list[str]:
    """layer_types (all full_attention when absent), HF's names; only full and sliding attention."""
    types = cfg.get("layer_types") or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    for i, kind in enumerate(types):
        if kind not in ("full_attention", "sliding_attention"):
            raise ExportError(f"{where}: layer {i} has type {kind!r} (supported: full_attention, sliding_attention)")
    return list(types)


def _head_counts(cfg: dict, types: list[str], where: str) -> tuple[int, int]:
    """(full layers' query heads, sliding layers'): num_sliding_attention_heads, else attention_other_setting's
    num_attention_heads, else num_attention_heads, unless a per_layer_config (transformers' saved form, which
    decides on reload) says otherwise. The sliding layers' K/V are the full layers' shapes, as HF builds them."""
    heads = int(cfg["num_attention_heads"])
    other = cfg.get("attention_other_setting") or {}
    for key, name in (("num_attention_groups", "num_key_value_heads"), ("num_key_value_heads", "num_key_value_heads"),
                      ("head_dim", "head_dim")):
        if key in other and int(other[key]) != int(cfg[name]):
            raise ExportError(f"{where}: attention_other_setting.{key}={other[key]} differs from {name}="
                              f"{cfg[name]} (sliding layers with their own K/V shapes are not supported)")
    sliding = int(cfg.get("num_sliding_attention_heads") or other.get("num_attention_heads", heads))
    per_layer = {i: (sliding if kind == "sliding_attention" else heads) for i, kind in enumerate(types)}
    overrides = cfg.get("per_layer_config")
    if overrides is not None:
        per_layer = {i: heads for i in range(len(types))}
        for key, override in overrides.items():
            if set(override) - {"num_attention_heads"} or not 0 <= int(key) < len(types):
                raise ExportError(f"{where}: per_layer_config[{key}] = {override} is not supported (only "
                                  "num_attention_heads of a layer)")
            per_layer[int(key)] = int(override.get("num_attention_heads", heads))
    counts = {kind: {per_layer[i] for i, t in enumerate(types) if t == kind} for kind in set(types)}
    if any(len(c) > 1 for c in counts.values()):
        raise ExportError(f"{where}: query heads differ between layers of one type ({counts})")
    full = counts.get("full_attention", {heads}).pop()
    return full, counts.get("sliding_attention", {full}).pop()


def _rope(cfg: dict, types: list[str], head_dim: int, where: str) -> dict:
    """The Architecture's rope fields: full layers' theta, scaling and rotary dims (rope_theta, rope_scaling,
    rotary_dim), sliding layers' theta and rotary dims (rope_local_theta, sliding_rotary_dim)."""
    entries = _rope_entries(cfg, types, where)
    max_pos = int(cfg["max_position_embeddings"])
    out: dict = {}
    for kind, entry in entries.items():
        rotary = _rotary_dim(entry, head_dim, where)
        theta = float(entry.get("rope_theta", _DEFAULT_THETA))
        scaling: RopeScaling | None = parse_rope_scaling(entry, max_pos, where)
        if kind == "full_attention":
            out.update(rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary)
        elif scaling is not None:
            raise ExportError(f"{where}: rope scaling on sliding layers is not supported")
        else:
            out.update(rope_local_theta=theta, sliding_rotary_dim=rotary)
    if "full_attention" not in entries:  # only sliding layers: the model reads rope_local_theta alone
        out["rope_theta"] = out["rope_local_theta"]
    return out


def _rope_entries(cfg: dict, types: list[str], where: str) -> dict[str, dict]:
    """Per layer type, its rope parameters: transformers' rope_parameters per type, or built from rope_theta (one,
    or one per layer), partial_rotary_factors (one per layer) and rope_scaling (full layers only), as
    Step3p7TextConfig.__post_init__ builds them; each type's layers must agree (HF reads its first layer's)."""
    kinds = sorted(set(types))
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp and all(isinstance(rp.get(kind), dict) for kind in kinds):
        return {kind: rp[kind] for kind in kinds}
    if rp:
        raise ExportError(f"{where}: rope_parameters must hold one table per layer type ({', '.join(kinds)})")
    theta, factors = cfg.get("rope_theta", _DEFAULT_THETA), cfg.get("partial_rotary_factors")
    thetas = theta if isinstance(theta, list) else [theta] * len(types)
    for name, values in (("rope_theta", thetas), ("partial_rotary_factors", factors)):
        if values is None:
            continue
        if len(values) != len(types):
            raise ExportError(f"{where}: {name} has {len(values)} entries for {len(types)} layers")
        for kind in kinds:
            if len({values[i] for i, t in enumerate(types) if t == kind}) > 1:
                raise ExportError(f"{where}: {name} differs between {kind} layers (one value per layer type)")
    entries = {}
    for kind in kinds:
        i = types.index(kind)
        entries[kind] = {"rope_type": "default", "rope_theta": thetas[i]}
        if factors:
            entries[kind]["partial_rotary_factor"] = factors[i]
    if cfg.get("rope_scaling") and "full_attention" in entries:
        entries["full_attention"].update(cfg["rope_scaling"])
    return entries


def _rotary_dim(entry: dict, head_dim: int, where: str) -> int | None:
    """int(head_dim * partial_rotary_factor), as HF computes it; None for the whole head."""
    rotary = int(head_dim * float(entry.get("partial_rotary_factor", 1.0)))
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ExportError(f"{where}: partial_rotary_factor={entry.get('partial_rotary_factor')} gives {rotary} "
                          f"rotary dims of a {head_dim}-dim head (must be even and positive)")
    return rotary if rotary < head_dim else None


def _dense_layers(cfg: dict, num_layers: int, where: str) -> list[int]:
    """mlp_layer_types, else moe_layers_enum (the release's MoE layer indices, a comma-separated string or a list),
    else every layer from the fourth MoE (Step3p7TextConfig's default)."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        enum = cfg.get("moe_layers_enum")
        if enum is None:
            sparse = set(range(3, num_layers))
        else:
            items = enum.split(",") if isinstance(enum, str) else enum
            sparse = {int(item) for item in items if str(item).strip()}
        kinds = ["sparse" if i in sparse else "dense" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ExportError(f"{where}: mlp_layer_types must be 'dense' or 'sparse' per layer, got {kinds!r}")
    return [i for i, kind in enumerate(kinds) if kind == "dense"]


def _moe(cfg: dict, dense: list[int], where: str) -> MoeConfig:
    experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    shared = int(cfg["share_expert_dim"])
    if not 0 < top_k <= experts:
        raise ExportError(f"{where}: num_experts_per_tok={top_k} of n_routed_experts={experts} experts")
    if shared <= 0:  # Step3p7SparseMoeBlock always builds its shared expert
        raise ExportError(f"{where}: share_expert_dim={shared} is not supported (must be > 0)")
    # HF renormalises the chosen sigmoid scores and scales the routed sum by moe_router_scaling_factor afterwards;
    # helios scales the weights instead (the same sum up to rounding)
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True,
                     dense_layers=dense, shared_expert_intermediate_size=shared, shared_expert_gate=False,
                     scoring="sigmoid", score_bias=True,
                     routed_scaling_factor=float(cfg["moe_router_scaling_factor"]))


def _limits(cfg: dict, key: str, num_layers: int, where: str) -> list[float]:
    """A per-layer SwiGLU clamp list: 0 where an entry is 0 or null (no clamp), [] when no layer clamps."""
    values = cfg.get(key)
    if not values:
        return []
    if len(values) != num_layers:
        raise ExportError(f"{where}: {key} has {len(values)} entries for {num_layers} layers")
    limits = [float(v or 0) for v in values]
    if min(limits) < 0:
        raise ExportError(f"{where}: {key} has a negative clamp ({values})")
    return limits if any(limits) else []


def _ignored(ckpt: Checkpoint, num_layers: int) -> tuple[str, ...]:
    """Prefixes of the tensors the main model's rules do not consume: the vision tower and projector, the MTP layers
    (index >= the decoder's layers, under either prefix: _add_mtp maps them)."""
    mtp = set()
    for name in ckpt.tensors:
        for prefix in _PREFIXES:
            m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
            if m and int(m.group(1)) >= num_layers:
                mtp.add(m.group(0))
    return (*_VISION, *sorted(mtp))


def layer_heads(arch: Architecture, i: int) -> int:
    """Query heads of layer i: sliding_num_heads on a sliding layer when set, else num_heads."""
    sliding = bool(arch.layer_types) and arch.layer_types[i] == "sliding"
    return arch.sliding_num_heads if sliding and arch.sliding_num_heads else arch.num_heads


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """Layer i's parameters: two norms, qkv and the per-head gate rows, the q/k norms, o; the dense MLP or the
    router (+ score bias), `experts_read` experts (None: all) and the shared expert."""
    h, d, nq = arch.hidden_size, arch.head_dim, layer_heads(arch, i)
    n = 2 * h + (nq * d + 2 * arch.num_kv_heads * d + nq) * h + 2 * d + h * nq * d
    moe = arch.moe
    if moe is None or i in moe.dense_layers:
        return n + 3 * h * arch.intermediate_size
    experts = moe.num_experts if experts_read is None else experts_read
    return (n + moe.num_experts * (h + 1) + experts * 3 * h * moe.moe_intermediate_size
            + 3 * h * moe.shared_expert_intermediate_size)


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """attn.qkv (rows q, k, v, then g_proj's one gate row per head), attn.q_norm / k_norm (1 + w), attn.o."""
    h, d, nq, nkv = arch.hidden_size, arch.head_dim, layer_heads(arch, i), arch.num_kv_heads
    src = f"layers.{i}.self_attn."
    rows = [w.take(f"{src}{p}_proj.weight", (n, h)) for p, n in (("q", nq * d), ("k", nkv * d), ("v", nkv * d),
                                                                  ("g", nq))]
    plan[layer(i, "attn.qkv.weight")] = load_fused(rows, dtype)
    for p in ("q", "k"):
        add_norm(w, plan, f"{src}{p}_norm.weight", layer(i, f"attn.{p}_norm.weight"), arch, dtype, True, d)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, nq * d)), dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """The router and its score bias, the experts stacked (gate rows, then up rows, per expert) and the shared
    expert, from either naming."""
    moe, h = arch.moe, arch.hidden_size
    e, fm = moe.num_experts, moe.moe_intermediate_size
    if w.has(f"layers.{i}.moe.gate.weight"):  # the release's
        src = f"layers.{i}.moe."
        plan[layer(i, "moe.router.weight")] = load(w.take(f"{src}gate.weight", (e, h)), dtype)
        plan[layer(i, "moe.router.bias")] = load(w.take(f"{src}router_bias", (e,)), dtype)
        gate_up = [w.take(f"{src}{p}_proj.weight", (e, fm, h)) for p in ("gate", "up")]
        plan[layer(i, "moe.gate_up.weight")] = _experts_fused(gate_up, dtype)
        plan[layer(i, "moe.down.weight")] = load(w.take(f"{src}down_proj.weight", (e, h, fm)), dtype)
        shared = f"layers.{i}.share_expert."
    else:  # transformers' in-memory naming
        add_experts(w, plan, arch, i, dtype)
        bias = w.take(f"layers.{i}.mlp.gate.e_score_correction_bias", (e,))
        plan[layer(i, "moe.router.bias")] = load(bias, dtype)
        shared = f"layers.{i}.mlp.shared_experts."
    kimi_linear._add_gated_mlp(w, plan, shared, layer(i, "moe.shared"), h, moe.shared_expert_intermediate_size, dtype)


def _experts_fused(parts: list[LazyTensor], dtype) -> Producer:
    """[E, Fm, H] gate and up stacks -> [E, 2*Fm, H], each expert's gate rows then its up rows."""
    return lambda: cast(torch.cat([p.load() for p in parts], dim=1), dtype)
