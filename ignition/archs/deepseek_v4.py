"""deepseek_v4 (DeepSeek-V4-Flash / V4.1-Flash), text only: sliding-window shared-KV MQA with per-head sinks and
compressed entries (HCA, or CSA with the lightning indexer) per layer_types, mHC residual streams with a learned
collapse (hc_head), routed clamped-SwiGLU experts with sqrtsoftplus (or sigmoid) scores and one shared expert, the
first layers hash-routed (tid2eid).

The released tensor naming (what transformers saves and the published checkpoint holds: attn.wq_a, attn.compressor.
wkv, ffn.experts.N.w1, hc_attn_fn, ...), under "model." or at the top level (embed.weight, hc_head_fn, head.weight).
The config as DeepseekV4Config reads it: layer_types or the legacy compress_ratios, compress_rates or the legacy
compress_rate_csa / _hca, mlp_layer_types or num_hash_layers, partial_rotary_factor or qk_rope_head_dim, the nested
rope_parameters (main / compress) or the flat rope_scaling that becomes the compress rope.
The MTP blocks (mtp.{k}.*, or model.mtp.{k}.*) go to the core's mtp.{k}.* (ignition/archs/mtp.py; each block's
decoder layer of the compress_ratios / layer_types entry past the main layers, sliding without one).
NOTE: quantized checkpoints (FP8 with scales) are a later issue.
"""

from __future__ import annotations

import dataclasses

import msgspec
import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, CompressedAttentionConfig, MoeConfig, MtpConfig, RopeScaling
from ignition.archs import Plan, Weights, mtp
from ignition.archs.glm5_next import _add_mhc, _mhc, _swiglu_limit
from ignition.archs.llama import load, load_fused
from ignition.archs.qwen3_moe import _stacked, _stacked_fused
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint

# DeepseekV4Config's defaults for the fields read here that a config may omit
_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8,
    "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "mlp_bias": False,
}
_ALIASES = {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"}
_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_RATIO_KINDS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_NUM_HASH_LAYERS = 3


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg = _config(ckpt.config, where)
    num_layers = int(cfg["num_hidden_layers"])
    heads, head_dim = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    compressed = _compressed(cfg, num_layers, heads, head_dim, where)
    arch = Architecture(
        family="deepseek_v4",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=1,  # one K = V head, whatever num_key_value_heads says (HF reads none)
        head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(cfg["rope_theta"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        sliding_window=compressed.window,  # every layer's (the engine's window page group holds the raw rows)
        moe=_moe(cfg, num_layers, where),
        mhc=_mhc(cfg, where),
        swiglu_limit=_swiglu_limit(cfg, where),
        compressed=compressed,
    )
    w = Weights(_top_level_renamed(ckpt), ("model.", ""), ("mtp.", "model.mtp."))  # the MTP blocks: _add_mtp
    plan: Plan = {}
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embed_tokens.weight", (v, h)), dtype)
    plan["norm.weight"] = load(w.take("norm.weight", (h,)), dtype)
    head = "head.weight" if w.has("head.weight", root=True) else "lm_head.weight"
    if arch.tie_word_embeddings:
        w.skip(head, root=True)
    else:
        plan["lm_head.weight"] = load(w.take(head, (v, h), root=True), dtype)
    _add_hc_head(w, plan, arch, dtype)
    for i in range(num_layers):
        _add_layer(w, plan, arch, i, dtype)
    w.check_all_used()
    return _add_mtp(ckpt, cfg, arch, plan, dtype), plan


def _add_layer(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """Layer i: its two norms, mHC projections, attention and experts."""
    for src, dst in (("attn_norm", "attn_norm"), ("ffn_norm", "mlp_norm")):
        plan[layer(i, f"{dst}.weight")] = load(w.take(f"layers.{i}.{src}.weight", (arch.hidden_size,)), dtype)
    for src, dst in (("attn", "attn_hc"), ("ffn", "mlp_hc")):
        _add_mhc(w, plan, arch, i, src, dst, dtype)
    _add_attention(w, plan, arch, i, dtype)
    _add_moe(w, plan, arch, i, dtype)


def _add_mtp(ckpt: Checkpoint, cfg: dict, arch: Architecture, plan: Plan, dtype) -> Architecture:
    """The MTP blocks (mtp.{k}. as published, model.mtp.{k}. as HF's (^|\\.)mtp\\. pattern allows): enorm, hnorm,
    e_proj, h_proj, norm, hc_head_{fn,base,scale} and a V4 block (attn_norm, attn.*, ffn.*, hc_attn_* ...), mapped by
    _add_layer as layer num_layers + k of the entry's kind, its experts score-routed -> mtp.{k}.*; the architecture
    with Architecture.mtp when the checkpoint has blocks."""
    found = mtp.module_indices(ckpt, ("mtp.", "model.mtp."), r"^(?:model\.)?mtp\.(\d+)\.")
    if not found:
        return arch
    mtp.check_count(ckpt, cfg, ("num_nextn_predict_layers",), len(found))
    n, h, s = arch.num_layers, arch.hidden_size, arch.mhc.num_streams
    kinds = _mtp_kinds(cfg, n, len(found), ckpt.identifier)
    c = arch.compressed
    draft = msgspec.structs.replace(arch, num_layers=n + len(found), compressed=msgspec.structs.replace(
        c, layer_kinds=[*c.layer_kinds, *kinds]))
    for k in found:
        src = f"mtp.{k}." if any(name.startswith(f"mtp.{k}.") for name in ckpt.tensors) else f"model.mtp.{k}."
        view, own = mtp.ModuleView(ckpt, src, "", n + k), f"{mtp.MTP_PREFIX}{k}."
        for role, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("e_proj.weight", (h, h)),
                            ("h_proj.weight", (h, h)), ("norm.weight", (h,))):
            plan[own + role] = load(view.take(role, shape), dtype)
        for part, name, shape in (("fn", "proj.weight", (s, s * h)), ("base", "bias", (s,)), ("scale", "scale", (1,))):
            plan[f"{own}hc_head.{name}"] = load(view.take(f"hc_head_{part}", shape), dtype)
        layer_plan: Plan = {}
        _add_layer(view.weights, layer_plan, draft, n + k, dtype)
        mtp.add_module_layer(plan, layer_plan, n + k, k)
        view.check_all_used()
    moe = list(range(len(found)))  # a V4 block's ffn is always the routed experts and the shared one
    return msgspec.structs.replace(arch, mtp=MtpConfig(num_modules=len(found), layout="deepseek_v4",
                                                       layer_kinds=kinds, moe_modules=moe))


def _mtp_kinds(cfg: dict, num_layers: int, count: int, where: str) -> list[str]:
    """The MTP blocks' attention kinds: the entries of layer_types or compress_ratios past the main layers (the
    published config lists them; DeepseekV4Config cuts them), else sliding (the reference's default ratio 0)."""
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        types = [_RATIO_KINDS.get(r, r) for r in cfg["compress_ratios"]]
    tail = list(types or [])[num_layers:num_layers + count]
    tail += ["sliding_attention"] * (count - len(tail))
    if set(tail) - set(_KINDS):
        raise ExportError(f"{where}: the MTP blocks' layer kinds {tail!r} must each be one of {', '.join(_KINDS)}")
    return [_KINDS[t] for t in tail]


# ---- config reading -----------------------------------------------------------------------------------------


def _config(raw: dict, where: str) -> dict:
    """The config with DeepseekV4Config's defaults and aliases, checked for what the runtime does not implement."""
    cfg = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k == "swiglu_limit"}}
    for alias, name in _ALIASES.items():
        if alias in raw and name not in raw:
            cfg[name] = raw[alias]
    if cfg.get("quantization_config"):
        raise ExportError(f"{where}: quantization_config is not supported (quantized deepseek_v4 checkpoints are a "
                          "later issue; export a bfloat16 one)")
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise ExportError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported (only silu)")
    if cfg["mlp_bias"]:
        raise ExportError(f"{where}: mlp_bias=true is not supported")
    return cfg


def _layer_kinds(cfg: dict, num_layers: int, where: str) -> list[str]:
    """As DeepseekV4Config.__post_init__: layer_types, else the legacy compress_ratios (0 / 4 / 128 per layer), else
    two HCA layers then CSA and HCA alternating; cut to num_hidden_layers (the MTP layer's entry dropped)."""
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = cfg["compress_ratios"]
        if set(ratios) - set(_RATIO_KINDS):
            raise ExportError(f"{where}: compress_ratios entries must be 0, 4 or 128, got {ratios!r}")
        types = [_RATIO_KINDS[r] for r in ratios]
    if types is None:
        rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                for i in range(max(num_layers - 2, 0))]
        types = ["heavily_compressed_attention"] * min(num_layers, 2) + rest
    types = list(types)[:num_layers]
    if len(types) != num_layers or set(types) - set(_KINDS):
        raise ExportError(f"{where}: layer_types must name one of {', '.join(_KINDS)} for each of the "
                          f"{num_layers} layers, got {types!r}")
    return [_KINDS[t] for t in types]


def _rope_dim(cfg: dict, head_dim: int, where: str) -> tuple[int, float]:
    """(the rotated trailing dims of a head, partial_rotary_factor): partial_rotary_factor, else the legacy
    qk_rope_head_dim / head_dim, else 64 / 512."""
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        factor = cfg["qk_rope_head_dim"] / head_dim if cfg.get("qk_rope_head_dim") is not None else 64 / 512
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ExportError(f"{where}: partial_rotary_factor={factor} gives {dim} rotated dims of head_dim={head_dim} "
                          "(must be even and positive)")
    return dim, factor


def _ropes(cfg: dict, factor: float, where: str) -> tuple[float, float, RopeScaling | None]:
    """(main theta, compress theta, compress scaling) as DeepseekV4Config nests rope_parameters: nested main /
    compress as given, else the flat parameters (rope_scaling) become the compress rope with its attention factor
    forced to 1; the main rope is the default rule."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], rp["compress"]
    else:
        flat = {k: val for k, val in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
        compress = {**flat, "rope_theta": cfg["compress_rope_theta"]}
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    for name, params in (("main", main), ("compress", compress)):
        if params.get("partial_rotary_factor", factor) != factor:
            raise ExportError(f"{where}: rope_parameters.{name}.partial_rotary_factor differs from the model's "
                              f"{factor} (one rotated width per head)")
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise ExportError(f"{where}: rope_parameters.main must be the default rope, got {main!r}")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        return float(main["rope_theta"]), float(compress["rope_theta"]), None
    if kind != "yarn":
        raise ExportError(f"{where}: the compress rope type {kind!r} is not supported (default or yarn)")
    if compress.get("attention_factor") != 1.0 or compress.get("beta_fast") not in (None, 32) \
            or compress.get("beta_slow") not in (None, 1) or compress.get("truncate", True) is not True:
        raise ExportError(f"{where}: the compress yarn rope must keep attention_factor 1, beta_fast 32, beta_slow 1 "
                          f"and truncate, got {compress!r}")
    original = compress.get("original_max_position_embeddings")
    if compress.get("factor") is None or original is None:
        raise ExportError(f"{where}: the compress yarn rope needs factor and original_max_position_embeddings")
    scaling = RopeScaling(type="yarn", factor=float(compress["factor"]), original_max_position_embeddings=int(original))
    return float(main["rope_theta"]), float(compress["rope_theta"]), scaling


def _compressed(cfg: dict, num_layers: int, heads: int, head_dim: int, where: str) -> CompressedAttentionConfig:
    kinds = _layer_kinds(cfg, num_layers, where)
    rope_dim, factor = _rope_dim(cfg, head_dim, where)
    main_theta, compress_theta, scaling = _ropes(cfg, factor, where)
    cfg["rope_theta"] = main_theta
    rates = {**{"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
             **(cfg.get("compress_rates") or {})}
    for legacy, name in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):
        if cfg.get(legacy) is not None:
            rates[name] = cfg[legacy]
    csa, hca = int(rates["compressed_sparse_attention"]), int(rates["heavily_compressed_attention"])
    groups, index_dim = int(cfg["o_groups"]), int(cfg["index_head_dim"])
    window, topk = cfg.get("sliding_window"), int(cfg["index_topk"])
    if min(csa, hca) <= 0 or topk <= 0 or window is None or int(window) <= 0:
        raise ExportError(f"{where}: compress_rates {rates!r}, index_topk={topk} and sliding_window={window} must be "
                          "positive")
    if groups <= 0 or (heads * head_dim) % groups:
        raise ExportError(f"{where}: o_groups={groups} does not divide the {heads * head_dim} attention outputs")
    if "csa" in kinds and index_dim < rope_dim:
        raise ExportError(f"{where}: index_head_dim={index_dim} is narrower than the {rope_dim} rotated dims")
    return CompressedAttentionConfig(
        layer_kinds=kinds, window=int(window), q_lora_rank=int(cfg["q_lora_rank"]), rope_dim=rope_dim,
        o_groups=groups, o_lora_rank=int(cfg["o_lora_rank"]), csa_rate=csa, hca_rate=hca,
        index_num_heads=int(cfg["index_n_heads"]), index_head_dim=index_dim, index_topk=topk,
        compress_rope_theta=compress_theta, compress_rope_scaling=scaling)


def _hash_layers(cfg: dict, num_layers: int, where: str) -> list[int]:
    """mlp_layer_types, else the first num_hash_layers (3) layers hash_moe."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        n = cfg.get("num_hash_layers", _NUM_HASH_LAYERS)
        kinds = ["hash_moe"] * min(num_layers, n) + ["moe"] * max(0, num_layers - n)
    kinds = list(kinds)[:num_layers]
    if len(kinds) != num_layers or set(kinds) - {"hash_moe", "moe"}:
        raise ExportError(f"{where}: mlp_layer_types must be 'hash_moe' or 'moe' per layer, got {kinds!r}")
    return [i for i, kind in enumerate(kinds) if kind == "hash_moe"]


def _moe(cfg: dict, num_layers: int, where: str) -> MoeConfig:
    experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    scoring = cfg["scoring_func"]
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ExportError(f"{where}: scoring_func '{scoring}' is not supported (sqrtsoftplus or sigmoid)")
    if not 0 < top_k <= experts:
        raise ExportError(f"{where}: num_experts_per_tok={top_k} of n_routed_experts={experts}")
    fm = int(cfg["moe_intermediate_size"])
    # NOTE: HF builds one shared expert of moe_intermediate_size whatever n_shared_experts says, and always
    # renormalises the chosen weights (norm_topk_prob is not read)
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=fm, norm_topk_prob=True,
                     shared_expert_intermediate_size=fm, shared_expert_gate=False, scoring=scoring, score_bias=True,
                     routed_scaling_factor=float(cfg["routed_scaling_factor"]),
                     hash_layers=_hash_layers(cfg, num_layers, where))


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """Layer i's parameters: norms, mHC projections, the attention (in_proj, q_b, norms, grouped output, sinks, its
    compressor and indexer), the router, experts_read experts (None: all), the shared expert, a hash table."""
    h, d, c, moe = arch.hidden_size, arch.head_dim, arch.compressed, arch.moe
    s, kind, nh = arch.mhc.num_streams, arch.compressed.layer_kinds[i], arch.num_heads
    n = 2 * h + 2 * ((2 + s) * s * (s * h + 1) + 3)
    width = {"sliding": 0, "hca": d, "csa": 2 * d}[kind]
    index = 4 * c.index_head_dim + c.index_num_heads if kind == "csa" else 0
    n += (c.q_lora_rank + d + 2 * width + index) * h + c.q_lora_rank + nh * d * c.q_lora_rank + d
    n += c.o_groups * c.o_lora_rank * (nh * d // c.o_groups + h) + nh
    if kind != "sliding":
        n += {"hca": c.hca_rate, "csa": c.csa_rate}[kind] * width + d
    if kind == "csa":
        n += c.index_num_heads * c.index_head_dim * c.q_lora_rank + c.csa_rate * 2 * c.index_head_dim
        n += c.index_head_dim
    experts = moe.num_experts if experts_read is None else experts_read
    n += moe.num_experts * h + experts * 3 * h * moe.moe_intermediate_size + 3 * h * moe.moe_intermediate_size
    if i in moe.hash_layers:  # the token table: a decode step reads its token's row
        n += (arch.vocab_size if experts_read is None else 1) * moe.num_experts_per_tok
    else:
        n += moe.num_experts  # the score bias
    return n


def extra_params(arch: Architecture, decode: bool) -> int:
    """Parameters outside the layers beyond the embedding, final norm and lm_head: hc_head's projection, bias and
    scale (read whole at every step)."""
    s = arch.mhc.num_streams
    return s * s * arch.hidden_size + s + 1


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _top_level_renamed(ckpt: Checkpoint) -> Checkpoint:
    """The published layout keeps the embedding as embed.weight at the top level: seen as embed_tokens.weight, so
    Weights finds the prefix "" (transformers saves it as model.embed_tokens.weight)."""
    if "embed.weight" not in ckpt.tensors or "embed_tokens.weight" in ckpt.tensors:
        return ckpt
    tensors = {("embed_tokens.weight" if k == "embed.weight" else k): t for k, t in ckpt.tensors.items()}
    return dataclasses.replace(ckpt, tensors=tensors)


def _add_hc_head(w: Weights, plan: Plan, arch: Architecture, dtype) -> None:
    """hc_head.hc_{fn,base,scale} (model.) or hc_head_{fn,base,scale} (top level) -> hc_head.proj.weight, bias,
    scale."""
    s, h = arch.mhc.num_streams, arch.hidden_size
    released = w.has("hc_head_fn", root=True)
    for part, name, shape in (("fn", "proj.weight", (s, s * h)), ("base", "bias", (s,)), ("scale", "scale", (1,))):
        src = f"hc_head_{part}" if released else f"{w.prefix}hc_head.hc_{part}"
        plan[f"hc_head.{name}"] = load(w.take(src, shape, root=True), dtype)


def _add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """attn.in_proj rows [wq_a, wkv, compressor.wkv, compressor.wgate, indexer.compressor.wkv / wgate,
    indexer.weights_proj], the norms, wq_b, the grouped output, the sinks, the compressors' ape and norms."""
    c, h, d, nh = arch.compressed, arch.hidden_size, arch.head_dim, arch.num_heads
    kind, src, dst = c.layer_kinds[i], f"layers.{i}.attn.", f"attn."
    rows = [w.take(f"{src}wq_a.weight", (c.q_lora_rank, h)), w.take(f"{src}wkv.weight", (d, h))]
    width = {"sliding": 0, "hca": d, "csa": 2 * d}[kind]
    if kind != "sliding":
        rows += [w.take(f"{src}compressor.{p}.weight", (width, h)) for p in ("wkv", "wgate")]
        _add_compressor(w, plan, f"{src}compressor.", layer(i, f"{dst}compressor."), c, kind, d, width, dtype)
    if kind == "csa":
        di, ni = c.index_head_dim, c.index_num_heads
        rows += [w.take(f"{src}indexer.compressor.{p}.weight", (2 * di, h)) for p in ("wkv", "wgate")]
        rows.append(w.take(f"{src}indexer.weights_proj.weight", (ni, h)))
        plan[layer(i, f"{dst}indexer.q_b.weight")] = load(w.take(f"{src}indexer.wq_b.weight",
                                                                 (ni * di, c.q_lora_rank)), dtype)
        _add_compressor(w, plan, f"{src}indexer.compressor.", layer(i, f"{dst}indexer.compressor."), c, kind, di,
                        2 * di, dtype)
    plan[layer(i, f"{dst}in_proj.weight")] = load_fused(rows, dtype)
    shapes = {"q_norm.weight": ("q_a_norm.weight", (c.q_lora_rank,)),
              "wq_b.weight": ("q_b.weight", (nh * d, c.q_lora_rank)), "norm.weight": ("kv_norm.weight", (d,)),
              "wo_a.weight": ("o_a.weight", (c.o_groups * c.o_lora_rank, nh * d // c.o_groups)),
              "wo_b.weight": ("o_b.weight", (h, c.o_groups * c.o_lora_rank)), "attn_sink": ("sinks", (nh,))}
    for name, (target, shape) in shapes.items():
        plan[layer(i, dst + target)] = load(w.take(src + name, shape), dtype)


def _add_compressor(w: Weights, plan: Plan, src: str, dst: str, c: CompressedAttentionConfig, kind: str, dim: int,
                    width: int, dtype) -> None:
    rate = c.csa_rate if kind == "csa" else c.hca_rate
    plan[dst + "position_bias"] = load(w.take(src + "ape", (rate, width)), dtype)
    plan[dst + "norm.weight"] = load(w.take(src + "norm.weight", (dim,)), dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """The router (its score bias, or a hash layer's tid2eid table as int32), the experts stacked (w1 gate rows,
    then w3 up rows; w2 down), the shared expert."""
    moe, h = arch.moe, arch.hidden_size
    e, fm, k = moe.num_experts, moe.moe_intermediate_size, moe.num_experts_per_tok
    src, dst = f"layers.{i}.ffn.", layer(i, "moe.")
    plan[dst + "router.weight"] = load(w.take(f"{src}gate.weight", (e, h)), dtype)
    if i in moe.hash_layers:
        plan[dst + "tid2eid"] = _expert_table(w.take(f"{src}gate.tid2eid", (arch.vocab_size, k)), e, w.identifier)
    else:
        plan[dst + "router.bias"] = load(w.take(f"{src}gate.bias", (e,)), dtype)
    gate_up = [[w.take(f"{src}experts.{j}.{p}.weight", (fm, h)) for p in ("w1", "w3")] for j in range(e)]
    plan[dst + "gate_up.weight"] = _stacked_fused(gate_up, dtype)
    plan[dst + "down.weight"] = _stacked([w.take(f"{src}experts.{j}.w2.weight", (h, fm)) for j in range(e)], dtype)
    shared = [w.take(f"{src}shared_experts.{p}.weight", (fm, h)) for p in ("w1", "w3")]
    plan[dst + "shared.gate_up.weight"] = load_fused(shared, dtype)
    plan[dst + "shared.down.weight"] = load(w.take(f"{src}shared_experts.w2.weight", (h, fm)), dtype)


def _expert_table(t, num_experts: int, where: str):
    """tid2eid as int32 (the core keeps integers as I32), each entry checked to name an expert."""

    def produce() -> torch.Tensor:
        table = t.load()
        if table.numel() and (table.min() < 0 or table.max() >= num_experts):
            raise ExportError(f"{where}: tid2eid names experts outside 0 .. {num_experts - 1}")
        return table.to(torch.int32).contiguous()

    return produce
