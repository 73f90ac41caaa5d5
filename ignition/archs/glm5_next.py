"""glm5_next (GLM-5.3-Flash), text only: Kimi delta attention layers with the safe (lower-bounded) forget gate,
NoPE MLA layers with the DSA indexer (pooled keys, top pools, the tail; "shared" layers reuse the previous layer's
selection), manifold-constrained hyper-connections (mHC) around every sublayer, clamped SwiGLU MLPs and sigmoid-routed
clamped experts with a shared expert.

model_type glm5_next (Glm5NextForConditionalGeneration: its text_config, or the text fields at the top level as flat
checkpoints keep them; tensors under model.language_model.) or glm5_next_text. Either tensor naming: the released
one (what transformers saves: self_attn.f_a_proj / dt_bias / A_log, q/k/v_conv1d, hc_attn_fn / _base / _scale,
experts.N.*) or the one transformers holds in memory (forget_gate.*, conv1d, attn_hc.*, stacked experts).
The MTP block (the layers past num_hidden_layers) goes to the core's mtp.{k}.* (ignition/archs/mtp.py, _add_mtp).
NOTE: the vision tower (model.visual.*) is ignored: images are a later issue.
"""

from __future__ import annotations

import re

import msgspec

from helios.core.layout import layer
from helios.core.manifest import Architecture, DsaConfig, MhcConfig, MlaConfig, MoeConfig, MtpConfig, RecurrentConfig
from ignition.archs import Plan, Weights, kimi_linear, mtp
from ignition.archs.llama import load, load_fused
from ignition.archs.qwen3_moe import add_experts
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint

# Glm5NextTextConfig's defaults for the fields read here that a config may omit
_DEFAULTS = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5, "attention_bias": False, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "swiglu_limit": 10.0, "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "index_kpool": 16,
    "index_kpool_always_select_tail": True,
}
_ALIASES = {"num_local_experts": "n_routed_experts"}  # Glm5NextTextConfig.attribute_map
_LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                "short_conv_kernel_size": "linear_conv_kernel_dim", "gate_lower_bound": "linear_lower_bound"}
_LAYER_TYPES = {"linear_attention": "linear", "indexed_attention": "full", "full_attention": "full"}
_KDA_CHUNK = 64  # chunk_kimi_delta_attention's chunk
_VISION = "model.visual."


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg, prefixes = _text_config(ckpt.config, where)
    _check_supported(cfg, where)
    num_layers = int(cfg["num_hidden_layers"])
    types = _layer_types(cfg, num_layers, where)
    dense = _dense_layers(cfg, num_layers, where)
    heads = int(cfg["num_attention_heads"])
    mla = _mla(cfg, where)
    arch = Architecture(
        family="glm5_next",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads,  # the expanded form's; the KV pages hold latents (arch.mla)
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=0.0,  # NoPE everywhere (position_embedding "none")
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        layer_types=types,
        moe=_moe(cfg, dense, where) if len(dense) < num_layers else None,
        recurrent=_recurrent(cfg) if "linear" in types else None,
        position_embedding="none",
        mla=mla,
        dsa=_dsa(cfg, types, where) if "full" in types else None,
        mhc=_mhc(cfg, where),
        swiglu_limit=_swiglu_limit(cfg, where),
    )
    w = Weights(ckpt, prefixes, _ignored(ckpt, prefixes, num_layers))
    plan: Plan = {}
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embed_tokens.weight", (v, h)), dtype)
    plan["norm.weight"] = load(w.take("norm.weight", (h,)), dtype)
    if arch.tie_word_embeddings:
        w.skip("lm_head.weight", root=True)
    else:
        plan["lm_head.weight"] = load(w.take("lm_head.weight", (v, h), root=True), dtype)
    for i in range(num_layers):
        _add_layer(w, plan, arch, i, dtype)
    w.check_all_used()
    return _add_mtp(ckpt, cfg, arch, plan, prefixes, dtype), plan


def _add_layer(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """Layer i: its two norms and mHC projections, KDA or MLA (+ its DSA indexer unless shared), a dense MLP or the
    experts."""
    for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
        plan[layer(i, f"{dst}.weight")] = load(w.take(f"layers.{i}.{src}.weight", (arch.hidden_size,)), dtype)
    for src, dst in (("attn", "attn_hc"), ("ffn", "mlp_hc")):
        _add_mhc(w, plan, arch, i, src, dst, dtype)
    if arch.layer_types[i] == "linear":
        kimi_linear._add_kda(w, plan, arch, i, dtype)
    else:
        kimi_linear._add_mla(w, plan, arch, i, dtype)
        if i not in arch.dsa.shared_layers:
            _add_indexer(w, plan, arch, i, dtype)
    if arch.moe is None or i in arch.moe.dense_layers:
        kimi_linear._add_dense_mlp(w, plan, arch, i, dtype)
    else:
        _add_moe(w, plan, arch, i, dtype)


def _add_mtp(ckpt: Checkpoint, cfg: dict, arch: Architecture, plan: Plan, prefixes: tuple[str, ...],
             dtype) -> Architecture:
    """The MTP block (layers.{N + k}., GLM-5.3-Flash's at 45): enorm, hnorm, eh_proj [H, 2H], shared_head.norm
    (-> norm) and an MLA layer with its own DSA indexer, its mHC projections and the experts (a dense MLP when it has
    no router), mapped by _add_layer as layer N + k -> mtp.{k}.*; the embedding / head copies are checked, not stored
    (mtp.take_copies). A KDA block or one reusing another layer's selection lacks its MLA / indexer tensors: refused.
    The architecture with Architecture.mtp when the checkpoint has blocks."""
    n, h = arch.num_layers, arch.hidden_size
    sources = mtp.layer_modules(ckpt, prefixes, n)
    if not sources:
        return arch
    mtp.check_count(ckpt, cfg, ("num_nextn_predict_layers",), len(sources))
    if arch.dsa is None:
        raise ExportError(f"{ckpt.identifier}: an MTP block (an MLA + DSA layer) in a model without MLA layers is not "
                          "supported")
    dense = [k for k, src in enumerate(sources) if not any(t.startswith(src + "mlp.gate.") for t in ckpt.tensors)]
    if arch.moe is None and len(dense) < len(sources):
        raise ExportError(f"{ckpt.identifier}: an MTP block with experts in a model without them is not supported")
    moe = arch.moe and msgspec.structs.replace(arch.moe, dense_layers=[*arch.moe.dense_layers, *(n + k for k in dense)])
    draft = msgspec.structs.replace(arch, num_layers=n + len(sources), layer_types=[*arch.layer_types,
                                    *["full"] * len(sources)], moe=moe)
    for k, src in enumerate(sources):
        view, own = mtp.ModuleView(ckpt, src, "", n + k), f"{mtp.MTP_PREFIX}{k}."
        for role, name, shape in (("enorm.weight", "enorm.weight", (h,)), ("hnorm.weight", "hnorm.weight", (h,)),
                                  ("eh_proj.weight", "eh_proj.weight", (h, 2 * h)),
                                  ("norm.weight", "shared_head.norm.weight", (h,))):
            plan[own + role] = load(view.take(name, shape), dtype)
        mtp.take_copies(view, arch.vocab_size, h)
        layer_plan: Plan = {}
        _add_layer(view.weights, layer_plan, draft, n + k, dtype)
        mtp.add_module_layer(plan, layer_plan, n + k, k)
        view.check_all_used()
    return msgspec.structs.replace(arch, mtp=MtpConfig(
        num_modules=len(sources), layout="glm5_next", layer_kinds=["full"] * len(sources),
        moe_modules=[k for k in range(len(sources)) if k not in dense]))


# ---- config reading -----------------------------------------------------------------------------------------


def _text_config(top: dict, where: str) -> tuple[dict, tuple[str, ...]]:
    """The text model's config (Glm5NextTextConfig's defaults, aliases and linear_attn_config applied) and the
    tensor prefixes to look under."""
    text = top.get("text_config")
    if top["model_type"] == "glm5_next_text" or text is None:
        # NOTE: Glm5NextConfig reads a flat config's top-level fields as its text_config
        raw = {k: v for k, v in top.items() if k != "text_config"}
    elif isinstance(text, dict):
        # the wrapper's own tie_word_embeddings decides (HF ties lm_head by the top-level config)
        raw = {**text, "tie_word_embeddings": top.get("tie_word_embeddings", False)}
    else:
        raise ExportError(f"{where}: text_config must be a table")
    # NOTE: null is a value for these (an unbounded gate; rejected configs), a missing key for the rest
    nullable = ("linear_lower_bound", "q_lora_rank", "swiglu_limit")
    cfg = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k in nullable}}
    for alias, name in _ALIASES.items():
        if alias in raw and name not in raw:
            cfg[name] = raw[alias]
    linear = raw.get("linear_attn_config") or {}
    for key, name in _LINEAR_KEYS.items():
        if key in linear:
            cfg[name] = linear[key]
    if linear and linear.get("safe_gate", True) and cfg["linear_lower_bound"] is None:
        cfg["linear_lower_bound"] = -5.0  # as Glm5NextTextConfig.__post_init__
    cfg.setdefault("tie_word_embeddings", False)
    return cfg, ("model.language_model.", "model.")


def _check_supported(cfg: dict, where: str) -> None:
    """Config features the runtime does not implement (or transformers rejects: it would build no model)."""
    if cfg["hidden_act"] not in ("silu", "swish"):  # the SwiGLUs' and the KDA convs' activation
        raise ExportError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported (only silu)")
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true is not supported")
    if int(cfg["num_key_value_heads"]) != int(cfg["num_attention_heads"]):
        raise ExportError(f"{where}: num_key_value_heads={cfg['num_key_value_heads']} differs from "
                          f"num_attention_heads={cfg['num_attention_heads']} (MLA has one K/V head per query head)")
    if not cfg["index_kpool_always_select_tail"]:
        # without the tail a query before its first complete pool attends to nothing (HF's rows become NaN)
        raise ExportError(f"{where}: index_kpool_always_select_tail=false is not supported")


def _layer_types(cfg: dict, num_layers: int, where: str) -> list:
    """As Glm5NextTextConfig: layer_types, else every 4th layer (i % 4 == 3) MLA + DSA; full_attention is read as
    indexed_attention (the config class renames it)."""
    types = cfg.get("layer_types") or [
        "indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    for i, t in enumerate(types):
        if t not in _LAYER_TYPES:
            raise ExportError(f"{where}: layer {i} has type {t!r} (supported: {', '.join(_LAYER_TYPES)})")
    return [_LAYER_TYPES[t] for t in types]


def _indexer_types(cfg: dict, num_layers: int, where: str) -> list[str]:
    """As Glm5NextTextConfig.__post_init__: indexer_types, else index_topk_pattern ("F"/"S" per layer), else the
    index_topk_freq / index_skip_topk_offset schedule."""
    types = cfg.get("indexer_types")
    if types is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            if isinstance(pattern, str) and set(pattern) - {"F", "S"}:
                raise ExportError(f"{where}: index_topk_pattern {pattern!r} has letters other than F and S")
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq, offset = max(int(cfg.get("index_topk_freq", 1)), 1), int(cfg.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"full", "shared"}:
        raise ExportError(f"{where}: indexer_types must be 'full' or 'shared' per layer, got {types!r}")
    return types


def _mla(cfg: dict, where: str) -> MlaConfig:
    if cfg.get("q_lora_rank") is None:
        raise ExportError(f"{where}: q_lora_rank is required (the DSA indexer reads the q latent)")
    if int(cfg["qk_rope_head_dim"]) != 0:
        raise ExportError(f"{where}: qk_rope_head_dim={cfg['qk_rope_head_dim']} is not supported (glm5_next's "
                          "attention is NoPE)")
    nope, v, rank = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"]), int(cfg["kv_lora_rank"])
    # the latent norms are built with rms_norm_eps here (kimi_linear's with their class default)
    return MlaConfig(kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=0, v_head_dim=v,
                     softmax_scale=nope**-0.5, q_lora_rank=int(cfg["q_lora_rank"]),
                     norm_eps=float(cfg["rms_norm_eps"]))


def _dsa(cfg: dict, types: list, where: str) -> DsaConfig:
    num_layers = len(types)
    heads, head_dim, pool, topk = (int(cfg[k]) for k in ("index_n_heads", "index_head_dim", "index_kpool",
                                                          "index_topk"))
    if min(heads, head_dim, pool, topk) <= 0 or topk % pool:
        raise ExportError(f"{where}: index_topk={topk} must be a positive multiple of index_kpool={pool} (and "
                          f"index_n_heads={heads}, index_head_dim={head_dim} positive)")
    indexer = _indexer_types(cfg, num_layers, where)
    shared = [i for i, t in enumerate(types) if t == "full" and indexer[i] == "shared"]
    for i in shared:
        # HF hands a layer the selection the decoder layer before it returned, which only a full-indexer attention
        # layer followed by a shared one does: anything else raises in its forward
        if i == 0 or types[i - 1] != "full" or indexer[i - 1] != "full":
            raise ExportError(f"{where}: layer {i} reuses the DSA selection (indexer_types 'shared') but layer "
                              f"{i - 1} is not an attention layer with its own indexer")
    return DsaConfig(num_heads=heads, head_dim=head_dim, pool_size=pool, num_pools=topk // pool,
                     shared_layers=shared)


def _mhc(cfg: dict, where: str) -> MhcConfig:
    streams, iterations, eps = int(cfg["hc_mult"]), int(cfg["hc_sinkhorn_iters"]), float(cfg["hc_eps"])
    if streams < 1 or iterations < 1:
        raise ExportError(f"{where}: hc_mult={streams}, hc_sinkhorn_iters={iterations} must be positive")
    return MhcConfig(num_streams=streams, sinkhorn_iterations=iterations, eps=eps)


def _swiglu_limit(cfg: dict, where: str) -> float:
    limit = cfg.get("swiglu_limit")
    if limit is None or float(limit) <= 0:  # HF's clamp(-limit, limit) needs a positive number
        raise ExportError(f"{where}: swiglu_limit={limit} is not supported (a positive clamp)")
    return float(limit)


def _recurrent(cfg: dict) -> RecurrentConfig:
    heads, head_dim = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
    bound = cfg["linear_lower_bound"]
    return RecurrentConfig(kind="kimi_delta", num_heads=heads, num_key_heads=heads, key_head_dim=head_dim,
                           value_head_dim=head_dim, conv_kernel=int(cfg["linear_conv_kernel_dim"]),
                           chunk_size=_KDA_CHUNK, gate_lower_bound=None if bound is None else float(bound))


def _dense_layers(cfg: dict, num_layers: int, where: str) -> list[int]:
    """mlp_layer_types, else the first three layers dense (Glm5NextTextConfig's default)."""
    kinds = cfg.get("mlp_layer_types") or ["dense" if i < 3 else "sparse" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ExportError(f"{where}: mlp_layer_types must be 'dense' or 'sparse' per layer, got {kinds!r}")
    return [i for i, kind in enumerate(kinds) if kind == "dense"]


def _moe(cfg: dict, dense: list[int], where: str) -> MoeConfig:
    experts, groups, top_groups = int(cfg["n_routed_experts"]), int(cfg["n_group"]), int(cfg["topk_group"])
    top_k, shared = int(cfg["num_experts_per_tok"]), int(cfg["n_shared_experts"])
    # the router ranks a group by its two best scores and picks top_k among the chosen groups' experts
    if groups <= 0 or experts % groups or experts // groups < 2:
        raise ExportError(f"{where}: n_routed_experts={experts} does not split into n_group={groups} groups of >= 2")
    if not 0 < top_groups <= groups or not 0 < top_k <= top_groups * (experts // groups):
        raise ExportError(f"{where}: topk_group={top_groups} of n_group={groups} cannot hold "
                          f"num_experts_per_tok={top_k} experts")
    if shared <= 0:  # Glm5NextTextMoE always builds its shared experts
        raise ExportError(f"{where}: n_shared_experts={shared} is not supported (must be > 0)")
    fm = int(cfg["moe_intermediate_size"])
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=fm,
                     norm_topk_prob=bool(cfg["norm_topk_prob"]), dense_layers=dense,
                     shared_expert_intermediate_size=fm * shared,  # the shared experts: one MLP of their summed width
                     shared_expert_gate=False, scoring="sigmoid", score_bias=True, num_groups=groups,
                     num_topk_groups=top_groups, routed_scaling_factor=float(cfg["routed_scaling_factor"]))


def _ignored(ckpt: Checkpoint, prefixes: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """Prefixes of the tensors the main model's rules do not consume: the vision tower and the MTP layers (index >=
    num_layers: _add_mtp maps them)."""
    mtp = set()
    for name in ckpt.tensors:
        for prefix in prefixes:
            m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
            if m and int(m.group(1)) >= num_layers:
                mtp.add(m.group(0))
    return (_VISION, "mtp.", *sorted(mtp))


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """kimi_linear's count of layer i (norms, KDA or MLA, the feed-forward) plus its two mHC projections and, in an
    MLA layer with its own indexer, the DSA indexer."""
    h, s = arch.hidden_size, arch.mhc.num_streams
    n = kimi_linear.layer_params(arch, i, experts_read) + 2 * ((2 + s) * s * (s * h + 1) + 3)
    if arch.layer_types[i] == "full" and i not in arch.dsa.shared_layers:
        d = arch.dsa
        n += d.num_heads * d.head_dim * arch.mla.q_lora_rank + (2 * d.head_dim + d.num_heads) * h
        n += 2 * d.head_dim + d.pool_size * d.head_dim
    return n


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _add_mhc(w: Weights, plan: Plan, arch: Architecture, i: int, src: str, dst: str, dtype) -> None:
    """hc_{attn,ffn}_{fn,base,scale} (released) or {attn,ffn}_hc.{fn,base,scale} (in memory) -> proj.weight, bias,
    scale."""
    s, h = arch.mhc.num_streams, arch.hidden_size
    rows = (2 + s) * s
    released = w.has(f"layers.{i}.hc_{src}_fn")
    parts = (("fn", "proj.weight", (rows, s * h)), ("base", "bias", (rows,)), ("scale", "scale", (3,)))
    for part, name, shape in parts:
        key = f"layers.{i}.hc_{src}_{part}" if released else f"layers.{i}.{src}_hc.{part}"
        plan[layer(i, f"{dst}.{name}")] = load(w.take(key, shape), dtype)


def _add_indexer(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """mla.indexer: q (wq_b), in_proj rows [key (wk), pool gate (index_kpool_compress_gate), head weights
    (weights_proj)], the key's LayerNorm, pool_bias (index_kpool_compress_ape)."""
    d, h = arch.dsa, arch.hidden_size
    src = f"layers.{i}.self_attn.indexer."
    plan[layer(i, "mla.indexer.q.weight")] = load(
        w.take(f"{src}wq_b.weight", (d.num_heads * d.head_dim, arch.mla.q_lora_rank)), dtype)
    rows = [w.take(f"{src}wk.weight", (d.head_dim, h)), w.take(f"{src}index_kpool_compress_gate", (d.head_dim, h)),
            w.take(f"{src}weights_proj.weight", (d.num_heads, h))]
    plan[layer(i, "mla.indexer.in_proj.weight")] = load_fused(rows, dtype)
    for part in ("weight", "bias"):
        plan[layer(i, f"mla.indexer.k_norm.{part}")] = load(w.take(f"{src}k_norm.{part}", (d.head_dim,)), dtype)
    plan[layer(i, "mla.indexer.pool_bias")] = load(
        w.take(f"{src}index_kpool_compress_ape", (d.pool_size, d.head_dim)), dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """The router (+ its score bias), the experts stacked (either naming), the shared experts as one MLP."""
    moe, h = arch.moe, arch.hidden_size
    src = f"layers.{i}.mlp."
    add_experts(w, plan, arch, i, dtype)
    plan[layer(i, "moe.router.bias")] = load(w.take(f"{src}gate.e_score_correction_bias", (moe.num_experts,)), dtype)
    kimi_linear._add_gated_mlp(w, plan, f"{src}shared_experts.", layer(i, "moe.shared"), h,
                               moe.shared_expert_intermediate_size, dtype)
