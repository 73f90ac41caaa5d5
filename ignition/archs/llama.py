"""The llama-shaped decoder: llama, qwen2 (qkv bias) and qwen3 (per-head q/k RMSNorm), plus the pieces the
other families reuse (config reading, rope parsing, attention / dense MLP / embedding plans).

HF names in, helios/core/layout.py names out; every producer loads, fuses and casts one runtime tensor.
"""

from __future__ import annotations

import torch

from helios.core.layout import layer
from helios.core.manifest import Architecture, RopeScaling
from ignition.archs import Plan, Producer, Weights
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor
from ignition.transforms import add_one, cast, fuse_rows, keep_float32

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_REQUIRED = object()

# Defaults of the transformers config classes for fields real configs sometimes omit.
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False},
    "qwen3": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False},
}


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    family = ckpt.config["model_type"]
    cfg = {"hidden_act": "silu", **_DEFAULTS[family], **ckpt.config}
    where = ckpt.identifier
    if cfg.get("mlp_bias"):
        raise ExportError(f"{where}: mlp_bias=true is not supported")
    # qwen2 always has q/k/v biases and no o bias; llama/qwen3's attention_bias also adds an o_proj bias.
    if family != "qwen2" and cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true ({family} then has an o_proj bias) is not supported")
    dims = read_dims(cfg, where)
    theta, scaling = read_rope(cfg, where, default_theta=10000.0)
    window, types = _sliding_layers(cfg, dims["num_layers"], where)
    arch = Architecture(
        family=family,
        **dims,
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        sliding_window=window,
        layer_types=types,
    )
    w = Weights(ckpt, ("model.",))
    plan: Plan = {}
    add_embedding_and_head(w, plan, arch, dtype, gemma_norm=False)
    for i in range(arch.num_layers):
        add_attention(w, plan, arch, i, dtype, gemma_norm=False)
        add_llama_norms(w, plan, arch, i, dtype)
        add_dense_mlp(w, plan, i, arch.hidden_size, arch.intermediate_size, dtype)
    w.check_all_used()
    return arch, plan


# ---- config reading -----------------------------------------------------------------------------------------


def config_value(cfg: dict, key: str, where: str, default=_REQUIRED):
    value = cfg.get(key, default)
    if value is _REQUIRED or value is None and default is _REQUIRED:
        raise ExportError(f"{where}: config.json lacks '{key}'")
    return value


def read_dims(cfg: dict, where: str) -> dict:
    """The Architecture fields every family shares, with HF's derived defaults (kv heads, head_dim)."""
    hidden = int(config_value(cfg, "hidden_size", where))
    heads = int(config_value(cfg, "num_attention_heads", where))
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    act = cfg.get("hidden_activation") or config_value(cfg, "hidden_act", where)
    if act not in _ACTIVATIONS:
        raise ExportError(f"{where}: activation '{act}' is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return dict(
        vocab_size=int(config_value(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(config_value(cfg, "intermediate_size", where)),
        num_layers=int(config_value(cfg, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config_value(cfg, "rms_norm_eps", where)),
        max_position_embeddings=int(config_value(cfg, "max_position_embeddings", where)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=_ACTIVATIONS[act],
    )


def rope_entry(cfg: dict, layer_type: str = "full_attention") -> dict | None:
    """transformers 5's `rope_parameters` for one layer type (flat or nested per layer type); None if absent."""
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict):
        return None
    if any(k in _LAYER_TYPES for k in rp):
        return rp.get(layer_type) or {}
    return rp


def read_rope(cfg: dict, where: str, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from `rope_parameters` (transformers 5) or rope_theta/rope_scaling (4.x)."""
    entry = rope_entry(cfg)
    if entry is None:
        theta, scaling = cfg.get("rope_theta", default_theta), cfg.get("rope_scaling")
    else:
        theta, scaling = entry.get("rope_theta", cfg.get("rope_theta", default_theta)), entry
    _check_full_rotary(cfg, entry, where)
    return float(theta), parse_rope_scaling(scaling, int(cfg["max_position_embeddings"]), where)


def _check_full_rotary(cfg: dict, entry: dict | None, where: str) -> None:
    factor = (entry or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ExportError(f"{where}: partial_rotary_factor={factor} is not supported")


# yarn keys we accept only at transformers' defaults (RopeScaling has no fields for them)
_YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "attention_factor": None, "mscale": 1, "mscale_all_dim": 0,
                  "truncate": True}


def parse_rope_scaling(d: dict | None, max_positions: int, where: str) -> RopeScaling | None:
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    if "factor" not in d:
        raise ExportError(f"{where}: rope scaling '{kind}' lacks 'factor'")
    factor = float(d["factor"])
    original = d.get("original_max_position_embeddings") or max_positions
    if kind in ("linear", "dynamic"):
        return RopeScaling(type=kind, factor=factor)
    if kind == "llama3":
        try:
            low, high = float(d["low_freq_factor"]), float(d["high_freq_factor"])
        except KeyError as e:
            raise ExportError(f"{where}: llama3 rope scaling lacks {e}") from None
        return RopeScaling(type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                           original_max_position_embeddings=int(original))
    if kind == "yarn":
        for key, default in _YARN_DEFAULTS.items():
            if d.get(key) not in (None, default):
                raise ExportError(f"{where}: yarn rope scaling with {key}={d[key]} is not supported")
        return RopeScaling(type="yarn", factor=factor, original_max_position_embeddings=int(original))
    raise ExportError(f"{where}: rope scaling '{kind}' is not supported (supported: linear, llama3, yarn, dynamic)")


def to_layer_types(types: list, where: str) -> list:
    """HF layer_types ("full_attention"/"sliding_attention") -> core ("full"/"sliding"); [] when all full."""
    out = []
    for t in types:
        if t not in _LAYER_TYPES:
            raise ExportError(f"{where}: layer type '{t}' is not supported (supported: {', '.join(_LAYER_TYPES)})")
        out.append(_LAYER_TYPES[t])
    return out if "sliding" in out else []


def _sliding_layers(cfg: dict, num_layers: int, where: str) -> tuple[int | None, list]:
    # qwen2/qwen3: a window only with use_sliding_window, on layers >= max_window_layers (or per layer_types)
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window") or window is None:
        return None, []
    start = cfg.get("max_window_layers", num_layers)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= start else "full_attention" for i in range(num_layers)
    ]
    types = to_layer_types(types, where)
    return (int(window), types) if types else (None, [])


# ---- tensor plans ---------------------------------------------------------------------------------------------


def load(t: LazyTensor, dtype) -> Producer:
    return lambda: cast(t.load(), dtype)


def load_fused(parts: list[LazyTensor], dtype) -> Producer:
    return lambda: cast(fuse_rows(*(p.load() for p in parts)), dtype)


def load_norm(t: LazyTensor, dtype, gemma_norm: bool) -> Producer:
    """The norm's multiplier: w, or 1 + w (gemma_norm), in dtype; with arch.float32_norms the caller passes float32
    and the 1 + w multiplier stays float32 in a 16-bit core (transforms.keep_float32)."""
    if gemma_norm:
        produce = lambda: add_one(t.load(), dtype)  # noqa: E731
        return keep_float32(produce) if dtype == torch.float32 else produce
    return load(t, dtype)


def add_norm(w: Weights, plan: Plan, src: str, dst: str, arch: Architecture, dtype, gemma_norm: bool,
             size: int | None = None) -> None:
    if gemma_norm and arch.float32_norms:
        dtype = torch.float32
    plan[dst] = load_norm(w.take(src, (size or arch.hidden_size,)), dtype, gemma_norm)


def add_embedding_and_head(w: Weights, plan: Plan, arch: Architecture, dtype, gemma_norm: bool,
                           head_names: tuple[str, ...] = ("lm_head.weight",)) -> None:
    """embed.weight, norm.weight and (untied only) lm_head.weight; a stored lm_head under tying is skipped."""
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embed_tokens.weight", (v, h)), dtype)
    add_norm(w, plan, "norm.weight", "norm.weight", arch, dtype, gemma_norm)
    stored = [n for n in head_names if w.has(n, root=True)]
    if arch.tie_word_embeddings:
        for n in stored:  # HF ties them anyway, so the stored copy is never read
            w.skip(n, root=True)
    elif not stored:
        raise ExportError(f"{w.identifier}: checkpoint lacks tensor '{head_names[0]}' (tie_word_embeddings=false)")
    else:
        plan["lm_head.weight"] = load(w.take(stored[0], (v, h), root=True), dtype)


def add_attention(w: Weights, plan: Plan, arch: Architecture, i: int, dtype, gemma_norm: bool) -> None:
    """attn.qkv (+bias), attn.q_norm/k_norm with qk_norm, attn.o."""
    h, d = arch.hidden_size, arch.head_dim
    rows = {"q": arch.num_heads * d, "k": arch.num_kv_heads * d, "v": arch.num_kv_heads * d}
    src = f"layers.{i}.self_attn."
    weights = [w.take(f"{src}{p}_proj.weight", (n, h)) for p, n in rows.items()]
    plan[layer(i, "attn.qkv.weight")] = load_fused(weights, dtype)
    if arch.attention_bias:
        biases = [w.take(f"{src}{p}_proj.bias", (n,)) for p, n in rows.items()]
        plan[layer(i, "attn.qkv.bias")] = load_fused(biases, dtype)
    if arch.qk_norm:
        for p in ("q", "k"):
            add_norm(w, plan, f"{src}{p}_norm.weight", layer(i, f"attn.{p}_norm.weight"), arch, dtype, gemma_norm, d)
    plan[layer(i, "attn.o.weight")] = load(w.take(f"{src}o_proj.weight", (h, arch.num_heads * d)), dtype)


def add_llama_norms(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """input_layernorm -> attn_norm, post_attention_layernorm -> mlp_norm (gemma3 names these differently)."""
    add_norm(w, plan, f"layers.{i}.input_layernorm.weight", layer(i, "attn_norm.weight"), arch, dtype, False)
    add_norm(w, plan, f"layers.{i}.post_attention_layernorm.weight", layer(i, "mlp_norm.weight"), arch, dtype, False)


def add_dense_mlp(w: Weights, plan: Plan, i: int, hidden: int, intermediate: int, dtype) -> None:
    """mlp.gate_up (rows: gate, then up) and mlp.down."""
    src = f"layers.{i}.mlp."
    gate_up = [w.take(f"{src}{p}_proj.weight", (intermediate, hidden)) for p in ("gate", "up")]
    plan[layer(i, "mlp.gate_up.weight")] = load_fused(gate_up, dtype)
    plan[layer(i, "mlp.down.weight")] = load(w.take(f"{src}down_proj.weight", (hidden, intermediate)), dtype)
