"""GEMV for small-batch decode projections: out[M, N] = x[M, K] @ weight[N, K]^T, float32 accumulation.

Built for batch-1..16 decode, where a projection is a pass over its weight. Each program owns BLOCK_N output
rows (and, with split-K, one K range) and streams its weight tile in BLOCK_K chunks, one chunk ahead in
registers. Under PDL (sm90) the first chunk is loaded before `pdl_wait`: no kernel writes a weight, so the
stream starts while the previous kernel (norm, rotary, attention) still runs. Split-K writes float32 partials
that a second kernel sums in a fixed order: no atomics, so results are bitwise reproducible run to run.
Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from helios.kernels._triton import (
    HAS_TRITON,
    cdiv,
    check_last_dim_contiguous,
    interpret_mode,
    jit,
    next_power_of_2,
    on_gpu,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    tanh,
    tl,
    use_pdl,
)

GATES = {None: 0, "silu": 1, "gelu_tanh": 2}

_TARGET_PROGRAMS = 264  # ~2 per SM of an H100/H200: below this, split K to fill the chip
# helios.models.llama's norm-free batch-1 layers send their wide one-row products (qkv, gate_up) and the lm_head
# here too, whatever the gemv switch admits (0: linear's choice, cuBLAS by default; benchmarks compare). NOTE: on
# measurement: 86.6-86.7% of the bandwidth limit against 83.3-83.7% with cuBLAS for them (H200, 2026-12-03)
NORM_FREE_WIDE = 1


class RowNorm(NamedTuple):
    """A one-row RMS statistic handed from the GEMV that wrote the row to the kernel that reads it, in place of
    a norm launch between them: float32 partial sums of the row's squares, one per program of the writer
    (gemv_add), summed by each reader in one fixed order: rstd = rsqrt(sum(partials) / dim + eps)."""

    partials: torch.Tensor  # [P] float32
    dim: int  # the row's length (the mean's divisor)
    eps: float


class GemvConfig(NamedTuple):
    block_n: int  # output rows per program (>= 16 when M > 4: those use tl.dot)
    block_k: int  # K elements per chunk (power of two)
    num_warps: int
    num_stages: int
    split_k: int  # K ranges per output tile; > 1 adds a float32 partial buffer and a reduce kernel


def default_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """A config that streams near bandwidth for the 8B-llama decode shapes; the benchmark sweeps others.

    M = 1, 16-bit: 8 rows x 1024 columns a chunk, the best or within 1 us of the best of benchmarks/gpu_gemv.py's
    sweep on the H200 for every 8B projection (2026-12-03: qkv 16.0 us, o 10.0, gate_up 57.0, down 29.4,
    lm_head 237.6; cuBLAS 15.8, 13.4, 62.7, 32.7, 251.7)."""
    block_k = 512 if dtype.itemsize <= 2 else 256  # 1 KB per row chunk: 16-byte loads, 64 threads a row
    if m == 1 and dtype.itemsize <= 2 and k >= 1024:
        block_k = 1024
    block_n = 8 if m <= 4 else 16
    num_tiles = cdiv(n, block_n)
    split_k = 1
    # NOTE: a row tile a SM or more goes unsplit: split-K costs a reduce launch, which a latency-bound batch-1 step
    # pays in full (qwen3_5_moe's [2048, 4096] out projections, 256 tiles: split in two, a launch a layer, before)
    while (num_tiles < _TARGET_PROGRAMS // 2 and num_tiles * split_k < _TARGET_PROGRAMS
           and k // (block_k * split_k * 2) >= 2):
        split_k *= 2
    return GemvConfig(block_n, block_k, 4, 1, split_k)


@jit
def _gated(gate, up, GATED: tl.constexpr):
    """act(gate) * up as helios.kernels.activation computes it: act in float32, rounded to the input dtype,
    times up, rounded again; so the fused down projection sees the very values of the two-kernel path."""
    g = gate.to(tl.float32)
    if GATED == 2:
        act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        act = g / (1.0 + tl.exp(-g))
    return (act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@jit
def _row(x_rows, r_rows, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual, added in float32 and rounded to x's dtype as torch's add does) at cols."""
    x = tl.load(x_rows + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_rows + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@jit
def times_rstd(x, rstd, ROW_SCALE: tl.constexpr):
    """x * rstd (a scalar) rounded back to x's dtype, with ROW_SCALE; x as is without."""
    if ROW_SCALE:
        x = (x.to(tl.float32) * rstd).to(x.dtype)
    return x


@jit
def row_rstd(partials_ptr, num_partials, dim, eps, P_BLOCK: tl.constexpr):
    """rsqrt(sum(partials) / dim + eps): a RowNorm's statistic, the partials summed in one fixed order."""
    p = tl.arange(0, P_BLOCK)
    parts = tl.load(partials_ptr + p, mask=p < num_partials, other=0.0)
    return tl.rsqrt(tl.sum(parts, axis=0) / dim + eps)


@jit
def _x_chunk(x_rows, r_rows, norm_w_ptr, cols, mask, K, rstd, GATED: tl.constexpr, NORM: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr, ROW_SCALE: tl.constexpr = False, row_scale=1.0):
    """The GEMV's input at cols ([1, BLOCK_K]): x, act(gate) * up, or the RMSNorm of x (+ residual) with the
    roundings of helios.kernels.rmsnorm (rstd [BLOCK_M] from the statistics pass). ROW_SCALE: x (gate and up)
    times rstd from a RowNorm first, rounded as the normed row's projection would be stored."""
    if NORM != 0:
        s = _row(x_rows, r_rows, cols, mask, HAS_RESIDUAL)
        h = s.to(tl.float32) * rstd[:, None]
        w = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        if NORM == 2:
            y = h * w
        else:
            y = h.to(s.dtype).to(tl.float32) * w
        x = y.to(s.dtype)
    else:
        x = times_rstd(tl.load(x_rows + cols, mask=mask, other=0.0), row_scale, ROW_SCALE)
        if GATED != 0:
            x = _gated(x, times_rstd(tl.load(x_rows + K + cols, mask=mask, other=0.0), row_scale, ROW_SCALE), GATED)
    return x


@jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N] contiguous
    M,
    N,
    K,
    k_per_split,  # multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,  # partials: stride between splits (0 when SPLIT_K == 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no row mask
    EVEN_K: tl.constexpr,  # every split's K range is whole BLOCK_K chunks inside K: no column mask
    USE_DOT: tl.constexpr,  # BLOCK_M >= 16: tensor-core dot; else broadcast-multiply in float32
    IEEE_DOT: tl.constexpr,  # float32 operands, full precision (not tf32)
    USE_PDL: tl.constexpr,
    GATED: tl.constexpr,  # 0: x as is; 1 / 2: x = silu / gelu_tanh(gate) * up of a [gate | up] row of 2K
    # RMSNorm of x (+ residual) folded in: 0 none; 1 llama's roundings; 2 gemma's (multiply in float32).
    # Each program reads the whole row once for the statistics (M = 1 only); program 0 writes x + residual.
    NORM: tl.constexpr = 0,
    HAS_RESIDUAL: tl.constexpr = False,
    K_POW2: tl.constexpr = 16,  # next power of two >= K (the statistics pass loads the row at once)
    res_ptr=None,  # [M, K], stride_xm apart like x
    norm_w_ptr=None,  # [K]
    res_out_ptr=None,  # [M, K] contiguous: x + residual
    eps=0.0,
    # ROW_SCALE: x (M = 1) times the rstd of a RowNorm (partials [num_partials] float32 over a row of norm_dim)
    ROW_SCALE: tl.constexpr = False,
    P_BLOCK: tl.constexpr = 1,  # next power of two >= num_partials
    partials_ptr=None,
    num_partials=1,
    norm_dim=1,
    # ADD_OUT (M = 1, no split-K): out = round(x @ w.T) + add, rounded as torch's add; each program also writes
    # the float32 sum of its out elements' squares to sq_ptr[pid_n] (the RowNorm of out)
    ADD_OUT: tl.constexpr = False,
    add_ptr=None,  # [1, N]
    sq_ptr=None,  # [cdiv(N, BLOCK_N)] float32
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # int64 row offsets: the lm_head's N * K nears 2^31
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]

    # Weights are constant: the first chunk is in flight before the wait on the previous kernel.
    if EVEN_N and EVEN_K:
        w_next = tl.load(w_rows + (k_begin + offs_k)[None, :])
    else:
        w_next = tl.load(w_rows + (k_begin + offs_k)[None, :],
                         mask=n_mask[:, None] & ((k_begin + offs_k) < k_end)[None, :], other=0.0)
    pdl_wait(USE_PDL)

    r_rows = x_rows
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_scale = 1.0
    if ROW_SCALE:  # a scalar: nothing of it stays live across the loop but one register
        row_scale = row_rstd(partials_ptr, num_partials, norm_dim, eps, P_BLOCK)
    if NORM != 0:
        # the statistics pass: the row as _rms_norm_kernel sees it (x + residual rounded to x's dtype)
        if HAS_RESIDUAL:
            r_rows = res_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        kk = tl.arange(0, K_POW2)[None, :]
        row_mask = m_mask[:, None] & (kk < K)
        s = _row(x_rows, r_rows, kk, row_mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            # program (0, 0) only; as a tile: a scalar mask term trips the interpreter
            first = (tl.zeros([BLOCK_M, K_POW2], dtype=tl.int32) + pid_n + pid_k) == 0
            tl.store(res_out_ptr + offs_m.to(tl.int64)[:, None] * K + kk, s, mask=row_mask & first)
        h = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / K + eps)

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced over K once, after the loop
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        w = w_next
        cols = k + offs_k
        nxt = cols + BLOCK_K
        # one chunk ahead; past the range the mask drops the load (a scalar mask keeps 16-byte vectors)
        if EVEN_N and EVEN_K:
            has_next = tl.full([BLOCK_N, BLOCK_K], 1, tl.int1) & (k + BLOCK_K < k_end)
            w_next = tl.load(w_rows + nxt[None, :], mask=has_next, other=0.0)
            x = _x_chunk(x_rows, r_rows, norm_w_ptr, cols[None, :], m_mask[:, None], K, rstd, GATED, NORM,
                         HAS_RESIDUAL, ROW_SCALE, row_scale)
        else:
            w_next = tl.load(w_rows + nxt[None, :], mask=n_mask[:, None] & (nxt < k_end)[None, :], other=0.0)
            x_mask = m_mask[:, None] & (cols < k_end)[None, :]
            x = _x_chunk(x_rows, r_rows, norm_w_ptr, cols[None, :], x_mask, K, rstd, GATED, NORM, HAS_RESIDUAL,
                         ROW_SCALE, row_scale)
        if USE_DOT:
            if IEEE_DOT:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        elif BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
        else:
            prod = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
            acc += tl.sum(prod, axis=2)
    pdl_launch_dependents(USE_PDL)

    if BLOCK_M == 1:
        result = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    else:
        result = acc
    out_ptrs = out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    result = result.to(out_ptr.dtype.element_ty)
    if ADD_OUT:
        # NOTE: loaded after the loop: held across it, the tile cost 38 registers (128 -> 166 a thread on sm90,
        # 3 programs an SM instead of 4: the 512 programs of o / down no longer fit one wave)
        added = tl.load(add_ptr + offs_n[None, :], mask=n_mask[None, :], other=0.0).to(tl.float32)
        result = (result.to(tl.float32) + added).to(out_ptr.dtype.element_ty)
        y = tl.where(n_mask[None, :], result.to(tl.float32), 0.0)
        tl.store(sq_ptr + pid_n, tl.sum(tl.sum(y * y, axis=1), axis=0))
    tl.store(out_ptrs, result, mask=m_mask[:, None] & n_mask[None, :])


@jit
def _split_k_reduce_kernel(
    partial_ptr,  # [SPLIT_K, M, N] float32 contiguous
    out_ptr,  # [M, N]
    N,
    stride_om,
    stride_ps,  # M * N
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits on every run
        acc += tl.load(partial_ptr + s * stride_ps + m * N + offs, mask=mask, other=0.0)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv(
    x: torch.Tensor,  # [M, K], small M (decode); rows may be strided
    weight: torch.Tensor,  # [N, K] (torch Linear orientation), same dtype as x
    out: torch.Tensor | None = None,  # [M, N], x.dtype, last dim contiguous
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    gated: str | None = None,
    norm: tuple | None = None,
    row_norm: RowNorm | None = None,
    add: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    allow_pdl: bool = True,
) -> torch.Tensor:  # [M, N]
    """x @ weight.T with float32 accumulation and one rounding; unset tile arguments take default_config.

    gated="silu" | "gelu_tanh": x is a [M, 2K] row of [gate | up] and the product is act(gate) * up @ weight.T,
    the activation computed as the GEMV reads x (the down projection with helios.kernels.activation folded in).
    norm: see gemv_add_rms_norm; row_norm, add and sums: see gemv_add. allow_pdl=False (the gemv_pdl switch,
    helios.switches): the launch waits for the kernel before it even where use_pdl would let it start early."""
    require_triton()
    assert x.dim() == 2 and weight.dim() == 2, f"expected x [M, K], weight [N, K]: {tuple(x.shape)}, {tuple(weight.shape)}"
    m, k = x.shape
    if gated is not None:
        assert k % 2 == 0, f"a gated x is [M, 2K] ([gate | up]), got {tuple(x.shape)}"
        k //= 2
    n = weight.shape[0]
    assert weight.shape[1] == k, f"weight {tuple(weight.shape)} does not match K = {k}"
    assert weight.dtype == x.dtype, f"dtype mismatch: x {x.dtype}, weight {weight.dtype}"
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype, f"out must be [{m}, {n}] {x.dtype}"
    check_last_dim_contiguous("out", out)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()

    cfg = default_config(m, n, k, x.dtype)
    block_k = block_k or cfg.block_k
    num_warps = num_warps or cfg.num_warps
    num_stages = num_stages or cfg.num_stages
    use_dot = m > 4
    block_m = 16 if use_dot else next_power_of_2(m)
    block_n = block_n or cfg.block_n
    if use_dot:
        block_n = max(block_n, 16)  # tl.dot needs 16 along every dimension
        block_k = max(block_k, 16)
    assert block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0, "block sizes must be powers of two"
    split_k = max(1, min(split_k or cfg.split_k, cdiv(k, block_k)))
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k
    split_k = cdiv(k, k_per_split)  # no empty splits
    even_k = k % k_per_split == 0
    norm_args = {}
    if norm is not None:
        residual, norm_weight, eps, in_float32, residual_out = norm
        assert m == 1 and gated is None, "the folded RMSNorm takes one plain row"
        assert norm_weight.shape == (k,) and norm_weight.is_contiguous()
        if residual is not None:
            assert residual.shape == x.shape and residual.stride() == x.stride() and residual.dtype == x.dtype
            assert residual_out.shape == x.shape and residual_out.is_contiguous()
        norm_args = dict(NORM=2 if in_float32 else 1, HAS_RESIDUAL=residual is not None, K_POW2=next_power_of_2(k),
                         res_ptr=residual, norm_w_ptr=norm_weight, res_out_ptr=residual_out, eps=eps)
    if row_norm is not None:
        assert m == 1 and norm is None, "a RowNorm scales one plain row"
        partials = row_norm.partials
        assert partials.dtype == torch.float32 and partials.dim() == 1 and partials.is_contiguous()
        norm_args.update(ROW_SCALE=True, P_BLOCK=next_power_of_2(partials.numel()), partials_ptr=partials,
                         num_partials=partials.numel(), norm_dim=row_norm.dim, eps=row_norm.eps)
    if add is not None:
        assert m == 1 and split_k == 1 and norm is None, "the add rides in a one-row GEMV without split-K"
        assert sums is not None and sums.shape == (cdiv(n, block_n),) and sums.dtype == torch.float32
        norm_args.update(ADD_OUT=True, add_ptr=add, sq_ptr=sums)

    # NOTE: ptxas gave the add / row-scale forms 166 registers a thread (the plain GEMV 128): 3 programs of 4 warps
    # an SM instead of 4, so o / down's 512 programs took two waves; capped, they keep 4 (no spills on sm90)
    occupancy = dict(maxnreg=128) if (add is not None or row_norm is not None) and num_warps == 4 else {}
    pdl = allow_pdl and use_pdl(x, m)
    grid = (cdiv(n, block_n), split_k, cdiv(m, block_m))
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[grid](
        x,
        weight,
        target,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        target.stride(-2),
        0 if split_k == 1 else target.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=n % block_n == 0,
        EVEN_K=even_k,
        USE_DOT=use_dot,
        # NOTE: Triton's interpreter (3.9) returns garbage from a bfloat16 tl.dot; it takes the float32 dot
        IEEE_DOT=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpret_mode()),
        USE_PDL=pdl,
        GATED=GATES[gated],
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        **norm_args,
        **occupancy,
    )
    if split_k > 1:
        block = min(1024, next_power_of_2(n))
        _split_k_reduce_kernel[(m, cdiv(n, block))](
            target, out, n, out.stride(0), m * n, SPLIT_K=split_k, BLOCK=block, USE_PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )
    return out


def num_partials(n: int, k: int, dtype: torch.dtype = torch.bfloat16, block_n: int | None = None) -> int:
    """The RowNorm partials gemv_add writes for an output row of n ([N, K] weight; default tiles unless block_n):
    one a program."""
    return cdiv(n, block_n or default_config(1, n, k, dtype).block_n)


def gemv_add(
    x: torch.Tensor,  # [1, K] ([1, 2K] gated)
    weight: torch.Tensor,  # [N, K]
    add: torch.Tensor,  # [1, N], same dtype: the residual stream
    *,
    gated: str | None = None,
    row_norm: RowNorm | None = None,  # x's own statistic: x (gate and up) is scaled by its rstd as it is read
    **config,  # tile arguments of gemv (split_k is always 1)
) -> tuple[torch.Tensor, torch.Tensor]:  # (x @ weight.T + add [1, N], the partials of its RowNorm, float32)
    """A one-row projection that adds its product to the residual stream and hands the sum's RMS statistic on
    as RowNorm partials, one per program (helios.models.llama's norm-free decode layer): the next projection's
    reader scales by rstd, so no norm kernel runs between them. The add rounds as torch's `x @ weight.T + add`
    in x's dtype; with row_norm, x is first multiplied by its rstd and rounded (the values a norm kernel's
    output times weight would give when the norm weight is folded into the projection before x:
    helios.runner.norm_folding.fold_norm_weights)."""
    assert x.shape[0] == 1 and add.shape == (1, weight.shape[0]) and add.dtype == x.dtype, (
        f"gemv_add takes one row: x {tuple(x.shape)}, add {tuple(add.shape)}")
    n, k = weight.shape
    assert k > 0, "an empty product"
    check_last_dim_contiguous("add", add)
    config["split_k"] = 1
    sums = torch.empty(num_partials(n, k, x.dtype, config.get("block_n")), dtype=torch.float32, device=x.device)
    return gemv(x, weight, gated=gated, row_norm=row_norm, add=add, sums=sums, **config), sums


def gemv_add_rms_norm(
    x: torch.Tensor,  # [1, K]
    residual: torch.Tensor | None,  # [1, K] or None (the first layer: no add)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    multiply_in_float32: bool = False,
    **config,  # tile arguments of gemv
) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(x + residual) @ weight.T [1, N], x + residual [1, K])
    """helios.kernels.rmsnorm.fused_add_rms_norm followed by the GEMV, in one launch: every program computes the
    row's statistics itself (the row is 8 KB at K = 4096, read from L2) and normalizes each chunk as it reads it,
    with the norm kernel's roundings; program 0 writes x + residual for the next layer's add."""
    residual_out = torch.empty_like(x) if residual is not None else x
    out = gemv(x, weight, norm=(residual, norm_weight, eps, multiply_in_float32, residual_out), **config)
    return out, residual_out


def gemv_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether one-row products of `dtype` on `device` can take the GEMV at all: 16-bit, on a GPU, with compiled
    (not interpreted) Triton kernels. Read once per model (helios.layers.linear.one_row_gemv)."""
    return (on_gpu(torch.device(device)) and dtype in (torch.bfloat16, torch.float16) and HAS_TRITON
            and not interpret_mode())


def gemv_serves(x: torch.Tensor, weight: torch.Tensor, mode: str) -> bool:
    """Whether `helios.layers.linear` sends this product here: one row (batch-1 decode), 16-bit, on a GPU
    with compiled Triton kernels, and the weight's shape admitted by `mode` (the gemv switch, helios.switches:
    gemv_admits). At M = 4 and 16 the GEMV lost to cuBLAS (28-50% of copy bandwidth against cuBLAS's 58-97%),
    so those stay on cuBLAS."""
    if not (
        x.dim() == 2
        and x.shape[0] == 1
        and on_gpu(x)  # CUDA (or meta while helios.kernels.aot traces a model)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.is_contiguous()
    ):
        return False  # NOTE: first: every CPU projection asks
    return HAS_TRITON and not interpret_mode() and gemv_admits(mode, *weight.shape)


# a one-row product with a weight of at most this many elements (8 MiB in 16 bits) is read in about a launch's own
# latency, so narrow and nowide send it to the GEMV however wide it is: one launch that can take PDL, and for a down
# projection the gated activation folded in, against cuBLAS's launch after a separate activation kernel (the MoE
# shared experts' down [2048, 512] of qwen3_5_moe / qwen3_next: two launches a layer fewer at batch 1)
GEMV_SMALL = 4 << 20


def gemv_admits(mode: str, rows: int, cols: int) -> bool:
    """Whether the gemv switch's `mode` sends a one-row product with a [rows, cols] weight to the GEMV: "narrow"
    (the default) the weights with no more rows than columns (o and down of a llama layer, down with the gated
    activation folded in); "all" every one; "square" only square weights (o); "nowide" all but weights with 4x
    more rows than columns (qkv with its norm folded, o, down); "off" none (cuBLAS). narrow and nowide also take
    every weight of at most GEMV_SMALL elements.

    NOTE: narrow by default on measurement: a b=1 decode step of an 8B llama through the engine ran at
    83.0-83.3% of the bandwidth limit with narrow (and PDL off), 80.2-80.4% all on cuBLAS, 82.1-82.7% nowide
    (H200, 2026-12-03, benchmarks/RESULTS.md): alone the GEMV beats cuBLAS on o and down (10.0 vs 12.3 us
    with cuBLAS's split-K reduce, 29.0 vs 30.6), cuBLAS wins the wide gate_up (55.1 vs 57.0)."""
    if mode in ("narrow", "nowide") and rows * cols <= GEMV_SMALL:
        return True
    if mode == "nowide":
        return rows < 4 * cols
    return mode == "all" or (mode == "narrow" and rows <= cols) or (mode == "square" and rows == cols)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, gated: str | None = None) -> torch.Tensor:
    """F.linear in float32, one rounding to x.dtype; gated: x = act(gate) * up in x.dtype first."""
    if gated is not None:
        from helios.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref

        x = (gelu_tanh_and_mul_ref if gated == "gelu_tanh" else silu_and_mul_ref)(x)
    return F.linear(x.to(torch.float32), weight.to(torch.float32)).to(x.dtype)


def gemv_add_ref(x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor, gated: str | None = None,
                 row_norm: RowNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv_add in torch: x (times its rstd, rounded) through gemv_ref, plus add; the sum of its squares [1]."""
    if row_norm is not None:
        x = times_rstd_ref(x, row_norm)
    out = gemv_ref(x, weight, gated) + add
    return out, out.float().square().sum().reshape(1)


def times_rstd_ref(x: torch.Tensor, row_norm: RowNorm) -> torch.Tensor:
    """x times a RowNorm's rstd (float32), rounded back to x's dtype: what times_rstd does as a kernel reads x."""
    rstd = torch.rsqrt(row_norm.partials.sum() / row_norm.dim + row_norm.eps)
    return (x.float() * rstd).to(x.dtype)
