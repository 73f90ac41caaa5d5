"""What the runtime path of a core launches: the shape of its kernels (KernelShape, read from the manifest's
arch and graph plan), the decode split rule graphs pin, and `run_launchers`, which calls each launcher once per
variant so that helios.kernels.aot can compile them ahead of time or load them at start.
Imports torch and helios.kernels (the launchers, lazily).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from helios.kernels.paged_attention import choose_num_splits

# streaming multiprocessors assumed per target when pinning graph splits ahead of time (H100 SXM / H200)
TARGET_SMS = {90: 132, 100: 148, 80: 108}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def graph_decode_splits(bucket: int, num_kv_heads: int, max_model_len: int, num_sms: int = 132) -> int:
    """The decode split count a graph of `bucket` rows pins: sized for the longest sequence it may see.
    One rule for capture (helios.runner.cuda_graphs) and for the kernels compiled ahead of time."""
    return choose_num_splits(max_model_len, bucket, num_kv_heads, num_sms)


# programs a decode graph's short-sequence variant aims for: splits = cdiv(SHORT_PROGRAMS, rows x kv heads), at most
# SHORT_SPLITS_MAX (with the merge inside decode_qkv's launch, a split costs no extra launch)
SHORT_PROGRAMS = 64
SHORT_SPLITS_MAX = 8


def short_decode_splits(bucket: int, num_kv_heads: int, programs: int = SHORT_PROGRAMS) -> int:
    """The decode split count of a graph of `bucket` rows replayed while every sequence is short (helios.runner.
    cuda_graphs.SHORT_SEQ_LEN keys or fewer): 1 for buckets that fill `programs` (seq, kv head) programs already."""
    if programs <= 0:
        return 1
    return max(1, min(SHORT_SPLITS_MAX, -(-programs // max(1, bucket * num_kv_heads))))


def parse_target(target: str) -> int:
    """'cuda-sm90' -> 90 (the GPUTarget arch)."""
    m = re.fullmatch(r"cuda-sm(\d+)", target)
    if not m:
        raise ValueError(f"unknown kernel target {target!r} (expected cuda-sm<NN>, e.g. cuda-sm90)")
    return int(m.group(1))


def device_target(device: torch.device | str) -> str:
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"cuda-sm{major}{minor}"


# --- what the runtime launches ------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelShape:
    """Everything the runtime path's kernels of one model specialize on."""

    dtype: torch.dtype
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layer_kinds: tuple[tuple[int | None, float | None], ...]  # distinct (sliding window, soft-cap)
    decode_splits: tuple[int, ...]
    qk_norm: bool = False
    norm_in_float32: bool = False  # gemma's order of the q/k norm multiply
    activation: str = "silu"
    # (out, in) of each projection batch-1 decode sends to the GEMV (helios.kernels.gemv.gemv_serves)
    projections: tuple[tuple[int, int], ...] = ()
    projections_ffn: int = 0  # the MLP's intermediate size: its down GEMV also runs gated
    # (out, in) of the GEMVs that take their layer's add + RMSNorm (helios.models.llama: DecoderLayer.fold_*_norm)
    norm_projections: tuple[tuple[int, int], ...] = ()
    vocab_size: int = 0  # the sampling tail's rows (greedy argmax); 0: not launched
    # decode attention: "fused" from the qkv row (decode_qkv), "split" after rotary_cache (paged_attention); a core
    # compiles both, a process loads the one its fused_decode switch picks (head_dim < 32 always takes "split")
    decode_paths: tuple[str, ...] = ("fused", "split")
    cache_write: bool = True  # the unfused cache write (backends without fused layers); never loaded at start
    # batch-1 decode without norm kernels (helios.models.llama: the "norm_free" path): the o / down GEMVs that add into
    # the stream, the down GEMV and decode attention that scale by the stream's rstd, the embedding's statistic
    norm_free: bool = False
    plain_down: bool = True  # the gated down GEMV without the add (every batch-1 path but the norm-free one)


def shape_from_manifest(manifest, num_sms: int = 132) -> KernelShape:
    arch, plan = manifest.arch, manifest.graph_plan
    kinds = set()
    for i in range(arch.num_layers):
        sliding = bool(arch.layer_types) and arch.layer_types[i] == "sliding"
        kinds.add((arch.sliding_window if sliding else None, arch.attn_logit_softcapping))
    context = manifest.limits.context_length
    splits = {1} | {graph_decode_splits(b, arch.num_kv_heads, context, num_sms) for b in plan.decode_buckets}
    if arch.head_dim >= 32:  # the short graphs split only where decode_qkv merges in its launch
        splits |= {short_decode_splits(b, arch.num_kv_heads) for b in plan.decode_buckets}
    is_gemma = arch.family == "gemma3"
    h, q_width = arch.hidden_size, arch.num_heads * arch.head_dim
    ffn = arch.moe.moe_intermediate_size if arch.moe else arch.intermediate_size
    qkv = ((arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim, h)
    projections = {qkv, (h, q_width), (2 * ffn, h), (h, ffn), (arch.vocab_size, h)}
    norm_projections = ()
    sixteen_bit = _DTYPES[manifest.dtype].itemsize == 2
    if not is_gemma and sixteen_bit:  # llama-family layers fold their norms
        norm_projections = (qkv,) if arch.moe else tuple(sorted({qkv, (2 * arch.intermediate_size, h)}))
    # helios.runner.norm_folding.fold_norm_weights: plain gated MLPs, no qkv bias
    norm_free = not is_gemma and sixteen_bit and not arch.moe and not arch.attention_bias
    return KernelShape(
        dtype=_DTYPES[manifest.dtype],
        hidden_size=arch.hidden_size,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        page_size=plan.page_size,
        layer_kinds=tuple(sorted(kinds, key=repr)),
        decode_splits=tuple(sorted(splits)),
        qk_norm=arch.qk_norm or is_gemma,
        norm_in_float32=is_gemma,
        activation=arch.hidden_act,
        projections=tuple(sorted(projections)) if _DTYPES[manifest.dtype].itemsize == 2 else (),
        projections_ffn=ffn,
        norm_projections=norm_projections,
        norm_free=norm_free,
        vocab_size=arch.vocab_size,
    )


def runtime_shape(shape: KernelShape, gemv: str, fused_decode: bool = True, defer_norms: bool = True) -> KernelShape:
    """The part of `shape` this process launches under its switches (helios.switches, passed in): the GEMV shapes
    only as `gemv` admits them, one decode attention path (fused_decode), the norm-free layers only with
    defer_norms, no unfused cache write (a core compiles them all, so that every switch serves without
    compiling; loading the unused ones costs start-up)."""
    from helios.kernels import gemv as gemv_module
    from helios.kernels.gemv import gemv_admits

    mode, fused = gemv, fused_decode
    # the norm-free layers take the GEMV for o and down (helios.models.llama's norm-free path) and decode_qkv
    norm_free = (shape.norm_free and fused and defer_norms and shape.head_dim >= 32
                 and gemv_admits(mode, shape.hidden_size, shape.num_heads * shape.head_dim)
                 and gemv_admits(mode, shape.hidden_size, shape.projections_ffn))
    shape = replace(shape, decode_paths=("fused",) if fused else ("split",), cache_write=False, norm_free=norm_free)
    if mode == "all":
        return shape
    # narrow / square / nowide: the admitted shapes only (every one on the norm-free path, gemv.NORM_FREE_WIDE); a
    # norm folds only into an admitted one (helios.models.llama)
    wide = norm_free and gemv_module.NORM_FREE_WIDE
    projections = tuple(p for p in shape.projections if wide or gemv_admits(mode, *p))
    if norm_free:  # its o and down GEMVs are gemv_add's: the plain forms never launch at batch 1
        h = shape.hidden_size
        projections = tuple(p for p in projections if p not in ((h, shape.num_heads * shape.head_dim),
                                                                 (h, shape.projections_ffn)))
    return replace(shape, projections=projections, plain_down=not norm_free,
                   norm_projections=tuple(p for p in shape.norm_projections if gemv_admits(mode, *p)))


def run_launchers(shape: KernelShape, device: torch.device | str = "cpu", pdl: bool | None = None) -> None:
    """Call every launcher of the runtime path once per variant, on small tensors that mirror the runtime
    layouts: the norms on [T, hidden] rows, rotary + cache write on the fused qkv output, the gated activation
    on [T, 2F] (F a multiple of 16, as the intermediate sizes served are), attention on q [T, Nq, D] and the
    cache one [2, pages, page, Nkv, D] tensor, block tables 16 wide (runner/input_batch pads them so).
    Outputs are garbage: only which kernels get launched (and so compiled or loaded) matters. A norm-free shape's
    one-row launches are those of helios.models.llama's norm-free step, which runs in pdl_scope: so do they here.
    pdl: the pdl switch (helios.switches): None scopes PDL to the norm-free step, True / False every one-row launch
    or none, as the model's forwards do."""
    from helios.kernels._triton import pdl_scope

    with pdl_scope(shape.norm_free if pdl is None else pdl):
        _launch_all(shape, device)


def _launch_all(shape: KernelShape, device) -> None:
    from helios.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from helios.kernels.decode_qkv import decode_attention_qkv
    from helios.kernels.gemv import gemv, gemv_add_rms_norm
    from helios.kernels.paged_attention import paged_decode_attention
    from helios.kernels.prefill_attention import paged_prefill_attention
    from helios.kernels.reshape_and_cache import reshape_and_cache
    from helios.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    from helios.kernels.rotary_cache import rotary_and_cache
    from helios.kernels.sampling import argmax_rows, exponential_log_noise

    nq, nkv, d, dt = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype
    scale = d**-0.5
    z = dict(dtype=dt, device=device)
    for n, k in shape.projections:  # batch-1 GEMVs: full-size (uninitialized) weights, as the tile choice reads N, K
        gemv(torch.zeros(1, k, **z), torch.empty(n, k, **z))
    for n, k in shape.norm_projections:  # the first layer's (no residual) and every other layer's
        x, weight, norm = torch.zeros(1, k, **z), torch.empty(n, k, **z), torch.ones(k, **z)
        gemv_add_rms_norm(x, None, norm, 1e-6, weight)
        gemv_add_rms_norm(x, x.clone(), norm, 1e-6, weight)
    if shape.projections and shape.plain_down:  # down with the gated activation folded in (helios.layers.activation)
        ffn = shape.projections_ffn
        gemv(torch.zeros(1, 2 * ffn, **z), torch.empty(shape.hidden_size, ffn, **z), gated=shape.activation)
    if shape.norm_free and shape.projections and "fused" in shape.decode_paths and d >= 32:
        _norm_free_launchers(shape, device)
    if shape.vocab_size:  # the sampler's argmax (helios.runner.sampler) over float32 logits, and its noise
        argmax_rows(torch.zeros(1, shape.vocab_size, dtype=torch.float32, device=device))
        ids = torch.zeros(1, dtype=torch.int64, device=device)
        exponential_log_noise(ids, ids.clone(), shape.vocab_size)
    for num_tokens in (1, 2):  # decode rows, then a two-token prefill
        x = torch.zeros(num_tokens, shape.hidden_size, **z)
        weight = torch.ones(shape.hidden_size, **z)
        rms_norm(x, weight, 1e-6, shape.norm_in_float32)  # gemma's norms multiply in float32
        fused_add_rms_norm(x, x.clone(), weight, 1e-6, shape.norm_in_float32)
        act = gelu_tanh_and_mul if shape.activation == "gelu_tanh" else silu_and_mul
        act(torch.zeros(num_tokens, 2 * 64, **z))
        qkv = torch.zeros(num_tokens, (nq + 2 * nkv) * d, **z)
        cos = torch.ones(num_tokens, d, **z)
        kv_cache = torch.zeros(2, 4, shape.page_size, nkv, d, **z)
        slots = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        norms = (torch.ones(d, **z), torch.ones(d, **z)) if shape.qk_norm else (None, None)
        q = rotary_and_cache(qkv, cos, cos, kv_cache, slots, nq, *norms, 1e-6, shape.norm_in_float32)
        if shape.cache_write:  # the unfused path (k, v views of the qkv output)
            _, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
            reshape_and_cache(k.reshape(num_tokens, nkv, d), v.reshape(num_tokens, nkv, d), kv_cache, slots)
        block_tables = torch.zeros(1, 16, dtype=torch.int32, device=device)
        seq_lens = torch.full((1,), num_tokens, dtype=torch.int32, device=device)
        # decode of num_tokens sequences (one query each): one sequence launches with PDL, more without
        decode_tables = torch.zeros(num_tokens, 16, dtype=torch.int32, device=device)
        decode_lens = torch.ones(num_tokens, dtype=torch.int32, device=device)
        for window, softcap in shape.layer_kinds:
            for splits in shape.decode_splits:
                if "split" in shape.decode_paths or d < 32:
                    paged_decode_attention(q, kv_cache, decode_tables, decode_lens, scale, window, softcap, splits)
                if "fused" in shape.decode_paths and d >= 32:  # decode from the qkv row (backend.forward_qkv)
                    decode_attention_qkv(qkv, cos, cos, kv_cache, slots, decode_tables, decode_lens, nq, scale, window,
                                         softcap, *norms, 1e-6, shape.norm_in_float32, num_splits=splits)
            if num_tokens > 1:
                qsl = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
                paged_prefill_attention(q, kv_cache, qsl, seq_lens, block_tables, num_tokens, scale, window, softcap)


def _norm_free_launchers(shape: KernelShape, device) -> None:
    """The launches of helios.models.llama's norm-free batch-1 layer, with the runtime's partial count (the o /
    down GEMVs' one per program, which the embedding's statistic copies: each reader's load is sized at compile)."""
    from helios.kernels.decode_qkv import decode_attention_qkv
    from helios.kernels.gemv import RowNorm, gemv_add, num_partials
    from helios.kernels.rmsnorm import row_sum_squares

    nq, nkv, d, h, ffn = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size, shape.projections_ffn
    z = dict(dtype=shape.dtype, device=device)
    stream = torch.zeros(1, h, **z)
    first = row_sum_squares(stream, num_partials(h, nq * d, shape.dtype))
    _, partials = gemv_add(torch.zeros(1, nq * d, **z), torch.empty(h, nq * d, **z), stream)
    assert first.shape == partials.shape, "one decode variant reads both"
    gemv_add(torch.zeros(1, 2 * ffn, **z), torch.empty(h, ffn, **z), stream, gated=shape.activation,
             row_norm=RowNorm(partials, h, 1e-6))
    qkv = torch.zeros(1, (nq + 2 * nkv) * d, **z)
    cos = torch.ones(1, d, **z)
    kv_cache = torch.zeros(2, 4, shape.page_size, nkv, d, **z)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    tables = torch.zeros(1, 16, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    norms = (torch.ones(d, **z), torch.ones(d, **z)) if shape.qk_norm else (None, None)
    for window, softcap in shape.layer_kinds:
        for splits in shape.decode_splits:
            decode_attention_qkv(qkv, cos, cos, kv_cache, slots, tables, lens, nq, d**-0.5, window, softcap, *norms,
                                 1e-6, shape.norm_in_float32, num_splits=splits, row_norm=RowNorm(partials, h, 1e-6))
