"""gemma4 (model_type gemma4_text, or gemma4 with a text_config: Gemma4ForConditionalGeneration, whose text weights sit
under model.language_model.): sliding and full layers with their own head dims, kv heads and rope (proportional on
the full ones), q/k norms and a weightless v norm, k = v on full layers (attention_k_eq_v), KV-shared layers
(num_kv_shared_layers) with double-wide MLPs, per-layer embeddings (PLE), the optional MoE block beside the MLP,
layer scalars, tied embeddings, a final logit soft-cap. Norm weights are stored as the multiplier (no 1 + w).

NOTE: the vision and audio towers and their embedders are ignored (text-only cores); vision tokens' bidirectional
attention (use_bidirectional_attention "vision") never meets a text-only prompt.
"""

from __future__ import annotations

import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, Gemma4Config, MoeConfig
from ignition.archs import Plan, Weights
from ignition.archs.llama import add_dense_mlp, add_embedding_and_head, load, load_fused, read_dims, to_layer_types
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast, round_to

# Gemma4TextConfig's defaults for the fields read here that a config may omit
_DEFAULTS = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256, "global_head_dim": 512,
}
_ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_IGNORED = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
          "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"}
_MOE_NORMS = {"post_feedforward_layernorm_1": "mlp_post_norm_1", "pre_feedforward_layernorm_2": "moe_norm",
              "post_feedforward_layernorm_2": "moe_post_norm"}


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg, prefixes = _text_config(ckpt.config, where)
    _check_supported(cfg, where)
    dims = read_dims(cfg, where)
    num_layers = dims["num_layers"]
    hf_types = _hf_layer_types(cfg, num_layers, where)
    full_dim, full_kv_heads = _full_shape(cfg, hf_types, dims, where)
    sliding_theta, full_theta, gemma4 = _rope(cfg, full_dim, where)
    types = to_layer_types(hf_types, where) or ["full"] * num_layers
    arch = Architecture(
        family="gemma4",
        **dims,
        rope_theta=full_theta,
        qk_norm=True,
        sandwich_norms=True,
        # NOTE: HF multiplies by sqrt(H) cast to the weight dtype first; the rounded value keeps every dtype exact
        embedding_scale=round_to(dims["hidden_size"] ** 0.5, dtype),
        query_scale=1.0,
        sliding_window=int(cfg["sliding_window"]) if "sliding" in types else None,
        rope_local_theta=sliding_theta,
        layer_types=types,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        moe=_moe(cfg, where) if cfg.get("enable_moe_block") else None,
        full_head_dim=full_dim if full_dim != dims["head_dim"] else None,
        full_num_kv_heads=full_kv_heads if full_kv_heads != dims["num_kv_heads"] else None,
        kv_sources=_kv_sources(cfg, hf_types, where),
        gemma4=Gemma4Config(
            rotated_pairs=gemma4["rotated_pairs"], rope_factor=gemma4["rope_factor"],
            k_eq_v=bool(cfg.get("attention_k_eq_v")), double_wide_mlp=bool(cfg.get("use_double_wide_mlp")),
            ple_dim=int(cfg.get("hidden_size_per_layer_input") or 0),
            ple_vocab_size=int(cfg["vocab_size_per_layer_input"]) if cfg.get("hidden_size_per_layer_input") else 0,
        ),
    )
    w = Weights(ckpt, prefixes, _IGNORED)
    plan: Plan = {}
    add_embedding_and_head(w, plan, arch, dtype, gemma_norm=False, head_names=("lm_head.weight",))
    if arch.gemma4.ple_dim:
        _add_ple(w, plan, arch, dtype)
    for i in range(num_layers):
        _add_layer(w, plan, arch, i, dtype)
    w.check_all_used()
    return arch, plan


# ---- config reading -----------------------------------------------------------------------------------------


def _text_config(top: dict, where: str) -> tuple[dict, tuple[str, ...]]:
    """The text model's config with Gemma4TextConfig's defaults, and the tensor prefixes to look under."""
    if top["model_type"] == "gemma4_text":
        return {**_DEFAULTS, **_present(top)}, ("model.",)
    text = top.get("text_config") or {}
    if not isinstance(text, dict):
        raise ExportError(f"{where}: text_config must be a table")
    # the wrapper's own tie_word_embeddings decides (HF ties lm_head by the top-level config; Gemma4Config: true)
    cfg = {**_DEFAULTS, **_present(text), "tie_word_embeddings": top.get("tie_word_embeddings", True)}
    return cfg, ("model.language_model.",)


def _present(cfg: dict) -> dict:
    # NOTE: null means "the default" for most fields; for these it is a value (none, off)
    nullable = ("final_logit_softcapping", "num_global_key_value_heads", "hidden_size_per_layer_input")
    return {k: v for k, v in cfg.items() if v is not None or k in nullable}


def _check_supported(cfg: dict, where: str) -> None:
    """Config features the runtime does not implement, each named."""
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true is not supported")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ExportError(f"{where}: use_bidirectional_attention='all' (an encoder) is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ExportError(f"{where}: hidden_activation '{cfg['hidden_activation']}' is not supported "
                          "(only gelu_pytorch_tanh)")
    if cfg.get("altup_num_inputs") or cfg.get("laurel_rank"):
        raise ExportError(f"{where}: AltUp / LAuReL (gemma3n) fields are not gemma4's")


def _hf_layer_types(cfg: dict, num_layers: int, where: str) -> list[str]:
    """HF's layer types: 5 sliding : 1 full by default, the last layer always full (Gemma4TextConfig)."""
    types = list(cfg.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)])
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    types[-1] = "full_attention"  # as __post_init__ forces it
    return types


def _full_shape(cfg: dict, hf_types: list[str], dims: dict, where: str) -> tuple[int, int]:
    """(head_dim, kv heads) of the full layers: per_layer_config (what transformers 5 saves) or global_head_dim and,
    with attention_k_eq_v, num_global_key_value_heads (released configs); the sliding layers keep the global ones."""
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        return int(cfg["global_head_dim"]), int(kv or dims["num_kv_heads"])
    if not isinstance(per_layer, dict):
        raise ExportError(f"{where}: per_layer_config must be a table")
    shapes = {}
    for i, kind in enumerate(hf_types):
        overrides = per_layer.get(str(i), per_layer.get(i)) or {}
        extra = sorted(set(overrides) - {"head_dim", "num_key_value_heads"})
        if extra:
            raise ExportError(f"{where}: per_layer_config overrides {extra} (layer {i}): not supported")
        shape = (int(overrides.get("head_dim", dims["head_dim"])),
                 int(overrides.get("num_key_value_heads", dims["num_kv_heads"])))
        shapes.setdefault(kind, set()).add(shape)
    if shapes.get("sliding_attention", {(dims["head_dim"], dims["num_kv_heads"])}) != {
            (dims["head_dim"], dims["num_kv_heads"])} or len(shapes["full_attention"]) != 1:
        raise ExportError(f"{where}: per_layer_config shapes must be one per layer type, the sliding layers' the "
                          f"global head_dim / num_key_value_heads (got {shapes})")
    return next(iter(shapes["full_attention"]))


def _rope(cfg: dict, full_dim: int, where: str) -> tuple[float, float, dict]:
    """(sliding theta, full theta, the full layers' proportional rope): sliding layers take default rope, full layers
    default or proportional rope (partial_rotary_factor, factor)."""
    rp = cfg.get("rope_parameters") or _ROPE_DEFAULTS
    if not isinstance(rp, dict) or not set(rp) <= set(_ROPE_DEFAULTS):
        raise ExportError(f"{where}: rope_parameters must be a table per layer type (sliding_attention, "
                          "full_attention)")
    sliding = rp.get("sliding_attention") or _ROPE_DEFAULTS["sliding_attention"]
    full = rp.get("full_attention") or _ROPE_DEFAULTS["full_attention"]
    if sliding.get("rope_type", "default") != "default":
        raise ExportError(f"{where}: rope_type '{sliding['rope_type']}' on sliding layers is not supported")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ExportError(f"{where}: rope_type '{kind}' on full layers is not supported (default, proportional)")
    partial = float(full.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    factor = float(full.get("factor", 1.0)) if kind == "proportional" else 1.0
    if sliding.get("partial_rotary_factor", 1.0) != 1.0:
        raise ExportError(f"{where}: partial_rotary_factor on sliding layers is not supported")
    rope = {"rotated_pairs": int(partial * full_dim // 2), "rope_factor": factor}
    return float(sliding.get("rope_theta", 10_000.0)), float(full.get("rope_theta", 10_000.0)), rope


def _kv_sources(cfg: dict, hf_types: list[str], where: str) -> list[int]:
    """Per layer the layer whose KV it reads: the last num_kv_shared_layers layers read the last unshared layer of
    their own type (Gemma4TextConfig.kv_sharing_modes); [] without sharing."""
    num_layers, shared = len(hf_types), int(cfg.get("num_kv_shared_layers") or 0)
    if shared == 0:
        return []
    first = num_layers - shared
    if first <= 0:
        raise ExportError(f"{where}: num_kv_shared_layers={shared} leaves no layer keeping KV")
    last_of = {kind: i for i, kind in enumerate(hf_types[:first])}
    missing = sorted(set(hf_types[first:]) - set(last_of))
    if missing:
        raise ExportError(f"{where}: KV-shared {missing} layers have no earlier layer of their type to read")
    return [i if i < first else last_of[kind] for i, kind in enumerate(hf_types)]


def _moe(cfg: dict, where: str) -> MoeConfig:
    try:
        return MoeConfig(num_experts=int(cfg["num_experts"]), num_experts_per_tok=int(cfg["top_k_experts"]),
                         moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True)
    except (KeyError, TypeError):
        raise ExportError(f"{where}: enable_moe_block needs num_experts, top_k_experts and "
                          "moe_intermediate_size") from None


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _add_ple(w: Weights, plan: Plan, arch: Architecture, dtype) -> None:
    """ple.embed [Vp, L*P] (the packed per-layer table), ple.proj [L*P, H] and ple.norm [P]."""
    g, h, n = arch.gemma4, arch.hidden_size, arch.num_layers
    plan["ple.embed.weight"] = load(w.take("embed_tokens_per_layer.weight", (g.ple_vocab_size, n * g.ple_dim)), dtype)
    plan["ple.proj.weight"] = load(w.take("per_layer_model_projection.weight", (n * g.ple_dim, h)), dtype)
    plan["ple.norm.weight"] = load(w.take("per_layer_projection_norm.weight", (g.ple_dim,)), dtype)


def _add_layer(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    h, g = arch.hidden_size, arch.gemma4
    src = f"layers.{i}."
    for name, dst in _NORMS.items():
        plan[layer(i, f"{dst}.weight")] = load(w.take(f"{src}{name}.weight", (h,)), dtype)
    _add_attention(w, plan, arch, i, dtype)
    shared = bool(arch.kv_sources) and arch.kv_sources[i] != i
    add_dense_mlp(w, plan, i, h, arch.intermediate_size * (2 if shared and g.double_wide_mlp else 1), dtype)
    if arch.moe is not None:
        _add_moe(w, plan, arch, i, dtype)
    if g.ple_dim:
        plan[layer(i, "ple_gate.weight")] = load(w.take(f"{src}per_layer_input_gate.weight", (g.ple_dim, h)), dtype)
        plan[layer(i, "ple_proj.weight")] = load(w.take(f"{src}per_layer_projection.weight", (h, g.ple_dim)), dtype)
        plan[layer(i, "ple_post_norm.weight")] = load(w.take(f"{src}post_per_layer_input_norm.weight", (h,)), dtype)
    plan[layer(i, "layer_scalar")] = load(w.take(f"{src}layer_scalar", (1,)), dtype)


def _add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """attn.qkv rows: q, then (own KV only) k, then v unless a full layer's v is its k (k_eq_v); q_norm, k_norm
    (own KV only), o. A KV-shared layer's stored k/v projections and norms (HF ignores them) are skipped."""
    h, full = arch.hidden_size, arch.layer_types[i] == "full"
    kv_heads, d = arch.kv_shape(i)
    src = f"layers.{i}.self_attn."
    parts = [w.take(f"{src}q_proj.weight", (arch.num_heads * d, h))]
    if arch.kv_sources and arch.kv_sources[i] != i:
        for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            if w.has(src + name):
                w.skip(src + name)
    else:
        parts.append(w.take(f"{src}k_proj.weight", (kv_heads * d, h)))
        if not (full and arch.gemma4.k_eq_v):
            parts.append(w.take(f"{src}v_proj.weight", (kv_heads * d, h)))
        plan[layer(i, "attn.k_norm.weight")] = load(w.take(f"{src}k_norm.weight", (d,)), dtype)
    plan[layer(i, "attn.qkv.weight")] = load_fused(parts, dtype)
    plan[layer(i, "attn.q_norm.weight")] = load(w.take(f"{src}q_norm.weight", (d,)), dtype)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, arch.num_heads * d)), dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """moe.router [E, H] with the router's scale and 1/sqrt(H) folded into its columns (it reads the weightless
    RMS-normed stream), moe.gate_up [E, 2*Fm, H], moe.down [E, H, Fm] with each expert's per_expert_scale folded in
    (a routing weight times a linear map), and the MoE branch's three norms."""
    e, h, fm = arch.moe.num_experts, arch.hidden_size, arch.moe.moe_intermediate_size
    src = f"layers.{i}."
    for name, dst in _MOE_NORMS.items():
        plan[layer(i, f"{dst}.weight")] = load(w.take(f"{src}{name}.weight", (h,)), dtype)
    proj, scale = w.take(f"{src}router.proj.weight", (e, h)), w.take(f"{src}router.scale", (h,))
    plan[layer(i, "moe.router.weight")] = lambda: cast(_scaled_columns(proj, scale, h**-0.5), dtype)
    plan[layer(i, "moe.gate_up.weight")] = load(w.take(f"{src}experts.gate_up_proj", (e, 2 * fm, h)), dtype)
    down, per_expert = w.take(f"{src}experts.down_proj", (e, h, fm)), w.take(f"{src}router.per_expert_scale", (e,))
    plan[layer(i, "moe.down.weight")] = lambda: cast(down.load().float() * per_expert.load().float()[:, None, None],
                                                     dtype)


def _scaled_columns(proj: LazyTensor, scale: LazyTensor, factor: float) -> torch.Tensor:
    return proj.load().float() * (scale.load().float() * factor)[None, :]


def extra_params(arch: Architecture, decode: bool) -> int:
    """Parameters outside the layers beyond the embedding, final norm and lm_head: the PLE table (one row per token
    when decoding), its projection and norm."""
    g, n = arch.gemma4, arch.num_layers
    if not g.ple_dim:
        return 0
    return (1 if decode else g.ple_vocab_size) * n * g.ple_dim + n * g.ple_dim * arch.hidden_size + g.ple_dim


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """One layer's runtime parameters (ignition.archs' size arithmetic): norms, qkv (fewer rows on k = v and
    KV-shared layers), q/k norms, o, the MLP (double-wide on KV-shared layers), the MoE block, PLE, layer scalar."""
    h, g, moe = arch.hidden_size, arch.gemma4, arch.moe
    kv_heads, d = arch.kv_shape(i)
    shared = bool(arch.kv_sources) and arch.kv_sources[i] != i
    kv_rows = 0 if shared else kv_heads * d * (1 if arch.layer_types[i] == "full" and g.k_eq_v else 2)
    n = 4 * h + (arch.num_heads * d + kv_rows) * h + (d if shared else 2 * d) + h * arch.num_heads * d + 1
    n += 3 * h * arch.intermediate_size * (2 if shared and g.double_wide_mlp else 1)
    if moe is not None:
        experts = moe.num_experts if experts_read is None else experts_read
        n += 3 * h + moe.num_experts * h + experts * 3 * h * moe.moe_intermediate_size
    if g.ple_dim:
        n += 2 * g.ple_dim * h + h
    return n
