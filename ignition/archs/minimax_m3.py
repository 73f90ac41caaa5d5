"""minimax_m3 (MiniMax-M3), text only: GQA layers with per-head q/k norms and partial rotary, the sparse ones
("minimax_m3_sparse") with the lightning indexer's block selection, SwiGLU-OAI dense MLPs or sigmoid-routed experts
(score bias, renormalised, routed_scaling_factor) with a shared expert; every norm zero-centred (stored 1 + w).

model_type minimax_m3_vl (MiniMaxM3SparseForConditionalGeneration: its text_config) or minimax_m3_vl_text
(MiniMaxM3VLForCausalLM). Either tensor naming: the released one (what transformers saves for the wrapper:
language_model.model.*, language_model.lm_head, block_sparse_moe.{gate, e_score_correction_bias, experts.N.w1/w2/w3,
shared_experts.*}, self_attn.index_*, mlp.gate_proj/up_proj) or the one transformers holds in memory (model.* or
model.language_model.*, mlp.{gate, experts.gate_up_proj, shared_experts.gate_up_proj}, self_attn.indexer.*).
NOTE: the vision tower, its projectors and the MTP weights (mtp.*) are ignored: images and the DSpark draft head
are later issues.
"""

from __future__ import annotations

import re

from helios.core.layout import layer
from helios.core.manifest import Architecture, MoeConfig, MsaConfig
from ignition.archs import Plan, Weights
from ignition.archs.llama import add_norm, config_value, load, load_fused, parse_rope_scaling, rope_entry
from ignition.archs.qwen3_moe import _stacked, _stacked_fused
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint

# MiniMaxM3VLTextConfig's defaults for the fields read here that a config may omit
_DEFAULTS = {
    "vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072, "num_hidden_layers": 60,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 524288,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_experts_per_tok": 4, "num_local_experts": 128,
    "dense_intermediate_size": 12288, "shared_intermediate_size": 3072, "routed_scaling_factor": 2.0,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128,
    "index_topk_blocks": 16, "index_local_blocks": 1,
}
_DEFAULT_THETA = 5000000.0
_ALIASES = {"num_experts": "num_local_experts"}  # MiniMaxM3VLTextConfig.attribute_map
# sparse_attention_config's keys, which MiniMaxM3VLTextConfig.__post_init__ lets override the flat ones
_LEGACY_INDEX = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                 "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                 "index_local_blocks": "sparse_local_block"}
_LAYER_TYPES = ("full_attention", "minimax_m3_sparse")
_IGNORED = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
            "model.multi_modal_projector.")


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg = _text_config(ckpt.config, where)
    num_layers, head_dim = int(cfg["num_hidden_layers"]), int(cfg["head_dim"])
    theta, scaling, rotary_dim = _rope(cfg, head_dim, where)
    sparse = _sparse_layers(cfg, num_layers, where)
    dense = _dense_layers(cfg, num_layers, where)
    arch = Architecture(
        family="minimax_m3",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["dense_intermediate_size"]),  # the dense MLPs' (the experts': moe_intermediate_size)
        num_layers=num_layers,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        qk_norm=True,
        rope_scaling=scaling,
        moe=_moe(cfg, dense, where) if len(dense) < num_layers else None,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        msa=_msa(cfg, sparse, rotary_dim, where) if sparse else None,
        swiglu_limit=_positive(cfg, "swiglu_limit", where),
        swiglu_alpha=_positive(cfg, "swiglu_alpha", where),
        float32_norms=True,  # every norm's 1 + w stays float32, as HF applies it (llama.add_norm)
    )
    w = Weights(ckpt, ("language_model.model.", "model.language_model.", "model."), _ignored(ckpt))
    plan: Plan = {}
    _add_embedding_and_head(w, plan, arch, dtype)
    for i in range(num_layers):
        _add_attention(w, plan, arch, i, dtype)
        for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
            add_norm(w, plan, f"layers.{i}.{src}.weight", layer(i, f"{dst}.weight"), arch, dtype, gemma_norm=True)
        if arch.moe is None or i in arch.moe.dense_layers:
            _add_gated_mlp(w, plan, f"layers.{i}.mlp.", layer(i, "mlp"), arch.hidden_size, arch.intermediate_size,
                           dtype)
        else:
            _add_moe(w, plan, arch, i, dtype)
    w.check_all_used()
    return arch, plan


# ---- config reading -----------------------------------------------------------------------------------------


def _text_config(top: dict, where: str) -> dict:
    """The text model's config with MiniMaxM3VLTextConfig's defaults, aliases and sparse_attention_config applied.
    NOTE: hidden_act is not read: the config class sets it to silu whatever the checkpoint declares ("swigluoai"),
    and the experts compute SwiGLU-OAI from swiglu_alpha / swiglu_limit."""
    if top["model_type"] == "minimax_m3_vl":
        text = top.get("text_config")
        if not isinstance(text, dict):
            raise ExportError(f"{where}: model_type minimax_m3_vl without a text_config table")
        # the wrapper's own tie_word_embeddings decides (HF ties lm_head by the top-level config)
        raw = {**text, "tie_word_embeddings": bool(top.get("tie_word_embeddings") or text.get("tie_word_embeddings"))}
    else:
        raw = dict(top)
    # NOTE: null is a value for the SwiGLU-OAI fields (then refused), a missing key for the rest
    cfg = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k in ("swiglu_limit", "swiglu_alpha")}}
    for alias, name in _ALIASES.items():
        if alias in raw and name not in raw:
            cfg[name] = raw[alias]
    legacy = raw.get("sparse_attention_config") or {}
    for flat, key in _LEGACY_INDEX.items():
        if key in legacy:
            cfg[flat] = legacy[key]
    cfg["_sparse_freq"] = legacy.get("sparse_attention_freq")
    return cfg


def _rope(cfg: dict, head_dim: int, where: str):
    """(theta, scaling, rotary dims) as MiniMaxM3VLRotaryEmbedding computes them: int(head_dim * the rope
    parameters' partial_rotary_factor) dims turn. NOTE: transformers ignores the config's rotary_dim; one that
    disagrees with partial_rotary_factor leaves the checkpoint's intent open, so it is refused."""
    entry = rope_entry(cfg)
    if entry is None:
        theta, factor, scaling = (cfg.get("rope_theta", _DEFAULT_THETA), cfg.get("partial_rotary_factor", 1.0),
                                  cfg.get("rope_scaling"))
    else:
        theta = entry.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA))
        factor = entry.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        scaling = entry
    rotary_dim = int(head_dim * float(factor))
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ExportError(f"{where}: partial_rotary_factor={factor} gives {rotary_dim} rotary dims of {head_dim}: "
                          "not an even count within the head")
    if cfg.get("rotary_dim") is not None and int(cfg["rotary_dim"]) != rotary_dim:
        raise ExportError(f"{where}: rotary_dim={cfg['rotary_dim']} disagrees with partial_rotary_factor={factor} "
                          f"(head_dim {head_dim}: transformers turns {rotary_dim} dims and ignores rotary_dim)")
    scaling = parse_rope_scaling(scaling, int(cfg["max_position_embeddings"]), where)
    if scaling is not None and scaling.type == "dynamic":
        raise ExportError(f"{where}: dynamic rope scaling is not supported (it depends on the batch's lengths)")
    return float(theta), scaling, rotary_dim


def _sparse_layers(cfg: dict, num_layers: int, where: str) -> list[int]:
    """layer_types, else sparse_attention_config.sparse_attention_freq (1: sparse), else every layer full."""
    types = cfg.get("layer_types")
    if types is None and cfg["_sparse_freq"] is not None:
        types = ["minimax_m3_sparse" if f else "full_attention" for f in cfg["_sparse_freq"]]
    types = types or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    for i, t in enumerate(types):
        if t not in _LAYER_TYPES:
            raise ExportError(f"{where}: layer {i} has type {t!r} (supported: {', '.join(_LAYER_TYPES)})")
    return [i for i, t in enumerate(types) if t == "minimax_m3_sparse"]


def _dense_layers(cfg: dict, num_layers: int, where: str) -> list[int]:
    """mlp_layer_types, else moe_layer_freq (1: experts), else experts in every layer."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None and cfg.get("moe_layer_freq") is not None:
        kinds = ["sparse" if f else "dense" for f in cfg["moe_layer_freq"]]
    kinds = kinds or ["sparse"] * num_layers
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ExportError(f"{where}: mlp_layer_types must be 'dense' or 'sparse' per layer, got {kinds!r}")
    return [i for i, kind in enumerate(kinds) if kind == "dense"]


def _msa(cfg: dict, sparse: list[int], rotary_dim: int, where: str) -> MsaConfig:
    heads, head_dim, block, topk, local = (int(cfg[k]) for k in _LEGACY_INDEX)
    if min(heads, head_dim, block, topk) <= 0 or not 0 <= local <= topk:
        raise ExportError(f"{where}: index_n_heads={heads}, index_head_dim={head_dim}, index_block_size={block}, "
                          f"index_topk_blocks={topk} must be positive and index_local_blocks={local} within 0.."
                          f"{topk} (the local blocks are among the kept ones)")
    if int(cfg["num_attention_heads"]) % heads:
        raise ExportError(f"{where}: num_attention_heads={cfg['num_attention_heads']} is not a multiple of "
                          f"index_n_heads={heads} (each index head selects for a group of query heads)")
    if head_dim < rotary_dim:  # HF would slice its rotary tables to index_head_dim, turning a different angle
        raise ExportError(f"{where}: index_head_dim={head_dim} is narrower than the {rotary_dim} rotary dims")
    return MsaConfig(num_heads=heads, head_dim=head_dim, block_size=block, num_blocks=topk, local_blocks=local,
                     layers=sparse)


def _moe(cfg: dict, dense: list[int], where: str) -> MoeConfig:
    experts, top_k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ExportError(f"{where}: num_experts_per_tok={top_k} of num_local_experts={experts}")
    shared = int(cfg["shared_intermediate_size"])
    if shared <= 0:  # MiniMaxM3VLSparseMoeBlock always builds its shared expert
        raise ExportError(f"{where}: shared_intermediate_size={shared} is not supported (must be > 0)")
    return MoeConfig(num_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=int(config_value(cfg, "intermediate_size", where)), norm_topk_prob=True,
                     dense_layers=dense, shared_expert_intermediate_size=shared, shared_expert_gate=False,
                     scoring="sigmoid", score_bias=True, routed_scaling_factor=float(cfg["routed_scaling_factor"]))


def _positive(cfg: dict, key: str, where: str) -> float:
    value = cfg.get(key)
    if value is None or float(value) <= 0:  # HF's clamp(-limit, limit) and the OAI gain need a positive number
        raise ExportError(f"{where}: {key}={value} is not supported (a positive number)")
    return float(value)


def _ignored(ckpt: Checkpoint) -> tuple[str, ...]:
    """The vision tower and its projectors, and every MTP tensor (HF skips names with an mtp. component)."""
    mtp = {m.group(0) for name in ckpt.tensors if (m := re.match(r"(.*\.)?mtp\.", name))}
    return (*_IGNORED, *sorted(mtp))


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """Layer i: its norms, attention (qkv, o, q/k norms), the indexer of a sparse layer, the feed-forward (the
    router with its score bias, experts_read experts (None: all) and the shared expert in an MoE layer)."""
    h, d, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    n = 2 * h + (nq + 2 * nkv) * d * h + h * nq * d + 2 * d
    if arch.msa is not None and i in arch.msa.layers:
        m = arch.msa
        n += (m.num_heads + 1) * m.head_dim * h + 2 * m.head_dim
    moe = arch.moe
    if moe is None or i in moe.dense_layers:
        return n + 3 * h * arch.intermediate_size
    experts = moe.num_experts if experts_read is None else experts_read
    n += moe.num_experts * (h + 1) + experts * 3 * h * moe.moe_intermediate_size
    return n + 3 * h * moe.shared_expert_intermediate_size


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _add_embedding_and_head(w: Weights, plan: Plan, arch: Architecture, dtype) -> None:
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embed_tokens.weight", (v, h)), dtype)
    add_norm(w, plan, "norm.weight", "norm.weight", arch, dtype, gemma_norm=True)
    head = "language_model.lm_head.weight" if w.prefix == "language_model.model." else "lm_head.weight"
    if arch.tie_word_embeddings:
        w.skip(head, root=True)  # HF ties it anyway: a stored copy is never read
    else:
        plan["lm_head.weight"] = load(w.take(head, (v, h), root=True), dtype)


def _add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """attn.qkv (rows q, k, v), the per-head q/k norms, attn.o; in a sparse layer attn.indexer.qk (rows the index
    query heads, then the index key) and its q/k norms (indexer.* in memory, index_* released)."""
    h, d, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    src = f"layers.{i}.self_attn."
    rows = {"q": nq * d, "k": nkv * d, "v": nkv * d}
    plan[layer(i, "attn.qkv.weight")] = load_fused([w.take(f"{src}{p}_proj.weight", (n, h)) for p, n in rows.items()],
                                                   dtype)
    for p in ("q", "k"):
        add_norm(w, plan, f"{src}{p}_norm.weight", layer(i, f"attn.{p}_norm.weight"), arch, dtype, True, d)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, nq * d)), dtype)
    if arch.msa is None or i not in arch.msa.layers:
        return
    m = arch.msa
    idx = f"{src}indexer." if w.has(f"{src}indexer.q_proj.weight") else f"{src}index_"
    qk = [w.take(f"{idx}q_proj.weight", (m.num_heads * m.head_dim, h)), w.take(f"{idx}k_proj.weight", (m.head_dim, h))]
    plan[layer(i, "attn.indexer.qk.weight")] = load_fused(qk, dtype)
    for p in ("q", "k"):
        add_norm(w, plan, f"{idx}{p}_norm.weight", layer(i, f"attn.indexer.{p}_norm.weight"), arch, dtype, True,
                 m.head_dim)


def _add_gated_mlp(w: Weights, plan: Plan, src: str, dst: str, hidden: int, width: int, dtype) -> None:
    """dst.gate_up [2F, H] (gate rows, then up) and dst.down [H, F] from src's gate_up_proj (in memory) or
    gate_proj / up_proj (released)."""
    if w.has(f"{src}gate_up_proj.weight"):
        plan[f"{dst}.gate_up.weight"] = load(w.take(f"{src}gate_up_proj.weight", (2 * width, hidden)), dtype)
    else:
        parts = [w.take(f"{src}{p}_proj.weight", (width, hidden)) for p in ("gate", "up")]
        plan[f"{dst}.gate_up.weight"] = load_fused(parts, dtype)
    plan[f"{dst}.down.weight"] = load(w.take(f"{src}down_proj.weight", (hidden, width)), dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """moe.router (+ its score bias), the experts stacked (gate rows, then up), the shared expert."""
    moe, h = arch.moe, arch.hidden_size
    e, fm = moe.num_experts, moe.moe_intermediate_size
    released = w.has(f"layers.{i}.block_sparse_moe.gate.weight")
    src = f"layers.{i}.block_sparse_moe." if released else f"layers.{i}.mlp."
    plan[layer(i, "moe.router.weight")] = load(w.take(f"{src}gate.weight", (e, h)), dtype)
    bias = f"{src}e_score_correction_bias" if released else f"{src}gate.e_score_correction_bias"
    plan[layer(i, "moe.router.bias")] = load(w.take(bias, (e,)), dtype)
    if released:  # w1 gate, w3 up, w2 down per expert
        gate_up = [[w.take(f"{src}experts.{j}.{p}.weight", (fm, h)) for p in ("w1", "w3")] for j in range(e)]
        plan[layer(i, "moe.gate_up.weight")] = _stacked_fused(gate_up, dtype)
        down = [w.take(f"{src}experts.{j}.w2.weight", (h, fm)) for j in range(e)]
        plan[layer(i, "moe.down.weight")] = _stacked(down, dtype)
    else:
        plan[layer(i, "moe.gate_up.weight")] = load(w.take(f"{src}experts.gate_up_proj", (e, 2 * fm, h)), dtype)
        plan[layer(i, "moe.down.weight")] = load(w.take(f"{src}experts.down_proj", (e, h, fm)), dtype)
    _add_gated_mlp(w, plan, f"{src}shared_experts.", layer(i, "moe.shared"), h, moe.shared_expert_intermediate_size,
                   dtype)
