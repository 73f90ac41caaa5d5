"""The gated delta rule (GDN) layers of qwen3_5-style hybrid models on the GPU: the slot-indexed decode step, the
varlen causal conv, and the chunked prefill through flash-linear-attention (fla-core, imported on first use only).

Batch layout (helios.layers.recurrent's contract; these are drop-in equivalents of its torch ops): T tokens of B
sequences flattened, sequence i owns rows query_start_loc[i]:query_start_loc[i+1], its first row sits at absolute
position starts[i] (0 = fresh: its state counts as zero and the slot's memory is never read), slots[i] is the row of
the state tensors it reads and updates in place. Conv state [S, K-1, C]: the last K-1 conv inputs, oldest first.
Recurrent state [S, Hv, dk, dv] float32. Value head h reads key head h // (Hv // Hk).
Decode (gated_delta_decode, and gated_delta_rule when T == B) is CUDA-graph safe: device int32 slots/starts, no host
sync, a grid fixed by the shapes (its split count from decode_splits, pinned per bucket); padded rows may share a
scratch slot, which only they touch. Prefill (T > B) calls fla and is not graph-safe.
Imports torch, helios.kernels._triton and (lazily, prefill only) fla; nothing else.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import (
    COUNTER_SLOTS,
    arrival_counters,
    check_last_dim_contiguous,
    jit,
    next_power_of_2,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    sm_count,
    tl,
    use_pdl,
)

L2_EPS = 1e-6  # q/k l2norm (transformers' l2norm and fla's: x * rsqrt(sum x^2 + eps))
CONV_BLOCK_C = 128  # the prompt conv's column tile (at most)
# value columns per state tile ([dk, BLOCK_V] float32 in registers), by the key width alone: a row's bits then never
# depend on its batch (the split count only shares out whole tiles). H100, qwen3_5's 16 / 32 heads of 128
# (benchmarks/gpu_gated_delta.py --value-heads 32, us a layer, 32 -> 64 columns): b=1 6.5 -> 6.8, b=32 59.4 -> 60.9,
# b=64 129.4 -> 106.8 (68.6% -> 83.0% of the copy bandwidth), b=256 435.9 -> 401.4; wider keys keep 32 (registers)
BLOCK_V = 64
BLOCK_V_WIDE_KEYS = 32  # dk > 128


def block_v(dk: int, dv: int, columns: int | None = None) -> int:
    """The state tile's value columns for key width dk (a power of two, at most dv's next power of two); `columns`
    instead of this kernel's choice (helios.kernels.kda's step keeps 32: its folds hold more registers)."""
    return min(columns or (BLOCK_V if dk <= 128 else BLOCK_V_WIDE_KEYS), next_power_of_2(dv))


NUM_WARPS = 4
NUM_STAGES = 3  # the tile loop's software pipelining (Triton's default)
# the fused step loads each state tile before its conv (overlapping the two, at twice the registers) or after
STATE_FIRST = False


# --- decode: one token per sequence, one launch per layer -------------------------------------------------------


@jit
def _softplus(x):
    """torch.nn.functional.softplus (threshold 20), with log1p's accuracy for small exp(x)."""
    e = tl.exp(tl.minimum(x, 20.0))
    log1p = tl.where(e < 1e-4, e * (1.0 - 0.5 * e), tl.log(1.0 + e))
    return tl.where(x > 20.0, x, log1p)


@jit
def _softplus_kimi(x):
    """kimi's softplus: log(1 + exp(x)), x itself above 20 (helios.layers.recurrent.kimi_delta_gates)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@jit
def _conv_step(x_row, w_ptr, bias_ptr, cs_row, cols, mask, live, C, K: tl.constexpr, KP: tl.constexpr,
               HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One token's depthwise causal conv over channels `cols` ([N]): returns its output in float32 and the channels'
    next conv-state rows [KP, N] (rows >= K-1 unused). `live` [KP, 1]: the sequence has a state (else rows read 0)."""
    r = tl.arange(0, KP)[:, None]
    c = cols[None, :]
    m2 = mask[None, :]
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    old = tl.load(cs_row + r * C + c, mask=(r < K - 1) & m2 & live, other=0.0)
    nxt = tl.load(cs_row + (r + 1) * C + c, mask=(r + 1 < K - 1) & m2 & live, other=0.0)  # row r's next value
    w_old = tl.load(w_ptr + c * K + r, mask=(r < K - 1) & m2, other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    y = tl.sum(old.to(tl.float32) * w_old, axis=0) + x.to(tl.float32) * w_new
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    return y, tl.where(r == K - 2, x.to(nxt.dtype)[None, :], nxt)


@jit
def _l2norm_scaled(x, scale):
    return x * (tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6) * scale)


@jit
def _conv_qk(x_row, w_ptr, bias_ptr, cs_row, counter_ptr, counter, q_cols, k_cols, mask, live, C, K: tl.constexpr,
             KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SPLIT: tl.constexpr):
    """A key head's q and k through the causal conv (_conv_step), float32, and their conv-state rows shifted.
    NOTE: the rows shift (row r <- row r+1), and a thread may store a row another thread (or a replica of the layout)
    still has to read: every conv-state store waits behind a barrier after the loads. With SPLIT > 1 every program of
    the key head reads its q/k conv state and the last to arrive (counter_ptr + counter, zeroed after) writes it (the
    barrier orders every thread's loads before the release)."""
    r = tl.arange(0, KP)[:, None]
    q, q_next = _conv_step(x_row, w_ptr, bias_ptr, cs_row, q_cols, mask, live, C, K, KP, HAS_BIAS, SILU)
    k, k_next = _conv_step(x_row, w_ptr, bias_ptr, cs_row, k_cols, mask, live, C, K, KP, HAS_BIAS, SILU)
    tl.debug_barrier()
    write_qk = True
    if SPLIT > 1:
        write_qk = tl.atomic_add(counter_ptr + counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    if write_qk:
        qk_mask = (r < K - 1) & mask[None, :]
        tl.store(cs_row + r * C + q_cols[None, :], q_next, mask=qk_mask)
        tl.store(cs_row + r * C + k_cols[None, :], k_next, mask=qk_mask)
        if SPLIT > 1:
            tl.atomic_xchg(counter_ptr + counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    return q, k


@jit
def _gated_delta_step_kernel(
    x_ptr,  # FUSED: [B, C] conv input (q | k | v channels); else q [B, Hk, DK]
    k_ptr,  # [B, Hk, DK] (not FUSED)
    v_ptr,  # [B, Hv, DV] (not FUSED)
    conv_w_ptr,  # [C, K] (FUSED)
    conv_bias_ptr,  # [C] (FUSED and HAS_BIAS)
    conv_state_ptr,  # [S, K-1, C], in place (FUSED)
    gate_ptr,  # FUSED: a [B, Hv] (raw); else g [B, Hv] (PER_CHANNEL: [B, Hv, DK] rows)
    beta_ptr,  # FUSED: b [B, Hv] (raw, beta = sigmoid(b)); else beta [B, Hv]
    A_log_ptr,  # [Hv] (FUSED)
    dt_bias_ptr,  # [Hv] (FUSED)
    state_ptr,  # [S, Hv, DK, DV] float32, in place
    out_ptr,  # [B, Hv, DV] contiguous
    slots_ptr,  # [B]
    starts_ptr,  # [B]
    counter_ptr,  # [>= B * Hk] int32, zero (FUSED and SPLIT > 1)
    stride_x, stride_xh,  # x (FUSED: stride_xh unused) / q
    stride_k, stride_kh,
    stride_v, stride_vh,
    stride_gate, stride_beta,
    C,  # conv channels (FUSED)
    scale,
    HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, SPLIT: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, FUSED: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, STATE_FIRST: tl.constexpr, USE_PDL: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    # PER_CHANNEL (not FUSED): KDA's decay per key channel, given (helios.kernels.kda's unfused path), GROUP == 1;
    # else the GDN decay per value head. The fused KDA step is helios.kernels.kda's own kernel.
    # program (split, key head, row): its key head's q and k, then TILES [DK, BV] state tiles of the key head's
    # GROUP value heads (tile t: value head t // NV, columns (t % NV) * BV)
    NV: tl.constexpr = (DV + BV - 1) // BV
    TILES: tl.constexpr = GROUP * NV // SPLIT
    split = tl.program_id(0)
    hk = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    HV: tl.constexpr = HK * GROUP
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    mk = ok < DK
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    start = tl.load(starts_ptr + row)
    live_k = (tl.zeros([BK, 1], dtype=tl.int32) + start) > 0  # as tiles: a scalar mask term trips the interpreter
    if FUSED:
        x_row = x_ptr + row * stride_x
        cs_row = conv_state_ptr + slot * (K - 1) * C
        live_c = (tl.zeros([KP, 1], dtype=tl.int32) + start) > 0
        r = tl.arange(0, KP)[:, None]
        q, k = _conv_qk(x_row, conv_w_ptr, conv_bias_ptr, cs_row, counter_ptr, row * HK + hk, hk * DK + ok,
                        (HK + hk) * DK + ok, mk, live_c, C, K, KP, HAS_BIAS, SILU, SPLIT)
    else:
        q = tl.load(x_ptr + row * stride_x + hk * stride_xh + ok, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k + hk * stride_kh + ok, mask=mk, other=0.0).to(tl.float32)
    q = _l2norm_scaled(q, scale)
    k = _l2norm_scaled(k, 1.0)
    for t in tl.range(split * TILES, split * TILES + TILES):
        h = hk * GROUP + t // NV
        cols = (t % NV) * BV + ov
        mv = cols < DV
        tile = state_ptr + (slot * HV + h) * DK * DV + ok[:, None] * DV + cols[None, :]
        tile_mask = mk[:, None] & mv[None, :]
        if STATE_FIRST:  # in flight beside the conv's loads (twice the registers: benchmarks/gpu_gated_delta.py)
            s = tl.load(tile, mask=tile_mask & live_k, other=0.0)  # [BK, BV]
        if FUSED:
            rate = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
            a = tl.load(gate_ptr + row * stride_gate + h).to(tl.float32)
            g = -rate * _softplus(a + tl.load(dt_bias_ptr + h).to(tl.float32))
            beta = tl.sigmoid(tl.load(beta_ptr + row * stride_beta + h).to(tl.float32))
            v, v_next = _conv_step(x_row, conv_w_ptr, conv_bias_ptr, cs_row, 2 * HK * DK + h * DV + cols, mv, live_c,
                                   C, K, KP, HAS_BIAS, SILU)
            tl.debug_barrier()  # this tile's channels are this program's alone; its rows shift as above
            tl.store(cs_row + r * C + (2 * HK * DK + h * DV + cols)[None, :], v_next, mask=(r < K - 1) & mv[None, :])
        else:
            if PER_CHANNEL:
                g = tl.load(gate_ptr + row * stride_gate + h * DK + ok, mask=mk, other=0.0).to(tl.float32)
            else:
                g = tl.load(gate_ptr + row * stride_gate + h).to(tl.float32)
            beta = tl.load(beta_ptr + row * stride_beta + h).to(tl.float32)
            v = tl.load(v_ptr + row * stride_v + h * stride_vh + cols, mask=mv, other=0.0).to(tl.float32)
        if not STATE_FIRST:
            s = tl.load(tile, mask=tile_mask & live_k, other=0.0)
        if PER_CHANNEL:
            s = s * tl.exp(g)[:, None]
        else:
            s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s += k[:, None] * delta[None, :]
        tl.store(tile, s, mask=tile_mask)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (row * HV + h) * DV + cols, o.to(out_ptr.dtype.element_ty), mask=mv)


def decode_splits(num_rows: int, num_k_heads: int, tiles: int, num_sms: int = 132, waves: int = 2) -> int:
    """Programs per key head of the decode step: the fewest (a divisor of the head's `tiles` state tiles) that give
    `waves` x num_sms programs, so batch 1 spreads over the chip and large batches keep one program per key head
    (no recomputed q/k conv, no arrival counter). A captured graph pins it (num_rows is its bucket)."""
    for s in range(1, tiles + 1):
        if tiles % s == 0 and num_rows * num_k_heads * s >= waves * num_sms:
            return s
    return tiles


def _num_sms(t: torch.Tensor) -> int:
    return sm_count(t.device)  # the traced GPU's on meta tensors (helios.kernels.aot)


def check_conv(conv_weight, conv_state, num_slots, channels):
    """The decode step's conv: taps [C, K] and the conv state [S, K-1, C], both contiguous."""
    width = conv_weight.shape[1]
    assert conv_weight.shape == (channels, width) and conv_weight.is_contiguous() and width >= 2
    assert conv_state.shape == (num_slots, width - 1, channels) and conv_state.is_contiguous(), \
        f"conv_state {tuple(conv_state.shape)} must be [S={num_slots}, K-1={width - 1}, C={channels}]"


def _check_state(state, slots, starts, num_rows, num_v_heads):
    assert state.dtype == torch.float32 and state.dim() == 4 and state.is_contiguous(), \
        f"state must be contiguous float32 [S, Hv, dk, dv], got {tuple(state.shape)} {state.dtype}"
    assert state.shape[1] == num_v_heads, f"state {tuple(state.shape)} vs {num_v_heads} value heads"
    assert slots.shape == (num_rows,) and starts.shape == (num_rows,), "one slot and one start per sequence"
    assert not slots.dtype.is_floating_point and not starts.dtype.is_floating_point


def gated_delta_decode(
    mixed_qkv: torch.Tensor,  # [B, C] the conv input rows (in_proj_qkv's output): q [Hk*dk] | k [Hk*dk] | v [Hv*dv]
    conv_weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, K-1, C], in place
    a: torch.Tensor,  # [B, Hv] in_proj_a's output: g = -exp(A_log) * softplus(a + dt_bias)
    b: torch.Tensor,  # [B, Hv] in_proj_b's output: beta = sigmoid(b)
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
    state: torch.Tensor,  # [S, Hv, dk, dv] float32, in place
    slots: torch.Tensor,  # [B] int32 (device)
    starts: torch.Tensor,  # [B] int32 (device); 0 = fresh
    num_k_heads: int,
    conv_bias: torch.Tensor | None = None,  # [C]
    activation: str | None = "silu",
    num_splits: int | None = None,
) -> torch.Tensor:  # [B, Hv, dv] in mixed_qkv's dtype
    """One decode token per sequence, one launch: the conv step (+ silu) with its conv-state update, q/k l2norm,
    the gate and beta, the delta-rule update of state[slot] (read once, written once) and its output.
    Program (split, key head, row) convolves its key head's q and k, then updates `tiles / num_splits` [dk, 32]
    state tiles of the key head's value heads. With num_splits > 1 each of the key head's programs recomputes q/k
    and the last to arrive (an arrival counter) writes their conv state. The counters are allocated by the first
    call, which must not be inside a graph capture.
    Graph-safe: no host sync, no data-dependent branch; padded rows may share a scratch slot (they disturb only it)."""
    require_triton()
    num_rows, channels = mixed_qkv.shape
    num_slots, num_v_heads, dk, dv = state.shape
    check_conv(conv_weight, conv_state, num_slots, channels)
    assert num_v_heads % num_k_heads == 0 and channels == 2 * num_k_heads * dk + num_v_heads * dv, \
        f"C={channels} vs Hk={num_k_heads}, Hv={num_v_heads}, dk={dk}, dv={dv}"
    assert a.shape == b.shape == (num_rows, num_v_heads) and A_log.shape == dt_bias.shape == (num_v_heads,)
    assert activation in (None, "silu", "swish"), f"activation {activation!r}"
    _check_state(state, slots, starts, num_rows, num_v_heads)
    for name, t in (("mixed_qkv", mixed_qkv), ("a", a), ("b", b)):
        check_last_dim_contiguous(name, t)
    assert conv_bias is None or (conv_bias.shape == (channels,) and conv_bias.is_contiguous())
    out = torch.empty(num_rows, num_v_heads, dv, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if num_rows == 0:
        return out
    splits = _splits(num_rows, num_k_heads, state, num_splits)
    counters = None
    if splits > 1:
        assert num_rows * num_k_heads <= COUNTER_SLOTS, "more (row, key head) groups than arrival counters"
        counters = arrival_counters(mixed_qkv.device, "gated_delta")
    width = conv_weight.shape[1]
    pdl = use_pdl(mixed_qkv, num_rows)
    _gated_delta_step_kernel[(splits, num_k_heads, num_rows)](
        mixed_qkv, mixed_qkv, mixed_qkv, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        conv_state, a, b, A_log, dt_bias, state, out, slots, starts, counters,
        mixed_qkv.stride(0), 0, 0, 0, 0, 0, a.stride(0), b.stride(0), channels, dk**-0.5,
        **_tile_args(num_k_heads, state, splits), K=width, KP=next_power_of_2(width - 1), FUSED=True,
        HAS_BIAS=conv_bias is not None, SILU=activation is not None, STATE_FIRST=STATE_FIRST, USE_PDL=pdl,
        PER_CHANNEL=False, num_warps=NUM_WARPS, num_stages=NUM_STAGES, launch_pdl=pdl,
    )
    return out


def _splits(num_rows, num_k_heads, state, num_splits, columns: int | None = None) -> int:
    """The split count (given, or decode_splits'), checked against the key head's state tiles (block_v's)."""
    _, num_v_heads, _, dv = state.shape
    tiles = num_v_heads // num_k_heads * -(-dv // block_v(state.shape[2], dv, columns))
    splits = num_splits or decode_splits(num_rows, num_k_heads, tiles, _num_sms(state))
    assert tiles % splits == 0, f"num_splits {splits} must divide the key head's {tiles} state tiles"
    return splits


def _tile_args(num_k_heads, state, splits, columns: int | None = None) -> dict:
    _, num_v_heads, dk, dv = state.shape
    return dict(HK=num_k_heads, GROUP=num_v_heads // num_k_heads, DK=dk, DV=dv, BK=next_power_of_2(dk),
                BV=block_v(dk, dv, columns), SPLIT=splits)


def recurrent_step(q, k, v, g, beta, state, slots, starts, num_splits=None) -> torch.Tensor:
    """The rule for one token per sequence (q/k/v already convolved): the decode kernel without the conv. g [B, Hv]
    (GDN) or [B, Hv, dk] contiguous (KDA's decay per key channel, Hv == Hk)."""
    num_rows, num_k_heads, dk = q.shape
    _, num_v_heads, dv = v.shape
    per_channel = g.dim() == 3
    assert not per_channel or (g.is_contiguous() and g.shape == (num_rows, num_v_heads, dk))
    out = torch.empty(num_rows, num_v_heads, dv, dtype=q.dtype, device=q.device)
    if num_rows == 0:
        return out
    splits = _splits(num_rows, num_k_heads, state, num_splits)
    pdl = use_pdl(q, num_rows)
    _gated_delta_step_kernel[(splits, num_k_heads, num_rows)](
        q, k, v, q, q, q, g, beta, g, g, state, out, slots, starts, None,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        0, dk**-0.5, **_tile_args(num_k_heads, state, splits), K=2, KP=1, FUSED=False, HAS_BIAS=False,
        SILU=False, STATE_FIRST=False, USE_PDL=pdl, PER_CHANNEL=per_channel,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, launch_pdl=pdl,
    )
    return out


# --- varlen causal conv (prefill and mixed batches) ------------------------------------------------------------


@jit
def _causal_conv_kernel(
    x_ptr,  # [T, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (HAS_BIAS)
    conv_state_ptr,  # [S, K-1, C], read only
    y_ptr,  # [T, C] contiguous
    seq_ids_ptr,  # [T] the sequence of each row
    qsl_ptr,  # [B + 1]
    slots_ptr,  # [B]
    starts_ptr,  # [B]
    T, C, stride_x,
    W0, W1,  # PLANAR: the widths of the first two column groups (the third: the rest)
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PLANAR: tl.constexpr,  # each column group stored as its own row-major [T, width] block, one after the other
    NORM_HEAD: tl.constexpr = 0,  # > 0 (PLANAR): l2-normalize each NORM_HEAD-wide head of the first two groups
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < T
    cmask = cols[None, :] < C
    seq = tl.load(seq_ids_ptr + rows, mask=rmask, other=0)
    j = rows - tl.load(qsl_ptr + seq, mask=rmask, other=0)  # position in the sequence's rows
    slot = tl.load(slots_ptr + seq, mask=rmask, other=0).to(tl.int64)
    live = tl.load(starts_ptr + seq, mask=rmask, other=0) > 0
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for m in tl.static_range(K):
        p = j - (K - 1) + m  # the window's input m of row j, relative to the sequence's first row
        in_x = (rmask & (p >= 0))[:, None] & cmask
        in_state = (rmask & (p < 0) & live)[:, None] & cmask  # state row K-1+p = j+m
        xv = tl.load(x_ptr + (rows - (K - 1) + m)[:, None].to(tl.int64) * stride_x + cols[None, :], mask=in_x,
                     other=0.0).to(tl.float32)
        sv = tl.load(conv_state_ptr + (slot * (K - 1) + j + m)[:, None] * C + cols[None, :], mask=in_state,
                     other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols * K + m, mask=cols < C, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if NORM_HEAD > 0:  # q and k heads (a head never straddles a tile: BC is a multiple of NORM_HEAD)
        heads = tl.reshape(acc * acc, [BT, BC // NORM_HEAD, NORM_HEAD])
        rstd = tl.rsqrt(tl.sum(heads, axis=2) + 1e-6)  # [BT, BC // NORM_HEAD], as _l2norm_scaled
        scale = tl.reshape(tl.broadcast_to(rstd[:, :, None], [BT, BC // NORM_HEAD, NORM_HEAD]), [BT, BC])
        acc = tl.where((cols < W0 + W1)[None, :], acc * scale, acc)
    if PLANAR:
        first, second = cols < W0, cols < W0 + W1
        start = tl.where(first, 0, tl.where(second, W0, W0 + W1)).to(tl.int64)
        width = tl.where(first, W0, tl.where(second, W1, C - W0 - W1)).to(tl.int64)
        at = T * start[None, :] + rows[:, None].to(tl.int64) * width[None, :] + (cols - start)[None, :]
    else:
        at = rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask)


@jit
def _conv_state_kernel(
    x_ptr,  # [T, C]
    conv_state_ptr,  # [S, K-1, C], in place
    qsl_ptr, slots_ptr, starts_ptr,  # [B + 1], [B], [B]
    C, stride_x,
    K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    first = tl.load(qsl_ptr + seq)
    n = tl.load(qsl_ptr + seq + 1) - first
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = (tl.zeros([KP, 1], dtype=tl.int32) + tl.load(starts_ptr + seq)) > 0
    r = tl.arange(0, KP)[:, None]
    p = n - (K - 1) + r  # the new row r's position relative to the sequence's first row
    c = cols[None, :]
    keep = (r < K - 1) & (c < C)
    row_ptr = conv_state_ptr + slot * (K - 1) * C
    xv = tl.load(x_ptr + (first + p).to(tl.int64) * stride_x + c, mask=keep & (p >= 0), other=0.0)
    sv = tl.load(row_ptr + (n + r) * C + c, mask=keep & (p < 0) & live, other=0.0)  # old row K-1+p
    new = tl.where(p >= 0, xv.to(sv.dtype), sv)
    tl.debug_barrier()  # rows shift within the program: every thread's loads before any store
    tl.store(row_ptr + r * C + c, new, mask=keep)


def can_norm_heads(head: int, q_width: int, k_width: int) -> bool:
    """Whether causal_conv can l2-normalize heads of this width in its tiles (up to 128 columns, a power of two)."""
    return 0 < head <= CONV_BLOCK_C and head & (head - 1) == 0 and q_width % head == 0 and k_width % head == 0


def causal_conv(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, K-1, C] last K-1 inputs, oldest first; in place
    slots: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    starts: torch.Tensor,  # [B]
    bias: torch.Tensor | None = None,  # [C]
    activation: str | None = "silu",
    seq_ids: torch.Tensor | None = None,  # [T] int32 each token's sequence (a step's layers share it); None: made here
    planar: tuple[int, int, int] | None = None,  # column group widths, summing to C: return each group contiguous
    norm_head: int | None = None,  # with planar: l2-normalize each norm_head-wide head of the first two groups
) -> torch.Tensor | tuple[torch.Tensor, ...]:  # [T, C] in x's dtype, or with `planar` a contiguous [T, w] per group
    """Varlen depthwise causal conv over a batch of sequences, continuing each from its conv state: two launches
    (the outputs, then each sequence's new last K-1 inputs). Float32 accumulation, one rounding. With `planar` the
    output's column groups (q, k, v) are written as separate contiguous blocks: fla's chunked rule copies every
    non-contiguous input (three copies a layer otherwise). With `norm_head` (a power of two up to 128 dividing both
    q and k widths; else see can_norm_heads) the q and k heads come out l2-normalized (x * rsqrt(sum x^2 + 1e-6), on
    the float32 values, one rounding): fla's rule then takes them as they are instead of normalizing each in two
    launches of its own."""
    require_triton()
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_seqs = slots.shape[0]
    assert weight.shape == (channels, width) and weight.is_contiguous() and width >= 2
    assert conv_state.shape[1:] == (width - 1, channels) and conv_state.is_contiguous()
    assert query_start_loc.shape == (num_seqs + 1,) and starts.shape == (num_seqs,)
    assert activation in (None, "silu", "swish"), f"activation {activation!r}"
    assert bias is None or (bias.shape == (channels,) and bias.is_contiguous())
    assert planar is None or (len(planar) == 3 and sum(planar) == channels), f"planar {planar} vs {channels}"
    assert norm_head is None or (planar is not None and can_norm_heads(norm_head, planar[0], planar[1])), \
        f"norm_head {norm_head} with planar {planar}"
    check_last_dim_contiguous("x", x)
    y = torch.empty(num_tokens * channels, dtype=x.dtype, device=x.device)
    if planar is not None:
        bounds = [0, planar[0], planar[0] + planar[1], channels]
        out = tuple(y[num_tokens * lo : num_tokens * hi].view(num_tokens, hi - lo) for lo, hi in zip(bounds, bounds[1:]))
    else:
        out = y.view(num_tokens, channels)
    if num_tokens == 0:
        return out
    if seq_ids is not None:
        assert seq_ids.shape == (num_tokens,) and seq_ids.dtype == torch.int32
    elif num_tokens == num_seqs:  # one row per sequence (decode): row i is sequence i
        seq_ids = torch.arange(num_tokens, dtype=torch.int32, device=x.device)
    else:
        rows = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=x.device)
        seq_ids = torch.searchsorted(query_start_loc[1:], rows, right=True).to(torch.int32)
    block_c = min(CONV_BLOCK_C, next_power_of_2(channels))
    block_t = 16  # one compiled variant for every token count (ahead-of-time compiles)
    _causal_conv_kernel[(-(-num_tokens // block_t), -(-channels // block_c))](
        x, weight, bias if bias is not None else weight, conv_state, y, seq_ids, query_start_loc, slots, starts,
        num_tokens, channels, x.stride(0), *(planar[:2] if planar is not None else (0, 0)),
        K=width, BT=block_t, BC=block_c, HAS_BIAS=bias is not None, SILU=activation is not None,
        PLANAR=planar is not None, NORM_HEAD=norm_head or 0, num_warps=4,
    )
    _conv_state_kernel[(num_seqs, -(-channels // block_c))](
        x, conv_state, query_start_loc, slots, starts, channels, x.stride(0),
        K=width, KP=next_power_of_2(width - 1), BC=block_c, num_warps=4,
    )
    return out


# --- a prompt step's gates: one launch where the torch chain took ~18 ----------------------------------------------

GATE_SOFTPLUS, GATE_SOFTPLUS_KIMI, GATE_SAFE = range(3)


@jit
def _delta_gates_kernel(
    x_ptr,  # [T, H*D] the decay projection (GDN: a, D = 1; KDA: f_b's output, D = dk), last dim contiguous
    b_ptr,  # [T, H] the write-strength projection, last dim contiguous
    A_log_ptr,  # [H]
    dt_bias_ptr,  # [H*D]
    g_ptr,  # [T, H*D] float32 out
    beta_ptr,  # [T, H] out, b's dtype
    num_rows,
    num_heads,
    stride_x,
    stride_b,
    lower_bound,
    D: tl.constexpr,
    FORM: tl.constexpr,  # GATE_SOFTPLUS, GATE_SOFTPLUS_KIMI or GATE_SAFE
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_rows
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < num_heads * D
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x += tl.load(dt_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    rate = tl.exp(tl.load(A_log_ptr + cols // D, mask=col_ok, other=0.0).to(tl.float32))[None, :]
    if FORM == 0:
        g = -rate * _softplus(x)
    elif FORM == 1:
        g = -rate * _softplus_kimi(x)
    else:
        g = lower_bound * tl.sigmoid(rate * x)
    tl.store(g_ptr + rows[:, None] * (num_heads * D) + cols[None, :], g, mask=mask)
    if tl.program_id(1) == 0:
        h = tl.arange(0, BLOCK_H)
        hm = row_ok[:, None] & (h < num_heads)[None, :]
        b = tl.load(b_ptr + rows[:, None] * stride_b + h[None, :], mask=hm, other=0.0)
        beta = tl.sigmoid(b.to(tl.float32))
        tl.store(beta_ptr + rows[:, None] * num_heads + h[None, :], beta.to(b.dtype), mask=hm)


def delta_gates(
    x: torch.Tensor,  # [T, H*D] the decay projection (GDN's a: D = 1; KDA's f: D = dk)
    b: torch.Tensor,  # [T, H]
    A_log: torch.Tensor,  # [H] (any shape of H elements)
    dt_bias: torch.Tensor,  # [H*D]
    form: int = GATE_SOFTPLUS,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # g [T, H*D] float32 contiguous, beta [T, H] in b's dtype
    """A prompt step's decay and write strength in one launch, as helios.layers.recurrent computes them (to
    rounding: Triton's exp and log): GATE_SOFTPLUS g = -exp(A_log) * softplus(a + dt_bias) (gated_delta_gates),
    GATE_SOFTPLUS_KIMI the same with kimi's softplus, GATE_SAFE g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
    (kimi_delta_gates); beta = sigmoid(b). Elementwise: a row's values do not depend on its batch."""
    require_triton()
    num_rows, num_heads = b.shape
    width = x.shape[1]
    assert x.shape[0] == num_rows and width % num_heads == 0 and A_log.numel() == num_heads
    assert dt_bias.numel() == width and (form == GATE_SAFE) == (lower_bound is not None)
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("b", b)
    g = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    beta = torch.empty(num_rows, num_heads, dtype=b.dtype, device=b.device)
    if num_rows == 0:
        return g, beta
    block_t, block_c = 16, min(256, next_power_of_2(width))
    _delta_gates_kernel[(-(-num_rows // block_t), -(-width // block_c))](
        x, b, A_log.reshape(-1), dt_bias.reshape(-1), g, beta, num_rows, num_heads, x.stride(0), b.stride(0),
        float(lower_bound or 0.0), D=width // num_heads, FORM=form, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_H=next_power_of_2(num_heads), num_warps=4,
    )
    return g, beta


# --- the rule over a batch: decode kernel or fla's chunked prefill ----------------------------------------------


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, dk]
    k: torch.Tensor,  # [T, Hk, dk]
    v: torch.Tensor,  # [T, Hv, dv]
    g: torch.Tensor,  # [T, Hv] float32 log-decay
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [S, Hv, dk, dv] float32, in place
    slots: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    starts: torch.Tensor,  # [B]
    chunk_size: int = 64,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None,
    all_fresh: bool = False,
    qk_normalized: bool = False,
) -> torch.Tensor:  # [T, Hv, dv] in q's dtype
    """The gated delta rule over a varlen batch; q/k l2-normalised inside (eps 1e-6), q scaled by dk**-0.5.
    cu_seqlens: query_start_loc as int64 on the device and on the host, made once per step for every layer
    (helios.layers.linear_attention.fla_cu_seqlens); None: a device copy made here, and fla's device sync.
    all_fresh: the caller knows (from host values) that every sequence starts at position 0: no state is gathered.
    qk_normalized: q and k come l2-normalized (causal_conv's norm_head): the chunked rule does not normalize them
    again (a multi-token step only).

    T == B (every sequence one token, as every sequence has at least one): the slot-indexed decode kernel, graph-safe.
    Otherwise fla's chunk_gated_delta_rule (fla-core 0.6.0, CUDA only; not graph-safe: it reads the chunk layout
    on the host and autotunes on first use) on the states gathered by slot (zeros where starts == 0), the final
    states scattered back. NOTE: fla chunks each sequence from its own first row (cu_seqlens), while the CPU
    reference chunks on the absolute-position grid (multiples of chunk_size); the two agree up to rounding (the
    chunked form is exact algebra), and exactly place the same chunks when every sequence's start is a multiple of
    chunk_size, which the engine's prefill chunking keeps (a chunk ends on a multiple of 64)."""
    num_tokens, num_k_heads, dk = q.shape
    num_v_heads = v.shape[1]
    assert k.shape == q.shape and v.shape[0] == num_tokens and num_v_heads % num_k_heads == 0
    assert g.shape == beta.shape == (num_tokens, num_v_heads) and g.dtype == torch.float32
    assert state.shape[2:] == (dk, v.shape[2]), f"state {tuple(state.shape)} vs dk={dk}, dv={v.shape[2]}"
    num_seqs = slots.shape[0]
    _check_state(state, slots, starts, num_seqs, num_v_heads)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_last_dim_contiguous(name, t)
    if num_tokens == num_seqs:
        require_triton()
        assert not qk_normalized, "the one-token kernel normalizes q and k itself"
        return recurrent_step(q, k, v, g, beta, state, slots, starts)
    # meta: benchmarks/decode_launches.py counts a prompt step's launches
    assert q.is_cuda or q.is_meta, "the chunked prefill runs fla's kernels: CUDA only (the CPU path: the torch ref)"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunked_by_slot(chunk_gated_delta_rule, q, k, v, g, beta, state, slots, query_start_loc, starts,
                           chunk_size, cu_seqlens, all_fresh, qk_normalized)


def chunked_by_slot(chunk_fn, q, k, v, g, beta, state, slots, query_start_loc, starts, chunk_size,
                    cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None, all_fresh: bool = False,
                    qk_normalized: bool = False):
    """fla's varlen chunk_fn on the states gathered by slot (zeros where fresh), the final states scattered back.
    cu_seqlens: (device, host) int64 query_start_loc of this step, shared by its layers (gated_delta_rule's).
    all_fresh: every sequence starts at 0 (the caller's host fact): fla starts from zeros itself (the same values),
    and nothing is gathered (three launches fewer a layer in a prompt step of new prompts).
    qk_normalized: q and k are l2-normalized already; else fla normalizes them (two launches)."""
    num_seqs, dk = slots.shape[0], q.shape[2]
    index = slots.to(torch.int64)
    if all_fresh:
        initial = None
    else:  # never reads a fresh slot's garbage (NaN)
        initial = torch.where((starts == 0).view(num_seqs, 1, 1, 1), 0.0, state.index_select(0, index))
    # NOTE: fla memoizes its chunk layout by the identity of cu_seqlens (and cu_seqlens_cpu): never hand it a buffer
    # rewritten in place. Without the step's pair, a fresh copy each call, whose layout fla builds again with a
    # device sync (its repeat_interleave over device counts reads their sum on the host): once a layer, which
    # left the GPU idle between a prefill's layers
    device_cu, host_cu = cu_seqlens if cu_seqlens is not None else (query_start_loc.to(torch.int64, copy=True), None)
    o, final = chunk_fn(
        q[None], k[None], v[None], g[None], beta[None], scale=dk**-0.5, initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=not qk_normalized, cu_seqlens=device_cu,
        cu_seqlens_cpu=host_cu,
        chunk_size=chunk_size,
    )
    state.index_copy_(0, index, final.to(state.dtype))
    return o[0]


# --- torch references ----------------------------------------------------------------------------------------


def _l2norm_ref(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def causal_conv_ref(x, weight, conv_state, slots, query_start_loc, starts, bias=None, activation="silu"):
    """Per sequence: window = [state (zeros if fresh), x rows], y = act(sum_m w[:, m] * window[t+m] + bias) in float32,
    one rounding; the state becomes the window's last K-1 rows."""
    width = weight.shape[1]
    y = torch.empty_like(x)
    qsl, slot_list, start_list = query_start_loc.tolist(), slots.tolist(), starts.tolist()
    for i, slot in enumerate(slot_list):
        lo, hi = qsl[i], qsl[i + 1]
        old = conv_state[slot].float() if start_list[i] > 0 else x.new_zeros(width - 1, x.shape[1], dtype=torch.float32)
        window = torch.cat([old, x[lo:hi].float()])  # [K-1+L, C]
        out = (window.unfold(0, width, 1) * weight.float()).sum(-1)  # [L, C]
        if bias is not None:
            out = out + bias.float()
        if activation is not None:
            out = torch.nn.functional.silu(out)
        y[lo:hi] = out.to(x.dtype)
        conv_state[slot] = window[-(width - 1):].to(conv_state.dtype)
    return y


def gated_delta_rule_ref(q, k, v, g, beta, state, slots, query_start_loc, starts, chunk_size=64):
    """Token by token in float32 (transformers' torch_recurrent_gated_delta_rule per sequence, from state[slot]);
    g [T, Hv] a decay per head, or [T, Hv, dk] one per key channel (KDA's recurrent_kimi_delta_attention)."""
    num_v_heads, group = v.shape[1], v.shape[1] // q.shape[1]
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    qf = _l2norm_ref(q.float()).repeat_interleave(group, 1) * q.shape[-1] ** -0.5
    kf = _l2norm_ref(k.float()).repeat_interleave(group, 1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    qsl, slot_list, start_list = query_start_loc.tolist(), slots.tolist(), starts.tolist()
    for i, slot in enumerate(slot_list):
        s = state[slot].clone() if start_list[i] > 0 else state.new_zeros(state.shape[1:])
        for t in range(qsl[i], qsl[i + 1]):
            s = s * (gf[t].exp()[..., None] if gf.dim() == 3 else gf[t].exp()[:, None, None])
            delta = (vf[t] - torch.einsum("hkv,hk->hv", s, kf[t])) * bf[t][:, None]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t]).to(out.dtype)
        state[slot] = s
    assert num_v_heads == state.shape[1]
    return out


def gated_delta_decode_ref(mixed_qkv, conv_weight, conv_state, a, b, A_log, dt_bias, state, slots, starts,
                           num_k_heads, conv_bias=None, activation="silu", num_splits=None):
    """causal_conv_ref, the gate (transformers: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both in
    float32 here), then gated_delta_rule_ref."""
    num_rows = mixed_qkv.shape[0]
    _, num_v_heads, dk, dv = state.shape
    qsl = torch.arange(num_rows + 1, dtype=torch.int32)
    y = causal_conv_ref(mixed_qkv, conv_weight, conv_state, slots, qsl, starts, conv_bias, activation)
    q, k, v = y.split([num_k_heads * dk, num_k_heads * dk, num_v_heads * dv], dim=-1)
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    return gated_delta_rule_ref(q.reshape(num_rows, num_k_heads, dk), k.reshape(num_rows, num_k_heads, dk),
                                v.reshape(num_rows, num_v_heads, dv), g, beta, state, slots, qsl, starts)
