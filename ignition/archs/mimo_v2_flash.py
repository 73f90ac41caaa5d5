"""mimo_v2_flash (MiMoV2FlashConfig) and mimo_v2 (the MiMo-V2.5 / V2.6 releases, not a transformers model_type):
full and sliding-window GQA layers (the sliding ones with their own KV head count and per-head attention sinks),
q/k heads wider than v heads, partial rotary with a rope base per layer type, V scaled by attention_value_scale;
a dense SwiGLU MLP or sigmoid-routed, group-limited experts without a shared expert.

Config keys: transformers' (layer_types, mlp_layer_types, rope_parameters per layer type, rms_norm_eps, sliding_window
including the query) or the released checkpoints' remote-code ones (hybrid_layer_pattern 0 full / 1 sliding,
moe_layer_freq 0 dense / 1 MoE, swa_* overrides, rope_theta / swa_rope_theta / partial_rotary_factor,
layernorm_epsilon, add_{swa,full}_attention_sink_bias, sliding_window_size = the keys before the query: window + 1,
as transformers reads it). Tensors under model.: q/k/v_proj apart (transformers, MiMo-V2-Flash) or one fused
qkv_proj (mimo_v2; see _fused_qkv), sinks or attention_sink_bias, stacked or per-expert experts.
The MTP draft layers (model.mtp.layers.{k}.*: enorm, hnorm, eh_proj, a sliding-window layer with a dense MLP whose
norm before the MLP is pre_mlp_layernorm, final_layernorm) go to the core's mtp.{k}.* (ignition/archs/mtp.py).
The vision / audio towers of a multimodal mimo_v2 are ignored (text only).
"""

from __future__ import annotations

import msgspec
import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, MoeConfig, MtpConfig
from ignition.archs import Plan, Producer, Weights, mtp
from ignition.archs.llama import add_embedding_and_head, load, load_fused, parse_rope_scaling, to_layer_types
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast, fuse_rows, stack_experts

# MiMoV2FlashConfig's defaults for the fields read here
_DEFAULTS = {
    "vocab_size": 152576, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 48,
    "num_attention_heads": 64, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8, "n_routed_experts": 256, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "head_dim": 192, "v_head_dim": 128, "sliding_window": 129, "attention_value_scale": 0.707,
}
_DEFAULT_ROPE = {"full_attention": 5_000_000.0, "sliding_attention": 10_000.0}
_DEFAULT_PARTIAL = 0.334
# non-text parts of a multimodal mimo_v2 checkpoint, and the MTP layers (mapped apart, by _add_mtp)
_IGNORED = ("model.mtp.", "mtp.", "visual.", "model.visual.", "vision_tower.", "model.vision_tower.",
            "audio_tower.", "model.audio_tower.", "multi_modal_projector.", "model.multi_modal_projector.")


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg = _config(ckpt.config, where)
    _check_supported(cfg, where)
    num_layers = int(cfg["num_hidden_layers"])
    hf_types = _hf_layer_types(cfg, num_layers, where)
    types = to_layer_types(hf_types, where)
    dense = _dense_layers(cfg, num_layers, where)
    head_dim, v_head_dim = int(cfg["head_dim"]), int(cfg["v_head_dim"])
    full_theta, local_theta, rotary_dim = _rope(cfg, head_dim, where)
    kv_heads = int(cfg["num_key_value_heads"])
    swa_kv_heads = int(cfg.get("swa_num_key_value_heads") or 2 * kv_heads)  # HF: sliding layers double them
    arch = Architecture(
        family="mimo_v2_flash",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("layernorm_epsilon") or cfg["rms_norm_eps"]),
        rope_theta=full_theta,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        sliding_window=_window(cfg) if types else None,
        rope_local_theta=local_theta,
        layer_types=types,
        moe=_moe(cfg, dense) if len(dense) < num_layers else None,
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        v_head_dim=v_head_dim if v_head_dim != head_dim else None,
        sliding_num_kv_heads=swa_kv_heads if types and swa_kv_heads != kv_heads else None,
        attention_sinks=_sink_types(cfg, types),
    )
    w = Weights(ckpt, ("model.",), _IGNORED)
    plan: Plan = {}
    add_embedding_and_head(w, plan, arch, dtype, gemma_norm=False)
    for i in range(num_layers):
        _add_layer(w, plan, arch, cfg, i, dtype)
    w.check_all_used()
    return _add_mtp(ckpt, cfg, arch, plan, dtype), plan


def _add_layer(w: Weights, plan: Plan, arch: Architecture, cfg: dict, i: int, dtype) -> None:
    """Layer i: its two norms, attention, and dense MLP or experts."""
    value_scale = float(cfg["attention_value_scale"] if cfg["attention_value_scale"] is not None else 1.0)
    for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
        plan[layer(i, f"{dst}.weight")] = load(w.take(f"layers.{i}.{src}.weight", (arch.hidden_size,)), dtype)
    _add_attention(w, plan, arch, i, value_scale, int(cfg["num_key_value_heads"]), dtype)
    if arch.moe is None or i in arch.moe.dense_layers:
        _add_dense_mlp(w, plan, arch, i, dtype)
    else:
        _add_moe(w, plan, arch, i, dtype)


def _add_mtp(ckpt: Checkpoint, cfg: dict, arch: Architecture, plan: Plan, dtype) -> Architecture:
    """The MTP layers (model.mtp.layers.{k}.): enorm, hnorm, eh_proj [H, 2H], final_layernorm, and a sliding layer
    with a dense MLP (its sinks as the sliding layers have them; pre_mlp_layernorm is its mlp_norm), mapped by
    _add_layer as layer num_layers + k -> mtp.{k}.*; the architecture with Architecture.mtp when there are any."""
    found = mtp.module_indices(ckpt, ("model.mtp.", "mtp."), r"^model\.mtp\.layers\.(\d+)\.")
    if not found:
        return arch
    mtp.check_count(ckpt, cfg, ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_layers"), len(found))
    n, h = arch.num_layers, arch.hidden_size
    moe = arch.moe if arch.moe is None else msgspec.structs.replace(
        arch.moe, dense_layers=[*arch.moe.dense_layers, *range(n, n + len(found))])
    types = arch.layer_types or ["full"] * n
    sinks = arch.attention_sinks if "sliding" in types or not cfg.get("add_swa_attention_sink_bias", True) \
        else [*arch.attention_sinks, "sliding"]  # a model without sliding layers still gives its MTP layers sinks
    draft = msgspec.structs.replace(arch, num_layers=n + len(found), layer_types=[*types, *["sliding"] * len(found)],
                                    moe=moe, attention_sinks=sinks)
    for k in found:
        view = mtp.ModuleView(ckpt, f"model.mtp.layers.{k}.", "", n + k,
                              renames={"pre_mlp_layernorm.": "post_attention_layernorm."})
        own = f"{mtp.MTP_PREFIX}{k}."
        for role, name, shape in (("enorm.weight", "enorm.weight", (h,)), ("hnorm.weight", "hnorm.weight", (h,)),
                                  ("eh_proj.weight", "eh_proj.weight", (h, 2 * h)),
                                  ("norm.weight", "final_layernorm.weight", (h,))):
            plan[own + role] = load(view.take(name, shape), dtype)
        layer_plan: Plan = {}
        _add_layer(view.weights, layer_plan, draft, cfg, n + k, dtype)
        mtp.add_module_layer(plan, layer_plan, n + k, k)
        view.check_all_used()
    return msgspec.structs.replace(arch, mtp=MtpConfig(num_modules=len(found), layout="mimo_v2_flash",
                                                       layer_kinds=["sliding"] * len(found)))


# ---- config reading -----------------------------------------------------------------------------------------


def _config(raw: dict, where: str) -> dict:
    """The text config with MiMoV2FlashConfig's defaults: a mimo_v2 wrapper's text_config, when it has one, over
    its top level (vision / audio sub-configs are not read)."""
    text = raw.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ExportError(f"{where}: text_config is not a table")
    merged = {**raw, **(text or {})}
    return {**_DEFAULTS, **{k: v for k, v in merged.items() if v is not None or k == "attention_value_scale"}}


def _check_supported(cfg: dict, where: str) -> None:
    """Config features the runtime does not implement, each named."""
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise ExportError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported (only silu)")
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true (q/k/v biases) is not supported")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ExportError(f"{where}: quantization_config ({method}) is not supported: export from bf16 weights")
    if cfg.get("n_shared_experts"):
        raise ExportError(f"{where}: n_shared_experts={cfg['n_shared_experts']} is not supported (mimo has none)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ExportError(f"{where}: scoring_func '{cfg['scoring_func']}' is not supported (only sigmoid)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ExportError(f"{where}: topk_method '{cfg['topk_method']}' is not supported (only noaux_tc)")
    if cfg.get("hybrid_block_size") is not None:
        raise ExportError(f"{where}: hybrid_block_size is not supported")
    for key, base in (("swa_num_attention_heads", "num_attention_heads"), ("swa_head_dim", "head_dim"),
                      ("swa_v_head_dim", "v_head_dim")):
        if cfg.get(key) is not None and cfg[key] != cfg[base]:
            raise ExportError(f"{where}: {key}={cfg[key]} differs from {base}={cfg[base]}: not supported")
    layout = cfg.get("attention_projection_layout")
    if layout not in (None, "fused_qkv"):
        raise ExportError(f"{where}: attention_projection_layout '{layout}' is not supported (fused_qkv or none)")
    heads, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    if heads % kv or heads % int(cfg.get("swa_num_key_value_heads") or 2 * kv):
        raise ExportError(f"{where}: {heads} heads do not group over the KV heads")


def _hf_layer_types(cfg: dict, num_layers: int, where: str) -> list[str]:
    """layer_types, else hybrid_layer_pattern (1 = sliding), else HF's default: layer 0 and every 6th full."""
    types = cfg.get("layer_types")
    if not types and cfg.get("hybrid_layer_pattern") is not None:
        names = {0: "full_attention", 1: "sliding_attention"}
        if any(p not in names for p in cfg["hybrid_layer_pattern"]):
            raise ExportError(f"{where}: hybrid_layer_pattern holds values other than 0 and 1")
        types = [names[p] for p in cfg["hybrid_layer_pattern"]]
    if not types:
        types = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ExportError(f"{where}: {len(types)} layer types for {num_layers} layers")
    return list(types)


def _dense_layers(cfg: dict, num_layers: int, where: str) -> list[int]:
    """mlp_layer_types ("dense"/"sparse"), else moe_layer_freq (0 dense / 1 MoE), else HF's: layer 0 dense."""
    kinds = cfg.get("mlp_layer_types")
    if not kinds and cfg.get("moe_layer_freq") is not None:
        kinds = ["sparse" if f else "dense" for f in cfg["moe_layer_freq"]]
    kinds = kinds or ["dense"] + ["sparse"] * (num_layers - 1)
    if len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ExportError(f"{where}: the MLP layer types must be {num_layers} of dense / sparse, got {kinds}")
    return [i for i, k in enumerate(kinds) if k == "dense"]


def _window(cfg: dict) -> int:
    """HF's sliding_window (the query and the keys before it); sliding_window_size counts the keys before the query
    only (SGLang's reference), so transformers adds one."""
    size = cfg.get("sliding_window_size")
    return int(size) + 1 if size is not None else int(cfg["sliding_window"])


def _rope(cfg: dict, head_dim: int, where: str) -> tuple[float, float, int]:
    """(full theta, sliding theta, rotated dims): rope_parameters per layer type (HF), else rope_theta /
    swa_rope_theta / partial_rotary_factor, else HF's defaults. Both types must rotate the same dims, unscaled."""
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if "full_attention" in rp or "sliding_attention" in rp:  # HF's: one entry per layer type
        entries = {kind: rp.get(kind) or {} for kind in _DEFAULT_ROPE}
    else:  # flat: the full layers' base; the sliding layers' from swa_rope_theta
        entries = {"full_attention": rp, "sliding_attention": {k: v for k, v in rp.items() if k != "rope_theta"}}
    thetas, factors = {}, {}
    for kind, key in (("full_attention", "rope_theta"), ("sliding_attention", "swa_rope_theta")):
        entry = entries[kind]
        if parse_rope_scaling(entry, int(cfg["max_position_embeddings"]), where) is not None:
            raise ExportError(f"{where}: rope scaling ({kind}) is not supported")
        thetas[kind] = float(entry.get("rope_theta") or cfg.get(key) or _DEFAULT_ROPE[kind])
        factors[kind] = float(entry.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
                              or _DEFAULT_PARTIAL)
    if factors["full_attention"] != factors["sliding_attention"]:
        raise ExportError(f"{where}: partial_rotary_factor differs between layer types ({factors}): not supported")
    rotary_dim = int(head_dim * factors["full_attention"])  # HF: int(head_dim * partial_rotary_factor)
    if rotary_dim % 2 or rotary_dim == 0:
        raise ExportError(f"{where}: partial rotary of {rotary_dim} dims (head_dim {head_dim}) must be even and > 0")
    return thetas["full_attention"], thetas["sliding_attention"], rotary_dim


def _sink_types(cfg: dict, types: list[str]) -> list[str]:
    """The layer types whose attention has sinks: HF gives the sliding layers sinks and the full ones none; the
    released configs say so with add_swa_attention_sink_bias / add_full_attention_sink_bias."""
    sinks = []
    if cfg.get("add_full_attention_sink_bias", False):
        sinks.append("full")
    if cfg.get("add_swa_attention_sink_bias", True) and "sliding" in types:
        sinks.append("sliding")
    return sinks


def _moe(cfg: dict, dense: list[int]) -> MoeConfig:
    return MoeConfig(
        num_experts=int(cfg["n_routed_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        dense_layers=dense,
        shared_expert_gate=False,  # no shared expert at all (shared_expert_intermediate_size 0)
        scoring="sigmoid",
        score_bias=True,
        num_groups=int(cfg["n_group"]),
        num_topk_groups=int(cfg["topk_group"]),
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
    )


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """Parameters of layer i (ignition.archs.num_params / decode_weight_bytes): two norms, qkv (v rows v_head_dim
    wide), o, sinks, and the MLP or the router (+ score bias) and `experts_read` experts (None: all)."""
    h, d, nq = arch.hidden_size, arch.head_dim, arch.num_heads
    dv, nkv = arch.v_head_dim or d, arch.layer_kv_heads(i)
    n = 2 * h + (nq * d + nkv * (d + dv)) * h + h * nq * dv
    n += nq if _has_sinks(arch, i) else 0
    moe = arch.moe
    if moe is None or i in moe.dense_layers:
        return n + 3 * h * arch.intermediate_size
    experts = moe.num_experts if experts_read is None else experts_read
    return n + moe.num_experts * (h + 1) + experts * 3 * h * moe.moe_intermediate_size


def _has_sinks(arch: Architecture, i: int) -> bool:
    return (arch.layer_types[i] if arch.layer_types else "full") in arch.attention_sinks


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, value_scale: float, chunks: int,
                   dtype) -> None:
    """attn.qkv rows [q, k, v] with V times attention_value_scale (NOTE: folded here, so the pages keep HF's
    scaled V), attn.o, attn.sinks on the layer types that have them."""
    h, d, nq = arch.hidden_size, arch.head_dim, arch.num_heads
    dv, nkv = arch.v_head_dim or d, arch.layer_kv_heads(i)
    sizes = [nq * d, nkv * d, nkv * dv]
    src = f"layers.{i}.self_attn."
    if w.has(f"{src}qkv_proj.weight"):
        fused = w.take(f"{src}qkv_proj.weight", (sum(sizes), h))
        plan[layer(i, "attn.qkv.weight")] = lambda: cast(_scale_v(_fused_qkv(fused.load(), sizes, chunks),
                                                                  sizes, value_scale), dtype)
    else:
        parts = [w.take(f"{src}{p}_proj.weight", (n, h)) for p, n in zip("qkv", sizes)]
        plan[layer(i, "attn.qkv.weight")] = lambda: cast(_scale_v(fuse_rows(*(p.load() for p in parts)), sizes,
                                                                  value_scale), dtype)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, nq * dv)), dtype)
    if _has_sinks(arch, i):
        name = f"{src}sinks" if w.has(f"{src}sinks") else f"{src}attention_sink_bias"
        plan[layer(i, "attn.sinks")] = load(w.take(name, (nq,)), dtype)


def _fused_qkv(t: torch.Tensor, sizes: list[int], chunks: int) -> torch.Tensor:  # [rows, H] -> [rows, H]
    """mimo_v2's fused qkv_proj -> rows [q, k, v]. The releases store it rank-major, as `chunks` tensor-parallel
    shards side by side, each shard its own [q, k, v] rows (chunks = the config's num_key_value_heads; 1 is the
    plain [q, k, v]). NOTE: read from third-party loaders of the V2.5 / V2.6 checkpoints, not from a released file."""
    if any(s % chunks for s in sizes):
        raise ExportError(f"fused qkv_proj rows {sizes} do not split into {chunks} shards")
    shards = t.view(chunks, sum(sizes) // chunks, -1).split([s // chunks for s in sizes], dim=1)
    return torch.cat([s.reshape(-1, t.shape[1]) for s in shards])


def _scale_v(qkv: torch.Tensor, sizes: list[int], value_scale: float) -> torch.Tensor:
    """HF's v_proj(x) * attention_value_scale as a scaled weight (in float32, before the cast)."""
    if value_scale == 1.0:
        return qkv
    out = qkv.float().clone()
    out[sizes[0] + sizes[1]:] *= value_scale
    return out


def _add_dense_mlp(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    src, h, f = f"layers.{i}.mlp.", arch.hidden_size, arch.intermediate_size
    plan[layer(i, "mlp.gate_up.weight")] = load_fused([w.take(f"{src}{p}_proj.weight", (f, h))
                                                       for p in ("gate", "up")], dtype)
    plan[layer(i, "mlp.down.weight")] = load(w.take(f"{src}down_proj.weight", (h, f)), dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """moe.router (+ the score bias), the experts stacked (gate rows, then up rows) from transformers' stacked
    tensors or the released per-expert ones."""
    moe, h = arch.moe, arch.hidden_size
    e, fm = moe.num_experts, moe.moe_intermediate_size
    src = f"layers.{i}.mlp."
    plan[layer(i, "moe.router.weight")] = load(w.take(f"{src}gate.weight", (e, h)), dtype)
    plan[layer(i, "moe.router.bias")] = load(w.take(f"{src}gate.e_score_correction_bias", (e,)), dtype)
    if w.has(f"{src}experts.gate_up_proj"):
        plan[layer(i, "moe.gate_up.weight")] = load(w.take(f"{src}experts.gate_up_proj", (e, 2 * fm, h)), dtype)
        plan[layer(i, "moe.down.weight")] = load(w.take(f"{src}experts.down_proj", (e, h, fm)), dtype)
        return
    gate_up = [[w.take(f"{src}experts.{j}.{p}_proj.weight", (fm, h)) for p in ("gate", "up")] for j in range(e)]
    down = [[w.take(f"{src}experts.{j}.down_proj.weight", (h, fm))] for j in range(e)]
    plan[layer(i, "moe.gate_up.weight")] = _stacked(gate_up, dtype)
    plan[layer(i, "moe.down.weight")] = _stacked(down, dtype)


def _stacked(parts: list[list[LazyTensor]], dtype) -> Producer:
    # NOTE: each expert is cast before stacking, so the peak is one layer's experts in the target dtype
    return lambda: stack_experts([cast(fuse_rows(*(p.load() for p in rows)), dtype) for rows in parts])
