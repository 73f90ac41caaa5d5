"""qwen4_exp (Qwen3.8-Flash-Next): qwen3_5_moe's GDN and gated attention plus QSA (a block indexer in every
attention layer), gated-residual hyper-connections (hc_count streams) and hashed n-gram embeddings (PLE).

model_types: qwen4_exp_text, and the multimodal wrapper qwen4_exp (its text_config, tensors under
model.language_model.; the vision tower and mtp.* are ignored). Every RMSNorm but the GDN's gated one is
zero-centred (1+w, stored shifted), the hyper-connections' and PLE's grouped per stream. There is no input,
post-attention or final norm: the hyper-connections norm their streams. The PLE hash constants (multipliers, prime
moduli) go to the manifest: read from the checkpoint's buffers where it has them, else derived as transformers does.
"""

from __future__ import annotations

import math
import re

import torch

from helios.core.layout import layer
from helios.core.manifest import (
    Architecture,
    HyperConnectionConfig,
    IndexerConfig,
    MoeConfig,
    PleConfig,
    RecurrentConfig,
)
from ignition.archs import Plan, Weights
from ignition.archs.llama import add_norm, load, parse_rope_scaling, read_dims, rope_entry
from ignition.archs.qwen3_5 import add_gated_attention, add_gdn, add_shared_expert
from ignition.archs.qwen3_moe import add_experts
from ignition.errors import ExportError
from ignition.sources.base import Checkpoint
from ignition.transforms import cast

_LAYER_TYPES = {"linear_attention": "linear", "indexed_attention": "full", "full_attention": "full"}
# Qwen4ExpTextConfig's defaults for the fields read here that a config may omit (its rope has no partial factor)
_DEFAULTS = {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "full_attention_interval": 4,
    "hc_count": 4, "hc_lowrank": 320, "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000, "make_ngram_vocab_size_divisible_by": 128, "seed": 1234,
}
_QSA = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
_DEFAULT_THETA = 10000.0


def build(ckpt: Checkpoint, dtype) -> tuple[Architecture, Plan]:
    where = ckpt.identifier
    cfg, prefixes = _text_config(ckpt.config, where)
    cfg = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    if cfg.get("attention_bias"):
        raise ExportError(f"{where}: attention_bias=true is not supported")
    cfg["intermediate_size"] = cfg["shared_expert_intermediate_size"]  # no dense MLP: record the shared expert's
    dims = read_dims(cfg, where)
    if dims["hidden_act"] != "silu":  # the GDN's conv and the experts apply hidden_act
        raise ExportError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported for qwen4_exp (only silu)")
    types = _layer_types(cfg, dims["num_layers"], where)
    theta, scaling, rotary_dim = _rope(cfg, dims["head_dim"], where)
    indexer = _indexer(cfg, rotary_dim or dims["head_dim"], "full" in types, where)
    hc = _hyper_connections(cfg, where)
    w = Weights(ckpt, prefixes, ("mtp.", "model.visual."))
    arch = Architecture(
        family="qwen4_exp",
        **dims,
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=True,
        layer_types=types,
        moe=_moe(cfg, where),
        recurrent=_recurrent(cfg, where),
        attn_output_gate=True,
        rotary_dim=rotary_dim,
        indexer=indexer,
        hyper_connections=hc,
        ple=_ple(cfg, w, dims, types, where),
    )
    ple = arch.ple
    plan: Plan = {}
    _add_embedding_and_head(w, plan, arch, dtype)
    _add_hyper_connection(w, plan, arch, "hyper_connection_mixer", "hc_head", dtype, inject=False)
    for i, kind in enumerate(types):
        if kind == "full":
            add_gated_attention(w, plan, arch, i, dtype)
            _add_indexer(w, plan, arch, i, dtype)
        else:
            add_gdn(w, plan, arch, i, dtype)
        _add_hyper_connection(w, plan, arch, f"layers.{i}.attn_hyper_connection", layer(i, "attn_hc"), dtype)
        _add_hyper_connection(w, plan, arch, f"layers.{i}.mlp_hyper_connection", layer(i, "mlp_hc"), dtype)
        add_experts(w, plan, arch, i, dtype)
        add_shared_expert(w, plan, arch, i, dtype)
    if ple is not None:
        for p, i in enumerate(ple.layers):
            _add_ple(w, plan, arch, i, p, dtype)
    w.check_all_used()
    return arch, plan


# ---- config reading -----------------------------------------------------------------------------------------


def _text_config(top: dict, where: str) -> tuple[dict, tuple[str, ...]]:
    """The text model's config and the tensor prefixes to look under."""
    if top["model_type"] == "qwen4_exp_text":
        # transformers loads the text model from a multimodal checkpoint too (qwen3_5's PrefixChange conversion)
        return top, ("model.", "model.language_model.")
    text = top.get("text_config")
    if not isinstance(text, dict):
        raise ExportError(f"{where}: model_type qwen4_exp without a text_config")
    # NOTE: the wrapper's own tie_word_embeddings decides (HF ties lm_head by the top-level config)
    return {**text, "tie_word_embeddings": bool(top.get("tie_word_embeddings", False))}, ("model.language_model.",)


def _layer_types(cfg: dict, num_layers: int, where: str) -> list:
    """linear_attention -> linear; indexed_attention (and full_attention, which the config class renames to it:
    every attention layer has the indexer) -> full."""
    types = cfg.get("layer_types")
    if not types:
        interval = int(cfg["full_attention_interval"])
        types = ["linear_attention" if (i + 1) % interval else "indexed_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise ExportError(f"{where}: layer_types has {len(types)} entries for {num_layers} layers")
    for t in types:
        if t not in _LAYER_TYPES:
            raise ExportError(f"{where}: layer type '{t}' is not supported (supported: {', '.join(_LAYER_TYPES)})")
    return [_LAYER_TYPES[t] for t in types]


def _rope(cfg: dict, head_dim: int, where: str):
    """(theta, scaling, rotary_dim): rope_parameters (or 4.x's rope_theta / partial_rotary_factor / rope_scaling);
    partial_rotary_factor defaults to 1 here (Qwen4ExpTextRotaryEmbedding). M-RoPE's sections are ignored: with
    text positions (equal in all three) they reduce to plain rotary over rotary_dim."""
    entry = rope_entry(cfg)
    if entry is None:
        theta, factor, scaling = cfg.get("rope_theta", _DEFAULT_THETA), cfg.get("partial_rotary_factor", 1.0), \
            cfg.get("rope_scaling")
    else:
        theta = entry.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA))
        factor, scaling = entry.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)), entry
    rotary_dim = int(head_dim * float(factor))  # as transformers computes it
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ExportError(f"{where}: partial_rotary_factor={factor} gives {rotary_dim} rotary dims of {head_dim}: "
                          "not an even count within the head")
    scaling = parse_rope_scaling(scaling, int(cfg["max_position_embeddings"]), where)
    return float(theta), scaling, (None if rotary_dim == head_dim else rotary_dim)


def _indexer(cfg: dict, rotary_dim: int, has_attention: bool, where: str) -> IndexerConfig | None:
    values = {k: cfg.get(k) for k in _QSA}
    missing = [k for k, v in values.items() if v is None]
    if not has_attention and len(missing) == len(_QSA):
        return None  # only linear layers: no indexer anywhere
    if missing:
        # NOTE: transformers builds the indexer in every attention layer, so a config without it has no model
        raise ExportError(f"{where}: the QSA indexer fields are required for qwen4_exp's attention layers, missing "
                          f"{', '.join(missing)}")
    n_heads, kv_heads, head_dim, budget, ratio = (int(values[k]) for k in _QSA)
    if min(n_heads, kv_heads, head_dim, budget, ratio) <= 0:
        raise ExportError(f"{where}: QSA indexer fields must be positive: {values}")
    if kv_heads != 1:
        raise ExportError(f"{where}: indexer_kv_heads={kv_heads} is not supported (QSA has one key head)")
    if budget % ratio:
        raise ExportError(f"{where}: indexer_budget={budget} is not a multiple of indexer_compress_ratio={ratio}")
    if rotary_dim > head_dim:
        raise ExportError(f"{where}: {rotary_dim} rotary dims do not fit indexer_head_dim={head_dim}")
    return IndexerConfig(num_heads=n_heads, head_dim=head_dim, block_size=ratio, num_blocks=budget // ratio)


def _hyper_connections(cfg: dict, where: str) -> HyperConnectionConfig:
    count, rank = int(cfg["hc_count"]), int(cfg["hc_lowrank"])
    if count < 2 or rank < 1:
        raise ExportError(f"{where}: hc_count={count}, hc_lowrank={rank} is not supported (needs 2+ streams)")
    return HyperConnectionConfig(num_streams=count, rank=rank)


def _recurrent(cfg: dict, where: str) -> RecurrentConfig:
    heads, key_heads = int(cfg["linear_num_value_heads"]), int(cfg["linear_num_key_heads"])
    if key_heads <= 0 or heads % key_heads:
        raise ExportError(f"{where}: linear_num_value_heads={heads} is not a multiple of "
                          f"linear_num_key_heads={key_heads}")
    gate = cfg.get("output_gate_type") or cfg["hidden_act"]
    if gate not in ("silu", "sigmoid"):
        raise ExportError(f"{where}: output_gate_type '{gate}' is not supported (silu, sigmoid)")
    return RecurrentConfig(
        kind="gated_delta",
        num_heads=heads,
        num_key_heads=key_heads,
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg["linear_conv_kernel_dim"]),
        output_gate=gate,
    )


def _moe(cfg: dict, where: str) -> MoeConfig:
    num_experts, top_k = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= num_experts:
        raise ExportError(f"{where}: num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    shared = int(cfg["shared_expert_intermediate_size"])
    if shared <= 0 or int(cfg["moe_intermediate_size"]) <= 0:
        raise ExportError(f"{where}: moe_intermediate_size and shared_expert_intermediate_size must be > 0")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        shared_expert_intermediate_size=shared,
    )


# ---- PLE hash constants, as transformers derives them (modeling_qwen4_exp) ---------------------------------

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def ple_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """_build_layer_multipliers: ngram_size odd multipliers below int64's max // vocab_size."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base_seed = seed + 10007 * ple_index
    return [2 * (_splitmix64((base_seed + 0x9E3779B97F4A7C15 * (j + 1)) & _MASK64) % half_bound) + 1
            for j in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def ple_head_vocab_sizes(base: int, num_heads: int, ple_index: int) -> list[int]:
    """Head h of PLE layer p takes the (p * num_heads + h + 1)-th prime >= base (_find_nth_prime_after)."""
    primes, value = [], base - 1
    while len(primes) < (ple_index + 1) * num_heads:
        value += 1
        if _is_prime(value):
            primes.append(value)
    return primes[ple_index * num_heads :]


def _ple(cfg: dict, w: Weights, dims: dict, types: list, where: str) -> PleConfig | None:
    ids = sorted(set(cfg.get("ple_layer_ids") or []))
    if not ids:
        return None
    vocab_size = dims["vocab_size"]
    bad = [i for i in ids if not 1 <= i <= len(types) or types[i - 1] != "linear"]
    if bad:
        raise ExportError(f"{where}: ple_layer_ids {bad} are not one-indexed linear_attention layers")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise ExportError(f"{where}: PLE layers need an eos_token_id (the n-gram context resets after it)")
    ngram, per_ngram = int(cfg["ngram_size"]), int(cfg["heads_per_ngram"])
    embed_dim = int(cfg.get("ple_embed_dim") or dims["hidden_size"])
    num_heads = (ngram - 1) * per_ngram
    if num_heads <= 0 or embed_dim % num_heads:
        raise ExportError(f"{where}: ple_embed_dim={embed_dim} is not a multiple of the {num_heads} n-gram heads")
    kernel = int(cfg["ple_conv_kernel_size"])
    if kernel < 2:
        raise ExportError(f"{where}: ple_conv_kernel_size={kernel} is not supported (needs 2+ taps)")
    divisor = int(cfg["make_ngram_vocab_size_divisible_by"])
    multipliers, sizes, rows = [], [], []
    for p, i in enumerate(ids):
        src = f"layers.{i - 1}.ple.ple_embedding."
        mult = ple_multipliers(vocab_size, ngram, p, int(cfg["seed"]))
        size = ple_head_vocab_sizes(int(cfg["ngram_vocab_size_base"]), num_heads, p)
        # transformers loads its buffers from the checkpoint when it has them: those values rule
        if w.has(src + "layer_multipliers"):
            mult = w.take(src + "layer_multipliers", (ngram,)).load().tolist()
        if w.has(src + "ngram_heads_vocab_sizes"):
            size = w.take(src + "ngram_heads_vocab_sizes", (num_heads,)).load().tolist()
        offsets = [sum(size[:h]) for h in range(num_heads)]
        stored = w.take(src + "ngram_heads_offsets", (num_heads,)).load().tolist() \
            if w.has(src + "ngram_heads_offsets") else offsets
        if stored != offsets:
            raise ExportError(f"{where}: {src}ngram_heads_offsets are not the running sums of the head vocab sizes")
        if min(size) <= 0 or min(mult) <= 0 or max(mult) * max(vocab_size - 1, 1) >= 1 << 63:
            raise ExportError(f"{where}: {src} hash constants overflow int64")
        multipliers.append([int(m) for m in mult])
        sizes.append([int(s) for s in size])
        rows.append(math.ceil(sum(size) / divisor) * divisor)
    return PleConfig(layers=[i - 1 for i in ids], ngram_size=ngram, heads_per_ngram=per_ngram, embed_dim=embed_dim,
                     conv_kernel=kernel, reset_token_id=eos, multipliers=multipliers, head_vocab_sizes=sizes,
                     table_rows=rows)


# ---- tensor plans ---------------------------------------------------------------------------------------------


def _add_embedding_and_head(w: Weights, plan: Plan, arch: Architecture, dtype) -> None:
    """embed.weight and (untied only) lm_head.weight: no final norm (hc_head mixes the streams instead)."""
    v, h = arch.vocab_size, arch.hidden_size
    plan["embed.weight"] = load(w.take("embed_tokens.weight", (v, h)), dtype)
    if arch.tie_word_embeddings:
        if w.has("lm_head.weight", root=True):  # HF ties it anyway: the stored copy is never read
            w.skip("lm_head.weight", root=True)
    elif not w.has("lm_head.weight", root=True):
        raise ExportError(f"{w.identifier}: checkpoint lacks tensor 'lm_head.weight' (tie_word_embeddings=false)")
    else:
        plan["lm_head.weight"] = load(w.take("lm_head.weight", (v, h), root=True), dtype)


def _add_hyper_connection(w: Weights, plan: Plan, arch: Architecture, src: str, dst: str, dtype,
                          inject: bool = True) -> None:
    """dst.norm [S*H] (grouped per stream, shifted), dst.down [R, S*H], dst.up [S*H, R], dst.inject [S, S*H]."""
    hc = arch.hyper_connections
    width = hc.num_streams * arch.hidden_size
    add_norm(w, plan, f"{src}.hc_norm.weight", f"{dst}.norm.weight", arch, dtype, True, width)
    plan[f"{dst}.down.weight"] = load(w.take(f"{src}.input_mix_weight_down.weight", (hc.rank, width)), dtype)
    plan[f"{dst}.up.weight"] = load(w.take(f"{src}.input_mix_weight_up.weight", (width, hc.rank)), dtype)
    if inject:
        plan[f"{dst}.inject.weight"] = load(w.take(f"{src}.block_inject_weight.weight", (hc.num_streams, width)),
                                            dtype)


def _add_indexer(w: Weights, plan: Plan, arch: Architecture, i: int, dtype) -> None:
    """attn.indexer.qk [(Ni + 1)*Di, H] (rows: the query heads, then the key), attn.indexer.q_norm / k_norm [Di]."""
    ix, h = arch.indexer, arch.hidden_size
    src = f"layers.{i}.self_attn.indexer."
    rows = (ix.num_heads + 1) * ix.head_dim
    plan[layer(i, "attn.indexer.qk.weight")] = load(w.take(f"{src}index_qk_proj.weight", (rows, h)), dtype)
    for p in ("q", "k"):
        add_norm(w, plan, f"{src}{p}_layernorm.weight", layer(i, f"attn.indexer.{p}_norm.weight"), arch, dtype, True,
                 ix.head_dim)


def _add_ple(w: Weights, plan: Plan, arch: Architecture, i: int, p: int, dtype) -> None:
    """ple.embed [rows, Dh] (the checkpoint's shards concatenated), ple.key [S*H, E], ple.value [H, E], the grouped
    norms (shifted) and ple.conv [S*H, K]; the hash buffers went to the manifest."""
    ple, h = arch.ple, arch.hidden_size
    width = arch.hyper_connections.num_streams * h
    src = f"layers.{i}.ple."
    head_dim = ple.embed_dim // ((ple.ngram_size - 1) * ple.heads_per_ngram)
    table = _ngram_table(w, f"{src}ple_embedding.ngram_embedding", ple.table_rows[p], head_dim)
    plan[layer(i, "ple.embed.weight")] = lambda: cast(torch.cat([t.load() for t in table]), dtype)
    plan[layer(i, "ple.key.weight")] = load(w.take(f"{src}key_proj.weight", (width, ple.embed_dim)), dtype)
    plan[layer(i, "ple.value.weight")] = load(w.take(f"{src}value_proj.weight", (h, ple.embed_dim)), dtype)
    for name in ("key", "query", "conv"):
        add_norm(w, plan, f"{src}norm_{name}.weight", layer(i, f"ple.{name}_norm.weight"), arch, dtype, True, width)
    conv = w.take(f"{src}conv1d.weight", (width, 1, ple.conv_kernel))
    plan[layer(i, "ple.conv.weight")] = lambda: cast(conv.load().reshape(width, ple.conv_kernel), dtype)
    for buffer in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        w.skip(f"{src}ple_embedding.{buffer}")


def _ngram_table(w: Weights, name: str, rows: int, head_dim: int) -> list:
    """The table as one tensor (`name.weight`) or as the shards save_pretrained writes (`name.shard_<k>.weight`,
    concatenated along the rows in k order, as transformers' Concatenate loads them)."""
    if w.has(f"{name}.weight"):
        return [w.take(f"{name}.weight", (rows, head_dim))]
    pattern = re.compile(re.escape(w.prefix + name) + r"\.shard_(\d+)\.weight$")
    shards = sorted((int(m.group(1)), n) for n in w.tensors if (m := pattern.match(n)))
    if not shards:
        raise ExportError(f"{w.identifier}: checkpoint lacks tensor '{w.prefix}{name}.weight' (or its shards)")
    if [k for k, _ in shards] != list(range(len(shards))):
        raise ExportError(f"{w.identifier}: the shards of '{w.prefix}{name}' are not numbered 0..{len(shards) - 1}")
    parts = [w.take(n, (w.tensors[n].shape[0], head_dim), root=True) for _, n in shards]
    if sum(t.shape[0] for t in parts) != rows:
        raise ExportError(f"{w.identifier}: the shards of '{w.prefix}{name}' hold {sum(t.shape[0] for t in parts)} "
                          f"rows, the config implies {rows}")
    return parts


# ---- sizes ----------------------------------------------------------------------------------------------------


def layer_params(arch: Architecture, i: int, experts_read: int | None) -> int:
    """One layer's parameters (experts_read: the experts a token reads, None for all of them; a PLE table then
    counts the rows one token reads). NOTE: the last layer also counts hc_head, less the final norm the generic
    count assumes (ignition.archs.num_params / decode_weight_bytes): qwen4_exp has none."""
    h, moe, hc = arch.hidden_size, arch.moe, arch.hyper_connections
    width = hc.num_streams * h
    mix = width + 2 * hc.rank * width  # norm, down, up
    n = 2 * (mix + hc.num_streams * width)  # attn_hc and mlp_hc, each with its inject
    if arch.layer_types[i] == "linear":
        r = arch.recurrent
        value = r.num_heads * r.value_head_dim
        n += (r.conv_dim + value + 2 * r.num_heads) * h + r.conv_dim * r.conv_kernel + 2 * r.num_heads
        n += r.value_head_dim + h * value
    else:
        d, ix = arch.head_dim, arch.indexer
        n += (2 * arch.num_heads + 2 * arch.num_kv_heads) * d * h + h * arch.num_heads * d + 2 * d
        n += (ix.num_heads + 1) * ix.head_dim * h + 2 * ix.head_dim
    experts = moe.num_experts if experts_read is None else experts_read
    n += moe.num_experts * h + experts * 3 * h * moe.moe_intermediate_size  # router, experts
    n += 3 * h * moe.shared_expert_intermediate_size + h  # the shared expert and its gate
    ple = arch.ple
    if ple is not None and i in ple.layers:
        head_dim = ple.embed_dim // ((ple.ngram_size - 1) * ple.heads_per_ngram)
        rows = ple.table_rows[ple.layers.index(i)] if experts_read is None else ple.embed_dim // head_dim
        n += rows * head_dim + (width + h) * ple.embed_dim + 3 * width + width * ple.conv_kernel
    if i == arch.num_layers - 1:
        n += mix - h
    return n
