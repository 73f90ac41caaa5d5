"""kimi_linear: hybrids of Kimi delta attention (KDA, linear) and multi-head latent attention without rotary (MLA,
full), each followed by a SwiGLU MLP or DeepSeek-style sigmoid-routed experts with shared experts.

model_type kimi_linear (KimiLinearConfig), tensors under model. in either naming: the released checkpoints' (q/k/v
short convs apart, the forget gate's tensors on self_attn, block_sparse_moe.* with experts.N.w1/w2/w3) or the one
transformers holds in memory (one conv1d, self_attn.forget_gate.*, mlp.* with stacked experts). Config names are
the checkpoint's (num_experts, num_experts_per_token, moe_renormalize, num_expert_group, num_shared_experts,
model_max_length) or KimiLinearConfig's aliases of them; layer types from layer_types, else linear_attn_config's
1-indexed kda_layers / full_attn_layers; dense MLPs from mlp_layer_types, else the first first_k_dense_replace.
"""

from __future__ import annotations

import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, MlaConfig, MoeConfig, RecurrentConfig
from ignition.archs import Plan, Producer, Weights
from ignition.archs.llama import load, load_fused
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast, fuse_rows, stack_experts

# KimiLinearConfig's defaults for the fields read here (canonical names: its attribute_map's targets)
_DEFAULTS = {
    "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_attention_heads": 32,
    "num_key_value_heads": None, "num_shared_experts": 1, "routed_scaling_factor": 2.446, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "num_expert_group": 1,
    "topk_group": 1, "num_experts_per_token": 8, "moe_renormalize": True, "hidden_act": "silu",
    "model_max_length": 1048576, "rms_norm_eps": 1e-5, "attention_bias": False, "num_experts": 256,
    "linear_head_dim": 128, "linear_num_heads": 32, "linear_conv_kernel_dim": 4,
}
# KimiLinearConfig.attribute_map: alias -> the name the checkpoint's config uses
_ALIASES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
            "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group",
            "n_shared_experts": "num_shared_experts", "max_position_embeddings": "model_max_length"}
# linear_attn_config (the released checkpoints' sub-dict) -> the flat names it overrides, as __post_init__ reads it
_LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                "short_conv_kernel_size": "linear_conv_kernel_dim"}
_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
_KDA_CHUNK = 64  # chunk_kimi_delta_attention's chunk


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg = _config(ckpt.config)
    _check_supported(cfg, where)
    num_layers = int(_required(cfg, "num_hidden_layers", where))
    types = _layer_types(cfg, num_layers, where)
    dense = _dense_layers(cfg, num_layers, where)
    heads = int(cfg["num_attention_heads"])
    mla = _mla(cfg, where)
    arch = Architecture(
        family="kimi_linear",
        vocab_size=int(_required(cfg, "vocab_size", where)),
        hidden_size=int(_required(cfg, "hidden_size", where)),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads,  # the expanded form's; the KV pages hold latents (arch.mla)
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=0.0,  # no rotary anywhere (position_embedding "none")
        max_position_embeddings=int(cfg["model_max_length"]),
        # NOTE: KimiLinearForCausalLM ties nothing (_tied_weights_keys = {}): its lm_head is always its own tensor
        tie_word_embeddings=False,
        layer_types=types,
        moe=_moe(cfg, dense, where) if len(dense) < num_layers else None,
        recurrent=_recurrent(cfg) if "linear" in types else None,
        position_embedding="none",
        mla=mla,
    )
    w = Weights(ckpt, ("model.",))
    plan: Plan = {}
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embed_tokens.weight", (v, h)), dtype)
    plan["norm.weight"] = load(w.take("norm.weight", (h,)), dtype)
    plan["lm_head.weight"] = load(w.take("lm_head.weight", (v, h), root=True), dtype)
    for i, kind in enumerate(types):
        for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
            plan[layer(i, f"{dst}.weight")] = load(w.take(f"layers.{i}.{src}.weight", (h,)), dtype)
        (_add_kda if kind == "linear" else _add_mla)(w, plan, arch, i, dtype)
        if arch.moe is None or i in arch.moe.dense_layers:
            _add_dense_mlp(w, plan, arch, i, dtype)
        else:
            _add_moe(w, plan, arch, i, dtype)
    w.check_all_used()
    return arch, plan


# ---- config reading -----------------------------------------------------------------------------------------


def _config(raw: dict) -> dict:
    """The config with KimiLinearConfig's defaults, its aliases resolved and linear_attn_config applied."""
    cfg = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k == "q_lora_rank"}}
    for alias, name in _ALIASES.items():
        if alias in raw and name not in raw:
            cfg[name] = raw[alias]
    linear = raw.get("linear_attn_config") or {}
    for key, name in _LINEAR_KEYS.items():
        if key in linear:
            cfg[name] = linear[key]
    cfg["linear_attn_config"] = linear
    return cfg


def _required(cfg: dict, key: str, where: str):
    if cfg.get(key) is None:
        raise ExportError(f"{where}: config.json lacks '{key}'")
    return cfg[key]


def _check_supported(cfg: dict, where: str) -> None:
    """Config features the runtime does not implement."""
    if cfg["hidden_act"] not in ("silu", "swish"):  # the SwiGLU MLPs' and the KDA convs' activation
        raise ExportError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported (only silu)")
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true is not supported")
    kv_heads = cfg["num_key_value_heads"]
    if kv_heads is not None and int(kv_heads) != int(cfg["num_attention_heads"]):
        # kv_b_proj makes one K/V head per query head: HF's repeat_kv would only break the shapes
        raise ExportError(f"{where}: num_key_value_heads={kv_heads} differs from "
                          f"num_attention_heads={cfg['num_attention_heads']} (MLA has one K/V head per query head)")
    scoring = cfg.get("moe_router_activation_func", "sigmoid")
    if scoring != "sigmoid":  # KimiLinearTopkRouter always scores with a sigmoid
        raise ExportError(f"{where}: moe_router_activation_func '{scoring}' is not supported (only sigmoid)")


def _layer_types(cfg: dict, num_layers: int, where: str) -> list:
    """As KimiLinearConfig.__post_init__: layer_types, else linear_attn_config's 1-indexed layer lists, else every
    4th layer (from layer 4) full."""
    types = cfg.get("layer_types")
    linear = cfg["linear_attn_config"]
    if not types and "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * num_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for index in linear[key]:
                if not 1 <= int(index) <= num_layers:
                    raise ExportError(f"{where}: linear_attn_config.{key} names layer {index} (layers are 1.."
                                      f"{num_layers})")
                types[int(index) - 1] = kind
    if not types:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    for i, t in enumerate(types):
        if t not in _LAYER_TYPES:
            raise ExportError(f"{where}: layer {i} has type {t!r} (supported: {', '.join(_LAYER_TYPES)})")
    return [_LAYER_TYPES[t] for t in types]


def _dense_layers(cfg: dict, num_layers: int, where: str) -> list[int]:
    kinds = cfg.get("mlp_layer_types")
    if not kinds:
        first = int(cfg.get("first_k_dense_replace", 1))
        kinds = ["dense" if i < first else "sparse" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ExportError(f"{where}: mlp_layer_types must be 'dense' or 'sparse' per layer, got {kinds!r}")
    return [i for i, kind in enumerate(kinds) if kind == "dense"]


def _mla(cfg: dict, where: str) -> MlaConfig:
    dims = {k: cfg[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    if any(v is None for v in dims.values()):
        raise ExportError(f"{where}: MLA dimensions must be set, got {dims}")
    dims = {k: int(v) for k, v in dims.items()}
    q_lora = cfg["q_lora_rank"]
    return MlaConfig(**dims, q_lora_rank=int(q_lora) if q_lora else None,
                     softmax_scale=(dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5)


def _recurrent(cfg: dict) -> RecurrentConfig:
    heads, head_dim = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
    return RecurrentConfig(kind="kimi_delta", num_heads=heads, num_key_heads=heads, key_head_dim=head_dim,
                           value_head_dim=head_dim, conv_kernel=int(cfg["linear_conv_kernel_dim"]),
                           chunk_size=_KDA_CHUNK)


def _moe(cfg: dict, dense: list[int], where: str) -> MoeConfig:
    experts, groups, top_groups = int(cfg["num_experts"]), int(cfg["num_expert_group"]), int(cfg["topk_group"])
    top_k, shared = int(cfg["num_experts_per_token"]), int(cfg["num_shared_experts"])
    # the router ranks a group by its two best scores and picks top_k among the chosen groups' experts
    if groups <= 0 or experts % groups or experts // groups < 2:
        raise ExportError(f"{where}: num_experts={experts} does not split into num_expert_group={groups} groups "
                          "of >= 2")
    if not 0 < top_groups <= groups or top_k > top_groups * (experts // groups):
        raise ExportError(f"{where}: topk_group={top_groups} of num_expert_group={groups} cannot hold "
                          f"num_experts_per_token={top_k} experts")
    if shared <= 0:  # KimiLinearMoE always builds its shared experts
        raise ExportError(f"{where}: num_shared_experts={shared} is not supported (must be > 0)")
    fm = int(cfg["moe_intermediate_size"])
    return MoeConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fm,
        norm_topk_prob=bool(cfg["moe_renormalize"]),
        dense_layers=dense,
        shared_expert_intermediate_size=fm * shared,  # the shared experts are one MLP of their summed width
        shared_expert_gate=False,
        scoring="sigmoid",
        score_bias=True,
        num_groups=groups,
        num_topk_groups=top_groups,
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
    )


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """Parameters of layer i (ignition.archs.num_params / decode_weight_bytes): two norms, its mixer (KDA or MLA) and
    its feed-forward; an MoE layer counts `experts_read` routed experts (None: all) beside its router (+ score bias)
    and shared experts."""
    h, moe = arch.hidden_size, arch.moe
    n = 2 * h
    if arch.layer_types[i] == "linear":
        r = arch.recurrent
        d, inner = r.key_head_dim, r.num_heads * r.key_head_dim
        n += (r.conv_dim + 2 * d + r.num_heads) * h + r.conv_dim * r.conv_kernel  # in_proj, conv
        n += 2 * inner * d + inner + r.num_heads + d + h * inner  # f_b, g_b, dt_bias, A_log, norm, out
    else:
        m, nq = arch.mla, arch.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_in = m.q_lora_rank or nq * qk
        n += (q_in + m.kv_lora_rank + m.qk_rope_head_dim) * h + m.kv_lora_rank
        n += m.q_lora_rank + nq * qk * m.q_lora_rank if m.q_lora_rank else 0
        n += nq * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank + h * nq * m.v_head_dim
    if moe is None or i in moe.dense_layers:
        return n + 3 * h * arch.intermediate_size
    experts = moe.num_experts if experts_read is None else experts_read
    n += moe.num_experts * (h + 1) + experts * 3 * h * moe.moe_intermediate_size
    return n + 3 * h * moe.shared_expert_intermediate_size


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _add_kda(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """kda.in_proj rows [q, k, v, f_a, g_a, b]; the q, k, v short convs side by side as kda.conv [C, K]."""
    r, h = arch.recurrent, arch.hidden_size
    d, heads, k = r.key_head_dim, r.num_heads, r.conv_kernel
    inner = heads * d
    src = f"layers.{i}.self_attn."
    gate = src + "forget_gate." if w.has(src + "forget_gate.f_a_proj.weight") else src
    rows = [(f"{src}q_proj", inner), (f"{src}k_proj", inner), (f"{src}v_proj", inner), (f"{gate}f_a_proj", d),
            (f"{src}g_a_proj", d), (f"{src}b_proj", heads)]
    plan[layer(i, "kda.in_proj.weight")] = load_fused([w.take(f"{n}.weight", (m, h)) for n, m in rows], dtype)
    if w.has(f"{src}conv1d.weight"):
        convs = [w.take(f"{src}conv1d.weight", (3 * inner, 1, k))]
    else:
        convs = [w.take(f"{src}{p}_conv1d.weight", (inner, 1, k)) for p in ("q", "k", "v")]
    plan[layer(i, "kda.conv.weight")] = lambda: cast(torch.cat([c.load() for c in convs]).reshape(3 * inner, k), dtype)
    plan[layer(i, "kda.f_b.weight")] = load(w.take(f"{gate}f_b_proj.weight", (inner, d)), dtype)
    plan[layer(i, "kda.dt_bias")] = load(w.take(f"{gate}dt_bias", (inner,)), dtype)
    # HF's parameter is [1, 1, H, 1]; a flat [H] is the same tensor
    stored = tuple(w.tensors[w.prefix + f"{gate}A_log"].shape) if w.has(f"{gate}A_log") else ()
    a_log = w.take(f"{gate}A_log", (heads,) if stored == (heads,) else (1, 1, heads, 1))
    plan[layer(i, "kda.A_log")] = lambda: cast(a_log.load().reshape(heads), dtype)
    plan[layer(i, "kda.g_b.weight")] = load(w.take(f"{src}g_b_proj.weight", (inner, d)), dtype)
    plan[layer(i, "kda.norm.weight")] = load(w.take(f"{src}o_norm.weight", (d,)), dtype)
    plan[layer(i, "kda.out.weight")] = load(w.take(f"{src}o_proj.weight", (h, inner)), dtype)


def _add_mla(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """mla.in_proj rows [q or the q latent, the kv latent, the shared key]; the latent norms, q_b, kv_b, o."""
    m, h, nq = arch.mla, arch.hidden_size, arch.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    src = f"layers.{i}.self_attn."
    if m.q_lora_rank is None:
        q = w.take(f"{src}q_proj.weight", (nq * qk, h))
    else:
        q = w.take(f"{src}q_a_proj.weight", (m.q_lora_rank, h))
        plan[layer(i, "mla.q_a_norm.weight")] = load(w.take(f"{src}q_a_layernorm.weight", (m.q_lora_rank,)), dtype)
        plan[layer(i, "mla.q_b.weight")] = load(w.take(f"{src}q_b_proj.weight", (nq * qk, m.q_lora_rank)), dtype)
    kv_a = w.take(f"{src}kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h))
    plan[layer(i, "mla.in_proj.weight")] = load_fused([q, kv_a], dtype)
    plan[layer(i, "mla.kv_a_norm.weight")] = load(w.take(f"{src}kv_a_layernorm.weight", (m.kv_lora_rank,)), dtype)
    kv_b_rows = nq * (m.qk_nope_head_dim + m.v_head_dim)
    plan[layer(i, "mla.kv_b.weight")] = load(w.take(f"{src}kv_b_proj.weight", (kv_b_rows, m.kv_lora_rank)), dtype)
    plan[layer(i, "mla.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, nq * m.v_head_dim)), dtype)


def _ffn_prefix(w: Weights, i: int) -> str:
    """The released checkpoints keep every feed-forward under block_sparse_moe. (transformers saves them so too),
    transformers' modules under mlp."""
    return f"layers.{i}.mlp." if w.has(f"layers.{i}.mlp.down_proj.weight") or w.has(
        f"layers.{i}.mlp.gate.weight") else f"layers.{i}.block_sparse_moe."


def _add_gated_mlp(w: Weights, plan: Plan, src: str, dst: str, hidden: int, width: int, dtype) -> None:
    gate_up = [w.take(f"{src}{p}_proj.weight", (width, hidden)) for p in ("gate", "up")]
    plan[f"{dst}.gate_up.weight"] = load_fused(gate_up, dtype)
    plan[f"{dst}.down.weight"] = load(w.take(f"{src}down_proj.weight", (hidden, width)), dtype)


def _add_dense_mlp(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    _add_gated_mlp(w, plan, _ffn_prefix(w, i), layer(i, "mlp"), arch.hidden_size, arch.intermediate_size, dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """moe.router (+ its score bias), the experts stacked (gate rows, then up rows), the shared experts."""
    moe, h = arch.moe, arch.hidden_size
    e, fm = moe.num_experts, moe.moe_intermediate_size
    src = _ffn_prefix(w, i)
    plan[layer(i, "moe.router.weight")] = load(w.take(f"{src}gate.weight", (e, h)), dtype)
    plan[layer(i, "moe.router.bias")] = load(w.take(f"{src}gate.e_score_correction_bias", (e,)), dtype)
    if w.has(f"{src}experts.gate_up_proj"):  # transformers' stacked layout
        plan[layer(i, "moe.gate_up.weight")] = load(w.take(f"{src}experts.gate_up_proj", (e, 2 * fm, h)), dtype)
        plan[layer(i, "moe.down.weight")] = load(w.take(f"{src}experts.down_proj", (e, h, fm)), dtype)
    else:  # w1 = gate, w3 = up, w2 = down
        gate_up = [[w.take(f"{src}experts.{j}.{p}.weight", (fm, h)) for p in ("w1", "w3")] for j in range(e)]
        down = [w.take(f"{src}experts.{j}.w2.weight", (h, fm)) for j in range(e)]
        plan[layer(i, "moe.gate_up.weight")] = _stacked(gate_up, dtype)
        plan[layer(i, "moe.down.weight")] = _stacked([[p] for p in down], dtype)
    _add_gated_mlp(w, plan, f"{src}shared_experts.", layer(i, "moe.shared"), h, moe.shared_expert_intermediate_size,
                   dtype)


def _stacked(parts: list[list[LazyTensor]], dtype) -> Producer:
    # NOTE: each expert is cast before stacking, so the peak is one layer's experts in the target dtype
    return lambda: stack_experts([cast(fuse_rows(*(p.load() for p in rows)), dtype) for rows in parts])
