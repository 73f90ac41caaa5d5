"""gemma3 (model_type gemma3_text, or gemma3 with a text_config): sandwich norms stored as 1+w, embedding
scale, query_pre_attn_scalar, interleaved sliding/full layers with a local rope base.

The multimodal wrapper's vision tower and projector are ignored (text-only cores).
"""

from __future__ import annotations

from helios.core.layout import layer
from helios.core.manifest import Architecture
from ignition.archs import Plan, Weights
from ignition.archs.llama import (
    add_attention,
    add_dense_mlp,
    add_embedding_and_head,
    add_norm,
    parse_rope_scaling,
    read_dims,
    rope_entry,
    to_layer_types,
)
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint
from ignition.transforms import round_to

# transformers' Gemma3TextConfig defaults: hub text_configs of the multimodal models omit most fields.
_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    top = ckpt.config
    if top["model_type"] == "gemma3":
        text = top.get("text_config")
        if not isinstance(text, dict):
            raise ExportError(f"{where}: model_type gemma3 without a text_config")
        inherited = {k: top[k] for k in ("tie_word_embeddings",) if k in top}
        cfg = {**_DEFAULTS, **inherited, **text}
        # transformers 5 saves model.language_model.*; hub checkpoints have language_model.model.*
        prefixes = ("model.language_model.", "language_model.model.")
        head_names = ("lm_head.weight", "language_model.lm_head.weight")
        ignore = _VISION_PREFIXES
    else:
        cfg = {**_DEFAULTS, **top}
        prefixes, head_names, ignore = ("model.",), ("lm_head.weight",), ()
    if cfg.get("use_bidirectional_attention"):
        raise ExportError(f"{where}: use_bidirectional_attention=true (an embedding model) is not supported")
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true (an o_proj bias) is not supported")
    dims = read_dims(cfg, where)
    theta, scaling, local_theta = _rope(cfg, where)
    types = _layer_types(cfg, dims["num_layers"], where)
    window = cfg.get("sliding_window") if types else None
    arch = Architecture(
        family="gemma3",
        **dims,
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=True,
        sandwich_norms=True,
        # NOTE: HF multiplies by the scale cast to the weight dtype (sqrt(2560) is 50.5 in bfloat16);
        # recording that rounded value lets helios match HF in every dtype.
        embedding_scale=round_to(dims["hidden_size"] ** 0.5, dtype),
        query_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        sliding_window=int(window) if window is not None else None,
        rope_local_theta=local_theta,
        layer_types=types,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
    )
    if arch.layer_types and arch.sliding_window is None:
        raise ExportError(f"{where}: sliding layers without a sliding_window")
    w = Weights(ckpt, prefixes, ignore)
    plan: Plan = {}
    add_embedding_and_head(w, plan, arch, dtype, gemma_norm=True, head_names=head_names)
    norms = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "attn_post_norm",
        "pre_feedforward_layernorm": "mlp_norm",
        "post_feedforward_layernorm": "mlp_post_norm",
    }
    for i in range(arch.num_layers):
        add_attention(w, plan, arch, i, dtype, gemma_norm=True)
        for src, dst in norms.items():
            add_norm(w, plan, f"layers.{i}.{src}.weight", layer(i, f"{dst}.weight"), arch, dtype, True)
        add_dense_mlp(w, plan, i, arch.hidden_size, arch.intermediate_size, dtype)
    w.check_all_used()
    return arch, plan


def _rope(cfg: dict, where: str):
    """(global theta, global scaling, local theta): scaling applies to full-attention layers only, as in HF."""
    max_pos = int(cfg["max_position_embeddings"])
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):  # transformers 5
        full, local = rope_entry(cfg, "full_attention"), rope_entry(cfg, "sliding_attention")
        theta = full.get("rope_theta", cfg["rope_theta"])
        local_theta = local.get("rope_theta", cfg["rope_local_base_freq"])
        scaling = parse_rope_scaling(full, max_pos, where)
        if parse_rope_scaling(local, max_pos, where) is not None:
            raise ExportError(f"{where}: rope scaling on sliding layers is not supported")
    else:  # 4.x: rope_theta + rope_scaling for global layers, rope_local_base_freq for local ones
        flat = rp if isinstance(rp, dict) else {}
        theta, local_theta = flat.get("rope_theta", cfg["rope_theta"]), cfg["rope_local_base_freq"]
        scaling = parse_rope_scaling(flat or cfg.get("rope_scaling"), max_pos, where)
    return float(theta), scaling, float(local_theta)


def _layer_types(cfg: dict, num_layers: int, where: str) -> list:
    types = cfg.get("layer_types")
    if not types:  # older configs: every `pattern`-th layer is full, the rest slide
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    return to_layer_types(types, where)
