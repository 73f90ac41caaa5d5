"""GGUF metadata -> an HF config.json-style dict, one builder per supported GGUF architecture.

Keys are the classic config.json ones (rope_theta, rope_scaling, ...), as hub checkpoints write them, so the
arch modules read a GGUF source and an HF directory the same way. Values llama.cpp hard-codes rather than
stores (Gemma 3's local rope base, its sliding-window period) are filled in as llama.cpp assumes them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from ignition.errors import ExportError

# GGUF general.architecture -> (HF model_type, HF architectures entry)
_FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
SUPPORTED_ARCHS = tuple(_FAMILIES)


def check_arch(arch: Any, where: str) -> str:
    """`arch` when this reader supports it; otherwise the one-line error naming it."""
    if arch not in _FAMILIES:
        raise ExportError(f"{where}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    return arch


def build_config(arch: str, meta: Mapping[str, Any], tensor_names: Collection[str], where: str) -> dict[str, Any]:
    """The HF config dict for a file of `arch` with this metadata and these GGUF tensor names."""
    check_arch(arch, where)

    def key(name: str, default: Any = ...) -> Any:
        full = f"{arch}.{name}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise ExportError(f"{where}: GGUF metadata lacks {full}")
        return default

    model_type, hf_arch = _FAMILIES[arch]
    def scalar(name: str, default: Any = ...) -> int:
        return _scalar(key(name, default), f"{arch}.{name}", where)

    hidden = scalar("embedding_length")
    heads = scalar("attention.head_count")
    kv_heads = scalar("attention.head_count_kv", heads)
    # llama.cpp writes key_length only when it differs from hidden/heads; llama's rope width is the head
    head_dim = key("attention.key_length", None) or key("rope.dimension_count", None) or hidden // heads
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": scalar("feed_forward_length", 0) or None,
        "num_hidden_layers": scalar("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(key("vocab_size", len(tokens))),
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if config["intermediate_size"] is None:
        del config["intermediate_size"]  # an all-expert file has no dense FFN width
    if (scaling := _rope_scaling(key)) is not None:
        config["rope_scaling"] = scaling
    config.update(_FAMILY_FIELDS[arch](key, config, tensor_names))
    return config


def _llama(key: Callable[..., Any], config: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    return {"hidden_act": "silu", "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": False}


def _qwen2(key: Callable[..., Any], config: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    return {"hidden_act": "silu", "use_sliding_window": False}


def _qwen3(key: Callable[..., Any], config: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    return {"hidden_act": "silu", "attention_bias": "blk.0.attn_q.bias" in names}


def _qwen3moe(key: Callable[..., Any], config: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    return {
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "num_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        # llama.cpp always renormalizes the top-k weights for qwen3moe (transformers sets it for GGUFs too)
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gemma3(key: Callable[..., Any], config: dict[str, Any], names: Collection[str]) -> dict[str, Any]:
    num_layers = config["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern", 6)  # llama.cpp's set_swa_pattern(6) when absent
    if isinstance(pattern, list):  # one flag per layer, true = sliding
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": 10000.0,  # hard-coded in llama.cpp (rope_freq_base_train_swa)
        # llama.cpp scales queries by 1/sqrt(head_dim), except the 62-layer 27B, which uses hidden/heads
        "query_pre_attn_scalar": (
            config["hidden_size"] // config["num_attention_heads"] if num_layers == 62 else config["head_dim"]
        ),
        "final_logit_softcapping": _optional_f32(key("final_logit_softcapping", None)),
        "attn_logit_softcapping": _optional_f32(key("attn_logit_softcapping", None)),
    }
    if not isinstance(pattern, list):
        fields["sliding_window_pattern"] = int(pattern)
    return fields


_FAMILY_FIELDS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3moe": _qwen3moe, "gemma3": _gemma3}


def _rope_scaling(key: Callable[..., Any]) -> dict[str, Any] | None:
    kind = key("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(key("rope.scaling.factor", 1.0))}
    if (original := key("rope.scaling.original_context_length", None)) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _scalar(value: Any, name: str, where: str) -> int:
    if isinstance(value, list):  # per-layer counts: fine only while they agree
        if len(set(value)) != 1:
            raise ExportError(f"{where}: per-layer {name} {sorted(set(value))} is not supported")
        value = value[0]
    return int(value)


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips it: 1e-05, not 9.999999747378752e-06."""
    return float(str(np.float32(value)))


def _optional_f32(value: Any) -> float | None:
    return None if value is None else _f32(value)
