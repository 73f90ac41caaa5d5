"""muse_spark (model_type muse_spark with a text_config, or muse_spark_text): the text decoder of Muse Spark.

Sliding and full GQA layers (layer_types; rotary per layer_rope_theta, 0 = NoPE), weightless q/k/o norms (no
tensors), the elementwise gate's rows fused after v's, centred norms stored as 1 + w, residual gates stored as their
per-channel (alpha, beta), dense SwiGLU or a sigmoid-routed latent MoE (mlp_layer_types). output_multiplier is
folded into lm_head (the logits are scaled before the soft-cap) and into every router (its logits are scaled
before the sigmoid); qk_scale_factor into the attention scale. The vision and audio towers and their projections
are ignored (text-only cores).
"""

from __future__ import annotations

import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, MoeConfig
from ignition.archs import Plan, Producer, Weights
from ignition.archs.llama import add_dense_mlp, load, load_fused, load_norm, read_dims, read_rope, to_layer_types
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import cast

# MuseSparkTextConfig's defaults (the released checkpoint's shapes) for the fields read here
_DEFAULTS = {
    "vocab_size": 202_048, "hidden_size": 8192, "intermediate_size": 16384, "num_hidden_layers": 62,
    "num_attention_heads": 128, "num_key_value_heads": 16, "head_dim": 64, "max_position_embeddings": 1_048_576,
    "rms_norm_eps": 1e-5, "attention_bias": False, "sliding_window": 2048, "final_logit_softcapping": 20.0,
    "qk_scale_factor": 5.4730064863875, "output_multiplier": 0.1767766952966369, "post_norm_eps": 1e-8,
    "hidden_act": "silu", "moe_intermediate_size": 4096, "num_local_experts": 256, "num_experts_per_tok": 8,
    "routed_scaling_factor": 1.0, "moe_hidden_size": 4096, "residual_gate_temperature": 0.3,
}
_DEFAULT_THETA = 500_000.0
_RESIDUAL_GATE_EPS = 1e-3  # MuseSparkResidualGate's residual_gate_eps (not a config field)
_IGNORED = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.", "model.audio_tower.")


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where, top = ckpt.identifier, ckpt.config
    if top["model_type"] == "muse_spark":
        text = top.get("text_config")
        if not isinstance(text, dict):
            raise ExportError(f"{where}: model_type muse_spark without a text_config")
        cfg, prefixes = {**_DEFAULTS, **text}, ("model.language_model.",)
    else:
        cfg, prefixes = {**_DEFAULTS, **top}, ("model.language_model.", "model.")
    quant = top.get("quantization_config") or cfg.get("quantization_config")
    if quant:  # the recipe's release is NVFP4 (scales beside packed weights): export from the bf16 weights
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ExportError(f"{where}: quantization_config ({method}) is not supported: export from bf16 weights")
    arch = _architecture(cfg, where)
    w = Weights(ckpt, prefixes, _IGNORED)
    plan: Plan = {}
    scale = float(cfg["output_multiplier"])
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embed_tokens.weight", (v, h)), dtype)
    plan["norm.weight"] = load(w.take("norm.weight", (h,)), dtype)
    # NOTE: MuseSparkForConditionalGeneration ties nothing (no _tied_weights_keys): lm_head is always its own tensor
    plan["lm_head.weight"] = _scaled(w.take("lm_head.weight", (v, h), root=True), scale, dtype)
    temperature = float(cfg["residual_gate_temperature"])
    for i in range(arch.num_layers):
        _add_attention(w, plan, arch, i, dtype, temperature)
        if arch.moe is None or i in arch.moe.dense_layers:
            add_dense_mlp(w, plan, i, h, arch.intermediate_size, dtype)
        else:
            _add_moe(w, plan, arch, i, dtype, scale)
    w.check_all_used()
    return arch, plan


# ---- config reading -----------------------------------------------------------------------------------------


def _architecture(cfg: dict, where: str) -> Architecture:
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true (q/k/v/o biases) is not supported")
    cap = cfg.get("final_logit_softcapping")
    if not cap or cap <= 0:  # HF divides by it unconditionally
        raise ExportError(f"{where}: final_logit_softcapping={cap!r} is not supported (must be > 0)")
    dims = read_dims(cfg, where)
    theta, scaling = read_rope(cfg, where, default_theta=_DEFAULT_THETA)
    n = dims["num_layers"]
    hf_types = _per_layer(cfg, "layer_types", n, where,
                          ["full_attention" if (n - 1 - i) % 4 == 0 else "sliding_attention" for i in range(n)])
    types = to_layer_types(hf_types, where)
    window = cfg.get("sliding_window") if types else None
    if types and not window:
        raise ExportError(f"{where}: sliding layers without a sliding_window")
    mlp_types = _per_layer(cfg, "mlp_layer_types", n, where, ["sparse"] * n)
    if set(mlp_types) - {"dense", "sparse"}:
        raise ExportError(f"{where}: mlp_layer_types {sorted(set(mlp_types))} (supported: dense, sparse)")
    return Architecture(
        family="muse_spark",
        **{**dims, "tie_word_embeddings": False},
        rope_theta=theta,
        rope_scaling=scaling,
        # NOTE: qk_norm and sandwich_norms stay off: they name weighted norm tensors (helios/core/layout.py) that this
        # family lacks; its weightless q/k/o and post-attention norms are the family's own
        query_scale=float(cfg["qk_scale_factor"]) * dims["head_dim"] ** -0.5,
        attn_output_gate=True,
        sliding_window=int(window) if window else None,
        layer_types=types,
        final_logit_softcapping=float(cap),
        moe=_moe(cfg, mlp_types, where) if "sparse" in mlp_types else None,
        nope_layers=_nope_layers(cfg, theta, n, where),
        post_norm_eps=float(cfg["post_norm_eps"]),
    )


def _per_layer(cfg: dict, key: str, num_layers: int, where: str, default: list) -> list:
    values = cfg.get(key) or default
    if len(values) != num_layers:
        raise ExportError(f"{where}: {key} has {len(values)} entries for {num_layers} layers")
    return list(values)


def _nope_layers(cfg: dict, theta: float, num_layers: int, where: str) -> list[int]:
    """Layers whose layer_rope_theta is 0 (by default every 4th counted back from the last, as HF derives it)."""
    default = [0 if (num_layers - 1 - i) % 4 == 0 else theta for i in range(num_layers)]
    thetas = _per_layer(cfg, "layer_rope_theta", num_layers, where, default)
    # NOTE: HF's forward rotates every non-zero layer with the one global base; a different per-layer base would be
    # ignored there, so such a config is refused rather than guessed at
    other = sorted({float(t) for t in thetas if t and float(t) != theta})
    if other:
        raise ExportError(f"{where}: layer_rope_theta {other} differs from rope_theta {theta} (per-layer bases are "
                          "not supported: 0 or the global theta)")
    return [i for i, t in enumerate(thetas) if not t]


def _moe(cfg: dict, mlp_types: list[str], where: str) -> MoeConfig:
    experts, top_k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ExportError(f"{where}: num_experts_per_tok={top_k} of num_local_experts={experts}")
    return MoeConfig(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=True,  # NOTE: HF renormalises with sum + 1e-15, route_sigmoid with + 1e-20: equal in float32
        dense_layers=[i for i, t in enumerate(mlp_types) if t == "dense"],
        shared_expert_intermediate_size=0,
        shared_expert_gate=False,
        scoring="sigmoid",
        score_bias=True,
        routed_scaling_factor=float(cfg["routed_scaling_factor"]),
        latent_size=int(cfg["moe_hidden_size"]),
        latent_norms=True,
    )


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """Parameters of layer i (ignition.archs.num_params / decode_weight_bytes): four norms, qkv + gate, o, two residual
    gates, and its dense MLP or its router (+ bias), latent projections and norms and `experts_read` experts (None:
    all of them)."""
    h, d, moe = arch.hidden_size, arch.head_dim, arch.moe
    n = 3 * h + 4 * h + (2 * arch.num_heads + 2 * arch.num_kv_heads) * d * h + h * arch.num_heads * d
    if moe is None or i in moe.dense_layers:
        return n + 3 * h * arch.intermediate_size
    latent = moe.latent_size
    experts = moe.num_experts if experts_read is None else experts_read
    n += moe.num_experts * (h + 1) + 2 * h * latent + 2 * latent
    return n + experts * 3 * latent * moe.moe_intermediate_size


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _scaled(t: LazyTensor, scale: float, dtype) -> Producer:
    """t * scale, taken in float32 (a folded output_multiplier)."""
    return lambda: cast(t.load().float() * scale, dtype)


def residual_gate(gate: torch.Tensor, temperature: float, dtype) -> torch.Tensor:  # [H] -> [2, H]
    """MuseSparkResidualGate's per-channel (alpha, beta) in float32: w = gate / temperature, beta = sigmoid(w),
    alpha = sqrt(max(sigmoid(-w) * (1 + beta), eps))."""
    w = gate.float() / temperature
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=_RESIDUAL_GATE_EPS))
    return cast(torch.stack([alpha, beta]), dtype)


def _add_gate(w: Weights, plan: Plan, src: str, dst: str, h: int, temperature: float, dtype) -> None:
    t = w.take(src, (h,))
    plan[dst] = lambda: residual_gate(t.load(), temperature, dtype)


def _add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype, temperature: float) -> None:
    """attn_norm / mlp_norm / mlp_post_norm (1 + w), attn.qkv (rows q, k, v, gate), attn.o, the residual gates."""
    h, d = arch.hidden_size, arch.head_dim
    src = f"layers.{i}."
    rows = {"q": arch.num_heads * d, "k": arch.num_kv_heads * d, "v": arch.num_kv_heads * d,
            "gate": arch.num_heads * d}
    parts = [w.take(f"{src}self_attn.{p}_proj.weight", (r, h)) for p, r in rows.items()]
    plan[layer(i, "attn.qkv.weight")] = load_fused(parts, dtype)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}self_attn.o_proj.weight", (h, arch.num_heads * d)), dtype)
    norms = {"input_layernorm": "attn_norm", "pre_feedforward_layernorm": "mlp_norm",
             "post_feedforward_layernorm": "mlp_post_norm"}
    for name, dst in norms.items():
        plan[layer(i, f"{dst}.weight")] = load_norm(w.take(f"{src}{name}.weight", (h,)), dtype, gemma_norm=True)
    _add_gate(w, plan, f"{src}post_attention_residual_gate.gate", layer(i, "attn_residual.weight"), h, temperature,
              dtype)
    _add_gate(w, plan, f"{src}post_feedforward_residual_gate.gate", layer(i, "mlp_residual.weight"), h, temperature,
              dtype)


def _add_moe(w: Weights, plan: Plan, arch: Architecture, i: int, dtype, scale: float) -> None:
    """moe.router (output_multiplier folded in) + its score bias, latent_in / latent_norm, the stacked experts and
    their expert_norm, latent_out."""
    moe, h = arch.moe, arch.hidden_size
    e, fm, lat = moe.num_experts, moe.moe_intermediate_size, moe.latent_size
    src = f"layers.{i}.mlp."
    plan[layer(i, "moe.router.weight")] = _scaled(w.take(f"{src}gate.weight", (e, h)), scale, dtype)
    plan[layer(i, "moe.router.bias")] = load(w.take(f"{src}gate.e_score_correction_bias", (e,)), dtype)
    plan[layer(i, "moe.latent_in.weight")] = load(w.take(f"{src}pre_expert_proj.weight", (lat, h)), dtype)
    plan[layer(i, "moe.latent_norm.weight")] = load_norm(w.take(f"{src}pre_expert_norm.weight", (lat,)), dtype, True)
    plan[layer(i, "moe.gate_up.weight")] = load(w.take(f"{src}experts.gate_up_proj", (e, 2 * fm, lat)), dtype)
    plan[layer(i, "moe.down.weight")] = load(w.take(f"{src}experts.down_proj", (e, lat, fm)), dtype)
    plan[layer(i, "moe.expert_norm.weight")] = load_norm(w.take(f"{src}experts.post_expert_norm.weight", (lat,)),
                                                         dtype, True)
    plan[layer(i, "moe.latent_out.weight")] = load(w.take(f"{src}post_expert_proj.weight", (h, lat)), dtype)
