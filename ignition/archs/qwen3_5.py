"""qwen3_5 / qwen3_5_moe / qwen3_next: hybrids of gated-delta (GDN) recurrent layers and gated full attention.

model_types: qwen3_5_text, qwen3_5_moe_text, qwen3_next, and the multimodal wrappers qwen3_5 / qwen3_5_moe (their
text_config, tensors under model.language_model.). Every RMSNorm but the GDN's gated one is zero-centred (1+w,
stored shifted); q_proj emits [q_h, gate_h] per head (de-interleaved here); qwen3_next packs the GDN input
projections per key-head group (unpacked here). MoE layers: qwen3_moe's experts plus a sigmoid-gated shared expert.
"""

from __future__ import annotations

import msgspec
import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, MoeConfig, MtpConfig, RecurrentConfig
from ignition.archs import Plan, Producer, Weights, mtp
from ignition.archs.llama import (
    add_dense_mlp,
    add_embedding_and_head,
    add_norm,
    load,
    load_fused,
    parse_rope_scaling,
    read_dims,
    rope_entry,
)
from ignition.archs.qwen3_moe import add_experts
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast, fuse_rows

_FAMILIES = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
_WRAPPERS = ("qwen3_5", "qwen3_5_moe")
_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}

# Defaults of the transformers config classes (Qwen3_5TextConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig) for the
# fields read here that a config may omit. partial_rotary_factor 0.25 is their __post_init__'s default.
_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "head_dim": 256,
    "attention_bias": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
}
_MOE = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
_DEFAULTS = {
    "qwen3_5": {**_COMMON, "num_key_value_heads": 4},
    "qwen3_5_moe": {**_COMMON, **_MOE, "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8},
    "qwen3_next": {**_COMMON, **_MOE, "num_key_value_heads": 2, "num_experts": 512, "num_experts_per_tok": 10,
                   "decoder_sparse_step": 1, "norm_topk_prob": True},
}
_DEFAULT_THETA = 10000.0
_DEFAULT_PARTIAL_ROTARY = 0.25


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    model_type = ckpt.config["model_type"]
    family = _FAMILIES[model_type]
    cfg, prefixes = _text_config(ckpt.config, model_type, where)
    cfg = {**_DEFAULTS[family], **cfg}
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true is not supported")
    if family == "qwen3_5_moe":  # every layer is MoE: no dense MLP; record the shared expert's width
        cfg["intermediate_size"] = cfg["shared_expert_intermediate_size"]
    dims = read_dims(cfg, where)
    if dims["hidden_act"] != "silu":  # the GDN's conv applies hidden_act; its gated norm is always silu
        raise ExportError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported for {family} (only silu)")
    theta, scaling, rotary_dim = _rope(cfg, dims["head_dim"], where)
    types = _layer_types(cfg, dims["num_layers"], where)
    moe = _moe(cfg, family, dims["num_layers"], where)
    arch = Architecture(
        family=family,
        **dims,
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=True,
        layer_types=types,
        moe=moe,
        recurrent=_recurrent(cfg, where),
        attn_output_gate=True,
        rotary_dim=rotary_dim,
        float32_norms=True,  # the zero-centred norms' 1 + w, as HF applies it (llama.add_norm)
    )
    # NOTE: the vision tower (model.visual.*) waits for the vision issue: these cores are text-only. mtp.* (the
    # multi-token-prediction head) is mapped apart, by _add_mtp.
    ignore = ("mtp.",) if family == "qwen3_next" else ("mtp.", "model.visual.")
    w = Weights(ckpt, prefixes, ignore)
    plan: Plan = {}
    add_embedding_and_head(w, plan, arch, dtype, gemma_norm=True)
    for i in range(len(types)):
        _add_layer(w, plan, arch, i, dtype)
    w.check_all_used()
    return _add_mtp(ckpt, cfg, arch, plan, dtype), plan


def _add_layer(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """Layer i: gated attention or a GDN layer (qwen3_next's packed), its two norms, a dense MLP or the experts with
    the shared one."""
    if arch.layer_types[i] == "full":
        add_gated_attention(w, plan, arch, i, dtype)
    elif arch.family == "qwen3_next":
        _add_gdn_packed(w, plan, arch, i, dtype)
    else:
        add_gdn(w, plan, arch, i, dtype)
    for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
        add_norm(w, plan, f"layers.{i}.{src}.weight", layer(i, f"{dst}.weight"), arch, dtype, gemma_norm=True)
    if arch.moe is None or i in arch.moe.dense_layers:
        add_dense_mlp(w, plan, i, arch.hidden_size, arch.intermediate_size, dtype)
    else:
        add_experts(w, plan, arch, i, dtype)
        add_shared_expert(w, plan, arch, i, dtype)


def _add_mtp(ckpt: Checkpoint, cfg: dict, arch: Architecture, plan: Plan, dtype) -> Architecture:
    """The MTP head (top-level mtp.*, as Qwen3-Next / Qwen3.5 publish it): pre_fc_norm_embedding (-> enorm),
    pre_fc_norm_hidden (-> hnorm), fc [H, 2H] (-> eh_proj), norm, and mtp.layers.0, a gated full-attention layer with
    the model's MLP (experts and the shared one in the MoE families) mapped by _add_layer as layer num_layers ->
    mtp.0.*, the norms zero-centred as the model's. More than one layer (mtp_num_hidden_layers, which vLLM cycles
    through per draft step under one shared fc) and dedicated embeddings are refused."""
    if not any(name.startswith("mtp.") for name in ckpt.tensors):
        return arch
    found = mtp.module_indices(ckpt, ("mtp.layers.",), r"^mtp\.layers\.(\d+)\.")
    mtp.check_count(ckpt, cfg, ("mtp_num_hidden_layers", "num_nextn_predict_layers"), len(found))
    if len(found) != 1 or cfg.get("mtp_use_dedicated_embeddings"):
        raise ExportError(f"{ckpt.identifier}: an MTP head of {len(found)} layers (mtp_num_hidden_layers) or with "
                          "mtp_use_dedicated_embeddings is not supported (one layer, the model's embedding)")
    n = arch.num_layers
    draft = msgspec.structs.replace(arch, num_layers=n + 1, layer_types=[*arch.layer_types, "full"])
    view = mtp.ModuleView(ckpt, "mtp.", "layers.0.", n)
    roles = (("enorm.weight", "pre_fc_norm_embedding.weight"), ("hnorm.weight", "pre_fc_norm_hidden.weight"),
             ("norm.weight", "norm.weight"))
    for role, name in roles:
        add_norm(view, plan, name, f"{mtp.MTP_PREFIX}0.{role}", arch, dtype, gemma_norm=True)
    plan[f"{mtp.MTP_PREFIX}0.eh_proj.weight"] = load(view.take("fc.weight", (arch.hidden_size, 2 * arch.hidden_size)),
                                                     dtype)
    layer_plan: Plan = {}
    _add_layer(view.weights, layer_plan, draft, n, dtype)
    mtp.add_module_layer(plan, layer_plan, n, 0)
    view.check_all_used()
    return msgspec.structs.replace(arch, mtp=MtpConfig(num_modules=1, layout="qwen3_next", layer_kinds=["full"],
                                                       moe_modules=[0] if arch.moe is not None else []))


# ---- config reading -----------------------------------------------------------------------------------------


def _text_config(top: dict, model_type: str, where: str) -> tuple[dict, tuple[str, ...]]:
    """The text model's config and the tensor prefixes to look under."""
    if model_type not in _WRAPPERS:
        # transformers loads a text model from a multimodal checkpoint too (its PrefixChange conversion)
        prefixes = ("model.",) if model_type == "qwen3_next" else ("model.", "model.language_model.")
        return top, prefixes
    text = top.get("text_config")
    if not isinstance(text, dict):
        raise ExportError(f"{where}: model_type {model_type} without a text_config")
    # NOTE: the wrapper's own tie_word_embeddings decides (HF ties lm_head by the top-level config)
    return {**text, "tie_word_embeddings": bool(top.get("tie_word_embeddings", False))}, ("model.language_model.",)


def _rope(cfg: dict, head_dim: int, where: str):
    """(theta, scaling, rotary_dim) from rope_parameters (transformers 5) or rope_theta/partial_rotary_factor/
    rope_scaling (4.x). M-RoPE's mrope_section/mrope_interleaved are ignored: with text positions (equal in all
    three sections) the interleaved sections reduce to plain rotary over rotary_dim."""
    entry = rope_entry(cfg)
    if entry is None:
        theta, factor, scaling = (cfg.get("rope_theta", _DEFAULT_THETA),
                                  cfg.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY), cfg.get("rope_scaling"))
    else:
        theta = entry.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA))
        factor = entry.get("partial_rotary_factor", cfg.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY))
        scaling = entry
    rotary_dim = int(head_dim * float(factor))  # as transformers computes it
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ExportError(f"{where}: partial_rotary_factor={factor} gives {rotary_dim} rotary dims of {head_dim}: "
                          "not an even count within the head")
    scaling = parse_rope_scaling(scaling, int(cfg["max_position_embeddings"]), where)
    return float(theta), scaling, (None if rotary_dim == head_dim else rotary_dim)


def _layer_types(cfg: dict, num_layers: int, where: str) -> list:
    types = cfg.get("layer_types")
    if not types:  # as the config classes derive it: every interval-th layer full, the rest linear
        interval = int(cfg["full_attention_interval"])
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    for t in types:
        if t not in _LAYER_TYPES:
            raise ExportError(f"{where}: layer type '{t}' is not supported (supported: {', '.join(_LAYER_TYPES)})")
    return [_LAYER_TYPES[t] for t in types]


def _recurrent(cfg: dict, where: str) -> RecurrentConfig:
    heads, key_heads = int(cfg["linear_num_value_heads"]), int(cfg["linear_num_key_heads"])
    if key_heads <= 0 or heads % key_heads:
        raise ExportError(f"{where}: linear_num_value_heads={heads} is not a multiple of "
                          f"linear_num_key_heads={key_heads}")
    return RecurrentConfig(
        kind="gated_delta",
        num_heads=heads,
        num_key_heads=key_heads,
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]),
    )


def _moe(cfg: dict, family: str, num_layers: int, where: str) -> MoeConfig | None:
    if family == "qwen3_5":
        return None
    num_experts = int(cfg["num_experts"])
    if family == "qwen3_next":
        if num_experts == 0:  # Qwen3NextDecoderLayer then builds a dense MLP everywhere
            return None
        step, only_dense = int(cfg["decoder_sparse_step"]), set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(num_layers) if i in only_dense or (i + 1) % step != 0]
        norm_topk = bool(cfg["norm_topk_prob"])
    else:  # Qwen3_5MoeTopKRouter renormalises the top-k unconditionally; every layer is MoE
        dense, norm_topk = [], True
    shared = int(cfg["shared_expert_intermediate_size"])
    if shared <= 0:
        raise ExportError(f"{where}: shared_expert_intermediate_size={shared} is not supported (must be > 0)")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=norm_topk,
        dense_layers=dense,
        shared_expert_intermediate_size=shared,
    )


# ---- tensor plans ---------------------------------------------------------------------------------------------


def add_gated_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """attn.qkv rows [q heads, k heads, v heads, gate heads], zero-centred q/k norms (shifted), attn.o."""
    h, d, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    src = f"layers.{i}.self_attn."
    q_gate = w.take(f"{src}q_proj.weight", (2 * nq * d, h))
    k = w.take(f"{src}k_proj.weight", (nkv * d, h))
    v = w.take(f"{src}v_proj.weight", (nkv * d, h))
    plan[layer(i, "attn.qkv.weight")] = _gated_qkv(q_gate, k, v, nq, d, dtype)
    for p in ("q", "k"):
        add_norm(w, plan, f"{src}{p}_norm.weight", layer(i, f"attn.{p}_norm.weight"), arch, dtype, True, d)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, nq * d)), dtype)


def _gated_qkv(q_gate: LazyTensor, k: LazyTensor, v: LazyTensor, nq: int, d: int, dtype) -> Producer:
    def produce() -> torch.Tensor:
        q, gate = split_query_gate(q_gate.load(), nq, d)
        return cast(fuse_rows(q, k.load(), v.load(), gate), dtype)

    return produce


def split_query_gate(q_gate: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's gated q_proj [Nq*2D, H] (per head: D query rows, then D gate rows) -> (q [Nq*D, H], gate [Nq*D, H])."""
    per_head = q_gate.reshape(num_heads, 2, head_dim, q_gate.shape[-1])
    return per_head[:, 0].reshape(-1, q_gate.shape[-1]), per_head[:, 1].reshape(-1, q_gate.shape[-1])


def _gdn_dims(arch: Architecture) -> tuple[int, int, int]:
    r = arch.recurrent
    return r.num_key_heads * r.key_head_dim, r.num_heads * r.value_head_dim, r.num_heads


def add_gdn(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """qwen3_5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a are already the layout's row blocks."""
    h, (key, value, hv) = arch.hidden_size, _gdn_dims(arch)
    src = f"layers.{i}.linear_attn."
    rows = {"qkv": 2 * key + value, "z": value, "b": hv, "a": hv}
    parts = [w.take(f"{src}in_proj_{p}.weight", (n, h)) for p, n in rows.items()]
    plan[layer(i, "linear.in_proj.weight")] = load_fused(parts, dtype)
    _add_gdn_rest(w, plan, arch, i, dtype)


def _add_gdn_packed(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """qwen3_next: in_proj_qkvz / in_proj_ba, grouped per key head, unpacked into the layout's row blocks."""
    h, (key, value, hv) = arch.hidden_size, _gdn_dims(arch)
    src = f"layers.{i}.linear_attn."
    qkvz = w.take(f"{src}in_proj_qkvz.weight", (2 * key + 2 * value, h))
    ba = w.take(f"{src}in_proj_ba.weight", (2 * hv, h))
    r = arch.recurrent

    def produce() -> torch.Tensor:
        parts = unpack_qkvz_ba(qkvz.load(), ba.load(), r.num_key_heads, r.num_heads, r.key_head_dim, r.value_head_dim)
        return cast(fuse_rows(*parts), dtype)

    plan[layer(i, "linear.in_proj.weight")] = produce
    _add_gdn_rest(w, plan, arch, i, dtype)


def unpack_qkvz_ba(qkvz: torch.Tensor, ba: torch.Tensor, key_heads: int, heads: int, dk: int, dv: int):
    """Undo Qwen3NextGatedDeltaNet.fix_query_key_value_ordering on the weights: rows of key-head group g are
    [q_g (dk), k_g (dk), v_g (r*dv), z_g (r*dv)] and [b_g (r), a_g (r)] with r = heads // key_heads value heads
    per group (value head g*r + j). Returns the row blocks (q, k, v, z, b, a), each head-major."""
    r, hidden = heads // key_heads, qkvz.shape[-1]
    grouped = qkvz.reshape(key_heads, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    gates = ba.reshape(key_heads, 2 * r, hidden).split([r, r], dim=1)
    return [t.reshape(-1, hidden) for t in (*grouped, *gates)]


def _add_gdn_rest(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """linear.conv [C, K], dt_bias, A_log, the gated norm (plain w: not zero-centred) and linear.out."""
    h, (_, value, hv), r = arch.hidden_size, _gdn_dims(arch), arch.recurrent
    src = f"layers.{i}.linear_attn."
    conv = w.take(f"{src}conv1d.weight", (r.conv_dim, 1, r.conv_kernel))
    plan[layer(i, "linear.conv.weight")] = lambda: cast(conv.load().reshape(r.conv_dim, r.conv_kernel), dtype)
    plan[layer(i, "linear.dt_bias")] = load(w.take(f"{src}dt_bias", (hv,)), dtype)
    plan[layer(i, "linear.A_log")] = load(w.take(f"{src}A_log", (hv,)), dtype)
    add_norm(w, plan, f"{src}norm.weight", layer(i, "linear.norm.weight"), arch, dtype, False, r.value_head_dim)
    plan[layer(i, "linear.out.weight")] = load(w.take(f"{src}out_proj.weight", (h, value)), dtype)


def add_shared_expert(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """moe.shared.gate_up [2*Fs, H] (gate rows, then up), moe.shared.down [H, Fs], moe.shared_gate [1, H]."""
    h, fs = arch.hidden_size, arch.moe.shared_expert_intermediate_size
    src = f"layers.{i}.mlp.shared_expert"
    gate_up = [w.take(f"{src}.{p}_proj.weight", (fs, h)) for p in ("gate", "up")]
    plan[layer(i, "moe.shared.gate_up.weight")] = load_fused(gate_up, dtype)
    plan[layer(i, "moe.shared.down.weight")] = load(w.take(f"{src}.down_proj.weight", (h, fs)), dtype)
    plan[layer(i, "moe.shared_gate.weight")] = load(w.take(f"{src}_gate.weight", (1, h)), dtype)
