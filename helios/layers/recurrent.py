"""Recurrent (linear-attention) layer ops over helios' flattened batch: the CPU/torch reference of each kernel.

causal_conv (all hybrids), gated_delta_rule (qwen3_5 / qwen3_next GDN), kimi_delta_rule (kimi_linear / glm5_next
KDA), mamba2_scan (nemotron_h), rms_norm_gated (the three families' gated norms) and the layers' gate formulas.
Sequence i owns rows query_start_loc[i]:query_start_loc[i+1]; its first row sits at absolute position starts[i]
(0: a fresh request, whose state is zero whatever its slot holds: the slot is then never read) and it reads and
updates row slots[i] of the state tensors in place. One-token sequences take the recurrent form, all together in
one vectorised step; longer ones the chunked form, chunks aligned to absolute positions. Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# NOTE: batch invariance. A sequence's bits must not depend on the batch around it, on where the scheduler split
# its prompt (on a multiple of chunk_size) or on the thread count. So the chunked form runs per sequence and per
# chunk, on tensors whose shapes depend only on the chunk (never one product over all of a sequence's chunks, whose
# count changes with the split); the one-token step uses elementwise ops and batched matmuls of >= 2 matrices,
# which torch splits over the matrices, never inside one. And no op whose CPU SIMD body and scalar tail disagree
# (F.silu, F.softplus, torch.sigmoid: an element's bits would depend on its offset in the batch): those are
# written with exp, log and log1p, whose two paths agree (checked by the batch and thread tests).


def _lengths(query_start_loc: list[int]) -> list[int]:
    return [end - start for start, end in zip(query_start_loc, query_start_loc[1:])]


def _gather_states(
    state: torch.Tensor,  # [S, *shape]
    slots: list[int],
    fresh: list[bool],  # per sequence: start from zero (the slot is not read)
    dtype: torch.dtype,
) -> torch.Tensor:  # [len(slots), *shape] in dtype, a copy
    if not any(fresh):
        return state[torch.tensor(slots, device=state.device)].to(dtype)
    out = state.new_zeros((len(slots), *state.shape[1:]), dtype=dtype)
    held = [j for j, is_fresh in enumerate(fresh) if not is_fresh]
    if held:
        out[held] = state[[slots[j] for j in held]].to(dtype)
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in float32, cast back to x's dtype: F.silu's formula, the same bits at every offset."""
    h = x.to(torch.float32)
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in float32, cast back to x's dtype."""
    return (1.0 / (1.0 + torch.exp(-x.to(torch.float32)))).to(x.dtype)


def softplus(x: torch.Tensor) -> torch.Tensor:  # float32
    """F.softplus (beta 1, threshold 20): log1p(exp(x)), x itself above 20."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return silu(x)
    raise ValueError(f"unknown conv activation {activation!r}")


def causal_conv(
    x: torch.Tensor,  # [T, C] model dtype
    weight: torch.Tensor,  # [C, K], taps oldest first
    conv_state: torch.Tensor,  # [S, K-1, C]: each slot's last K-1 inputs, oldest first; updated in place
    slots: list[int],
    query_start_loc: list[int],
    starts: list[int],
    bias: torch.Tensor | None = None,  # [C]
    activation: str | None = "silu",
) -> torch.Tensor:  # [T, C] in x's dtype
    """act(depthwise causal conv over [state, x]) for every sequence at once, then each slot keeps its sequence's
    last K-1 inputs (zeros standing for the inputs before a fresh sequence's first token).

    As HF's causal_conv1d_fn / causal_conv1d_update: inputs cast to the weight's dtype, the taps summed in float32
    and rounded once to that dtype, the activation there, the result cast to x's dtype. Elementwise throughout,
    so prefill and decode rows share one pass and no row depends on the batch.
    """
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1  # history rows per sequence
    lengths = _lengths(query_start_loc)
    num_seqs = len(lengths)
    compute, device = weight.dtype, x.device
    # one buffer holding each sequence's K-1 history rows, then its tokens: [T + B*(K-1), C]
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), torch.tensor(lengths, device=device),
                                      output_size=num_tokens)
    token_rows = torch.arange(num_tokens, device=device) + width * (seq_ids + 1)  # [T]
    seq_first = torch.tensor(query_start_loc[:-1], device=device) + width * torch.arange(num_seqs, device=device)
    history_rows = (seq_first[:, None] + torch.arange(width, device=device)).flatten()  # [B*(K-1)]
    history = _gather_states(conv_state, slots, [s == 0 for s in starts], compute)  # [B, K-1, C]
    buf = torch.empty(num_tokens + num_seqs * width, channels, dtype=compute, device=device)
    buf.index_copy_(0, history_rows, history.flatten(0, 1))
    buf.index_copy_(0, token_rows, x.to(compute))

    taps = weight.to(torch.float32).t()  # [K, C]
    window = token_rows - width  # [T] the buffer row of each token's oldest tap
    acc = buf[window].to(torch.float32) * taps[0]
    for j in range(1, width + 1):
        acc = acc + buf[window + j].to(torch.float32) * taps[j]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    out = _activate(acc.to(compute), activation).to(x.dtype)

    live = [i for i, n in enumerate(lengths) if n > 0]
    if live:
        seq_end = torch.tensor([query_start_loc[i + 1] + width * (i + 1) for i in live], device=device)
        last_rows = (seq_end[:, None] - width + torch.arange(width, device=device)).flatten()  # each one's last K-1
        live_slots = torch.tensor([slots[i] for i in live], device=device)
        conv_state[live_slots] = buf[last_rows].view(len(live), width, channels).to(conv_state.dtype)
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # [..., d] float32
    """x / sqrt(sum(x^2) + eps) over the last dim, as HF's (and fla's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_gates(
    a: torch.Tensor,  # [T, Hv] the a projection
    b: torch.Tensor,  # [T, Hv] the b projection
    A_log: torch.Tensor,  # [Hv]
    dt_bias: torch.Tensor,  # [Hv]
) -> tuple[torch.Tensor, torch.Tensor]:  # g [T, Hv] float32, beta [T, Hv] in b's dtype
    """The GDN layer's decay and write strength: g = -exp(A_log) * softplus(a + dt_bias) in float32 and
    beta = sigmoid(b), as Qwen3_5GatedDeltaNet.forward computes them (to rounding; see silu)."""
    g = -A_log.to(torch.float32).exp() * softplus(a.to(torch.float32) + dt_bias.to(torch.float32))
    return g, sigmoid(b)


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, dk]
    k: torch.Tensor,  # [T, Hk, dk]
    v: torch.Tensor,  # [T, Hv, dv], Hv a multiple of Hk
    g: torch.Tensor,  # [T, Hv] float32 log-decay, -exp(A_log) * softplus(a + dt_bias)
    beta: torch.Tensor,  # [T, Hv], sigmoid(b)
    state: torch.Tensor,  # [S, Hv, dk, dv] float32, read and written in place at slots
    slots: list[int],
    query_start_loc: list[int],
    starts: list[int],
    chunk_size: int = 64,
) -> torch.Tensor:  # [T, Hv, dv] in v's dtype
    """The gated delta rule (qwen3_5 / qwen3_next GDN): S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q,
    q and k l2-normalised (eps 1e-6) and q scaled by dk**-0.5 here (HF's use_qk_l2norm_in_kernel=True). Each q/k
    head serves Hv // Hk consecutive v heads. One-token sequences: HF's torch_recurrent_gated_delta_rule, batched;
    longer ones: torch_chunk_gated_delta_rule's arithmetic on a chunk grid aligned to absolute positions.
    """
    group = v.shape[1] // k.shape[1]
    q, k = l2norm(q.to(torch.float32)), l2norm(k.to(torch.float32))
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)  # [T, Hv, dk]
    return _delta_rule(q, k, v, g, beta, state, slots, query_start_loc, starts, chunk_size)


def kimi_delta_gates(
    f: torch.Tensor,  # [T, H*dk], the forget gate's projection f_b(f_a(x))
    b: torch.Tensor,  # [T, H], the b projection
    A_log: torch.Tensor,  # [H] (any shape of H elements)
    dt_bias: torch.Tensor,  # [H*dk]
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # g [T, H, dk] float32, beta [T, H] in b's dtype
    """KDA's per-channel log-decay and write strength, in float32: kimi_linear's KimiLinearForgetGate,
    -exp(A_log) * softplus(f + dt_bias) (its softplus: log(1 + exp(x)), x above 20), or with `lower_bound` glm5_next's
    safe gate, lower_bound * sigmoid(exp(A_log) * (f + dt_bias)); beta = sigmoid(b)."""
    num_heads = A_log.numel()
    x = (f.to(torch.float32) + dt_bias.to(torch.float32)).view(f.shape[0], num_heads, -1)
    rate = A_log.to(torch.float32).reshape(num_heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * sigmoid(rate * x), sigmoid(b)
    return -rate * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x))), sigmoid(b)


def kimi_delta_rule(
    q: torch.Tensor,  # [T, H, dk]
    k: torch.Tensor,  # [T, H, dk]
    v: torch.Tensor,  # [T, H, dv]
    g: torch.Tensor,  # [T, H, dk] float32 log-decay of each key channel
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [S, H, dk, dv] float32, read and written in place at slots
    slots: list[int],
    query_start_loc: list[int],
    starts: list[int],
    chunk_size: int = 64,
) -> torch.Tensor:  # [T, H, dv] in v's dtype
    """Kimi delta attention (kimi_linear, glm5_next): the gated delta rule with a decay per key channel,
    S <- diag(exp(g)) S, q and k l2-normalised as kimi's l2norm (x / sqrt(sum(x^2) + 1e-6)). One-token sequences:
    recurrent_kimi_delta_attention, batched; longer ones: chunk_kimi_delta_attention on the absolute chunk grid."""
    q, k = q.to(torch.float32), k.to(torch.float32)
    q = q / torch.sqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    return _delta_rule(q, k, v, g, beta, state, slots, query_start_loc, starts, chunk_size)


def _delta_rule(q, k, v, g, beta, state, slots, query_start_loc, starts, chunk_size) -> torch.Tensor:
    """Both delta rules from normalised float32 q, k [T, H, dk] (one per v head); g [T, H] (a decay per head) or
    [T, H, dk] (per key channel)."""
    scale = q.shape[-1] ** -0.5
    g, beta = g.to(torch.float32), beta.to(torch.float32)

    def one_token(rows, s):
        return _delta_step(q[rows] * scale, k[rows], v[rows].to(torch.float32), g[rows], beta[rows], s)

    def sequence(rows, s, start):
        return _delta_chunked(q[rows] * scale, k[rows], v[rows], g[rows], beta[rows], s, start, chunk_size)

    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return _scan(out, state, slots, query_start_loc, starts, one_token, sequence)


def _scan(out, state, slots, query_start_loc, starts, one_token, sequence) -> torch.Tensor:
    """The batch split every recurrent op shares: the one-token sequences in one `one_token(rows, s)` call on their
    slots' states (s [B, ...] updated in place), then each longer one alone: `sequence(rows, s or None, start)`
    returns (its output rows, its final state)."""
    lengths = _lengths(query_start_loc)
    singles = sorted((i for i, n in enumerate(lengths) if n == 1), key=lambda i: slots[i])
    if singles:
        rows = torch.tensor([query_start_loc[i] for i in singles], device=out.device)
        s, write_back = _slot_rows(state, [slots[i] for i in singles], [starts[i] == 0 for i in singles])
        out[rows] = one_token(rows, s).to(out.dtype)
        write_back()
    for i, n in enumerate(lengths):
        if n > 1:
            rows = slice(query_start_loc[i], query_start_loc[i + 1])
            o, s = sequence(rows, state[slots[i]] if starts[i] > 0 else None, starts[i])
            state[slots[i]] = s
            out[rows] = o.to(out.dtype)
    return out


def _slot_rows(
    state: torch.Tensor,  # [S, *shape] float32
    slots: list[int],  # ascending
    fresh: list[bool],  # per slot: start from zero (the slot is not read)
) -> tuple[torch.Tensor, object]:  # ([len(slots), *shape] to update in place, write_back())
    """The rows a one-token step updates: a view of `state` when the slots are consecutive (a steady batch under
    the pool's lowest-first allocation), else a gathered copy that write_back() scatters. Either way the products
    run on the same per-slot matrices, so the choice changes no bit; the view saves a state-sized allocation (its
    page faults cost more than the arithmetic at qwen3_5's state sizes)."""
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        rows = state[first : first + len(slots)]
        for j in (j for j, is_fresh in enumerate(fresh) if is_fresh):
            rows[j].zero_()
        return rows, lambda: None
    rows = _gather_states(state, slots, fresh, state.dtype)
    index = torch.tensor(slots, device=state.device)
    return rows, lambda: state.index_copy_(0, index, rows)


def _delta_step(
    q: torch.Tensor,  # [B, H, dk] float32, normalised and scaled
    k: torch.Tensor,  # [B, H, dk] float32, normalised
    v: torch.Tensor,  # [B, H, dv] float32
    g: torch.Tensor,  # [B, H] or [B, H, dk]
    beta: torch.Tensor,  # [B, H]
    s: torch.Tensor,  # [B, H, dk, dv] float32, updated in place
) -> torch.Tensor:  # [B, H, dv] float32
    """One token of B sequences at once, in HF's recurrent order (decay, read, delta, write, read)."""
    num_seqs, num_heads, key_dim, value_dim = s.shape
    s.mul_(g.exp()[..., None] if g.dim() == 3 else g.exp()[..., None, None])
    kv_mem = torch.matmul(k[:, :, None, :], s)[:, :, 0]  # [B, H, dv]
    delta = (v - kv_mem) * beta[..., None]
    # the rank-1 write as a batched product: one pass over the state instead of a materialised outer product
    flat = s.view(num_seqs * num_heads, key_dim, value_dim)
    flat.baddbmm_(k.reshape(-1, key_dim, 1), delta.reshape(-1, 1, value_dim))
    return torch.matmul(q[:, :, None, :], s)[:, :, 0]


def _chunk_bounds(start: int, length: int, chunk_size: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) of a sequence whose first row sits at absolute position `start`, cut where positions
    cross a multiple of chunk_size."""
    bounds, a = [], 0
    while a < length:
        b = min(length, a + chunk_size - (start + a) % chunk_size)
        bounds.append((a, b))
        a = b
    return bounds


def _head_major(x: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, n, ...] float32, contiguous
    return x.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)


def _delta_chunked(
    q: torch.Tensor,  # [L, H, dk] float32, normalised and scaled
    k: torch.Tensor,  # [L, H, dk] float32, normalised
    v: torch.Tensor,  # [L, H, dv]
    g: torch.Tensor,  # [L, H] or [L, H, dk] float32
    beta: torch.Tensor,  # [L, H] float32
    s: torch.Tensor | None,  # [H, dk, dv] float32, None: zero
    start: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [L, H, dv] float32, the final state [H, dk, dv]
    """torch_chunk_gated_delta_rule / chunk_kimi_delta_attention for one sequence, chunk by chunk (UT transform
    inside a chunk, the state carried between chunks); HF's zero padding of the last chunk is dropped, which
    changes no real row."""
    per_channel = g.dim() == 3
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for a, b in _chunk_bounds(start, q.shape[0], chunk_size):
        qc, kc, vc, gc, bc = (_head_major(t[a:b]) for t in (q, k, v, g, beta))  # [H, n, ...]
        cum = gc.cumsum(dim=1)  # [H, n(, dk)] log of the decay from the chunk's start through each row
        k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
        if per_channel:
            system, attn = _channel_decayed_scores((k_beta, qc), kc, cum)
            decay = cum.exp()  # [H, n, dk]
            last = cum[:, -1:]  # [H, 1, dk]
            k_tail = kc * (last - cum).exp()  # each key decayed to the chunk's end
            state_decay = last.exp().transpose(1, 2)  # [H, dk, 1]
        else:
            n = b - a
            upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            pair = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()  # [H, n, n]
            system, attn = (k_beta @ kc.transpose(1, 2)) * pair, (qc @ kc.transpose(1, 2)) * pair
            decay = cum.exp()[..., None]  # [H, n, 1]
            last = cum[:, -1:]  # [H, 1]
            k_tail = kc * (last - cum).exp()[..., None]
            state_decay = last.exp()[..., None]  # [H, 1, 1]
        # HF solves (I + strictly_lower(system)) x = rhs for two right-hand sides (solve_triangular, unitriangular)
        inverse = _unit_lower_inverse(system)
        new_values = inverse @ v_beta
        if s is None:  # a fresh sequence's first chunk: HF's zero state adds exact zeros
            o, v_new = attn @ new_values, new_values
        else:
            v_new = new_values - (inverse @ (k_beta * decay)) @ s
            o = (qc * decay) @ s + attn @ v_new
        write = k_tail.transpose(1, 2) @ v_new
        s = write if s is None else s * state_decay + write
        out[a:b] = o.transpose(0, 1)
    return out, s


def _channel_decayed_scores(
    xs: tuple[torch.Tensor, ...],  # each [H, n, dk]
    y: torch.Tensor,  # [H, n, dk]
    cum: torch.Tensor,  # [H, n, dk] cumulative log-decay per channel (non-increasing along n)
) -> list[torch.Tensor]:  # per x, [H, n, n]
    """out[i, j] = sum_d x[i, d] y[j, d] exp(cum[i, d] - cum[j, d]) for j <= i, 0 above the diagonal.

    HF forms the [n, n, dk] product outright. Here rows go in blocks of 16: the columns before a block are one
    matmul through the block's first row r, exp(cum_i - cum_r) * exp(cum_r - cum_j), both factors <= 1 (no
    overflow, and an underflow only where the exact value is smaller still); the block's own 16 x 16 corner is
    formed outright, since there exp(cum_r - cum_j) may exceed any float.
    """
    heads, n, _ = y.shape
    outs = [torch.zeros(heads, n, n, dtype=y.dtype, device=y.device) for _ in xs]
    for r in range(0, n, SUBSTITUTION_BLOCK):
        e = min(n, r + SUBSTITUTION_BLOCK)
        upper = torch.ones(e - r, e - r, dtype=torch.bool, device=y.device).triu(1)
        diff = (cum[:, r:e, None, :] - cum[:, None, r:e, :]).masked_fill(upper[..., None], float("-inf"))
        decayed = y[:, None, r:e, :] * diff.exp()  # [H, m, m, dk]: y_j decayed to row i
        ref = cum[:, r : r + 1]  # [H, 1, dk]
        right = (y[:, :r] * (ref - cum[:, :r]).exp()).transpose(1, 2) if r else None  # [H, dk, r]
        for x, out in zip(xs, outs):
            rows = x[:, r:e]  # [H, m, dk]
            out[:, r:e, r:e] = torch.matmul(decayed, rows[..., None])[..., 0]
            if r:
                out[:, r:e, :r] = (rows * (cum[:, r:e] - ref).exp()) @ right
    return outs


def mamba2_scan(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H], the dt projection (before dt_bias and softplus)
    A_log: torch.Tensor,  # [H]
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    D: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H]
    state: torch.Tensor,  # [S, H, P, N] float32, read and written in place at slots
    slots: list[int],
    query_start_loc: list[int],
    starts: list[int],
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:  # [T, H, P] in x's dtype
    """Mamba-2's selective scan (nemotron_h's NemotronHMamba2Mixer), D skip included: per head h of group
    g = h // (H / G), dt = clamp(softplus(dt + dt_bias)), S <- exp(dt A) S + dt x B_g^T, y = S C_g + D x, with
    A = -exp(A_log). One-token sequences: mamba2_selective_state_update, batched; longer ones: mamba2_chunk_scan's
    arithmetic on the absolute chunk grid, each chunk's state carried sequentially.

    As HF, dt + dt_bias and the softplus round to dt's dtype; the rest is float32. HF's one-token path leaves dt
    unclamped (its chunked path clamps): both clamp here, which differs only for a dt_limit other than (0, inf).
    """
    num_heads, num_groups = x.shape[1], B.shape[1]
    assert num_heads % num_groups == 0, (num_heads, num_groups)
    dt = softplus((dt + dt_bias.to(dt.dtype)).to(torch.float32)).to(dt.dtype).to(torch.float32)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])  # [T, H]
    A = -A_log.to(torch.float32).exp()  # [H]
    skip = D.to(torch.float32)[:, None]  # [H, 1]

    def one_token(rows, s):
        return _mamba2_step(x[rows].to(torch.float32), dt[rows], A, B[rows].to(torch.float32),
                            C[rows].to(torch.float32), skip, s)

    def sequence(rows, s, start):
        return _mamba2_chunked(x[rows], dt[rows], A, B[rows], C[rows], skip, s, start, chunk_size)

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _scan(out, state, slots, query_start_loc, starts, one_token, sequence)


def _mamba2_step(
    x: torch.Tensor,  # [B, H, P] float32
    dt: torch.Tensor,  # [B, H] float32
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [B, G, N] float32
    C: torch.Tensor,  # [B, G, N] float32
    skip: torch.Tensor,  # [H, 1], D
    s: torch.Tensor,  # [B, H, P, N] float32, updated in place
) -> torch.Tensor:  # [B, H, P] float32
    """One token of B sequences at once: decay, rank-1 write, read (mamba2_selective_state_update's order)."""
    num_seqs, num_heads, head_dim, state_dim = s.shape
    group = num_heads // B.shape[1]
    s.mul_((dt * A).exp()[..., None, None])
    flat = s.view(num_seqs * num_heads, head_dim, state_dim)
    b_heads = B.repeat_interleave(group, dim=1).reshape(-1, 1, state_dim)  # [B*H, 1, N]
    flat.baddbmm_((x * dt[..., None]).reshape(-1, head_dim, 1), b_heads)
    c_heads = C.repeat_interleave(group, dim=1).reshape(-1, state_dim, 1)  # [B*H, N, 1]
    return torch.bmm(flat, c_heads).view(num_seqs, num_heads, head_dim) + x * skip


def _mamba2_chunked(
    x: torch.Tensor,  # [L, H, P]
    dt: torch.Tensor,  # [L, H] float32, after softplus and clamp
    A: torch.Tensor,  # [H]
    B: torch.Tensor,  # [L, G, N]
    C: torch.Tensor,  # [L, G, N]
    skip: torch.Tensor,  # [H, 1]
    s: torch.Tensor | None,  # [H, P, N] float32, None: zero
    start: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # y [L, H, P] float32, the final state [H, P, N]
    """mamba2_chunk_scan for one sequence, chunk by chunk: within a chunk y = (C B^T * L) (dt x) with L the
    segment-summed decays; between chunks the state, read through C and decayed, then written."""
    num_heads = x.shape[1]
    group = num_heads // B.shape[1]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for a, b in _chunk_bounds(start, x.shape[0], chunk_size):
        n = b - a
        xc, dtc = _head_major(x[a:b]), _head_major(dt[a:b])  # [H, n, P], [H, n]
        bc, cc = _head_major(B[a:b]), _head_major(C[a:b])  # [G, n, N]
        adt = A[:, None] * dtc  # [H, n]
        cum = adt.cumsum(dim=1)
        # segment sums as HF's segment_sum: sum of adt over (j, i] for j <= i (a cumsum of masked copies, which
        # keeps small differences exact where a difference of two long cumsums would not), -inf above
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        seg = adt[:, :, None].expand(num_heads, n, n).masked_fill(~causal.tril(-1), 0).cumsum(dim=1)
        seg = seg.masked_fill(~causal, float("-inf"))
        scores = (cc @ bc.transpose(1, 2)).repeat_interleave(group, dim=0) * seg.exp()  # [H, n, n]
        xdt = xc * dtc[..., None]  # [H, n, P]
        y = scores @ xdt
        b_heads = bc.repeat_interleave(group, dim=0)  # [H, n, N]
        if s is not None:
            y = y + (cc.repeat_interleave(group, dim=0) @ s.transpose(1, 2)) * cum.exp()[..., None]
        write = (xdt * (cum[:, -1:] - cum).exp()[..., None]).transpose(1, 2) @ b_heads  # [H, P, N]
        s = write if s is None else s * cum[:, -1].exp()[:, None, None] + write
        out[a:b] = (y + xc * skip[:, None]).transpose(0, 1)
    return out, s


SUBSTITUTION_BLOCK = 16


def _unit_lower_inverse(m: torch.Tensor) -> torch.Tensor:  # [H, n, n] -> [H, n, n]
    """(I + strictly_lower(m))^-1, m's diagonal and upper part ignored (solve_triangular's unitriangular).

    Forward substitution inside 16-row diagonal blocks, all blocks of all heads at once, then the blocks merged
    pairwise, [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]: the blocked substitution of fla's
    solve_tril, stable like a triangular solve. NOTE: torch's batched solve_triangular makes one LAPACK call per
    matrix (~40x a bmm of the same shape here, and slower at 2 threads than at 1); this is ~25 small calls.
    """
    heads, n, _ = m.shape
    size = SUBSTITUTION_BLOCK
    while size < n:
        size *= 2
    lower = F.pad(m.tril(-1), (0, size - n, 0, size - n))  # identity rows past n keep the top-left block exact
    block = min(SUBSTITUTION_BLOCK, size)
    num_blocks = size // block
    grid = lower.view(heads, num_blocks, block, num_blocks, block)
    diag = torch.stack([grid[:, j, :, j] for j in range(num_blocks)], dim=1)  # [H, nb, block, block]
    inv = torch.eye(block, dtype=m.dtype, device=m.device).repeat(heads, num_blocks, 1, 1)
    for i in range(1, block):  # row i of the inverse from the rows above it
        inv[..., i, :i] = -torch.matmul(diag[..., i : i + 1, :i], inv[..., :i, :i])[..., 0, :]
    while block < size:
        # pairs (2j, 2j+1) of blocks of this size; C: the part of `lower` below the first, left of the second
        grid = lower.view(heads, num_blocks, block, num_blocks, block)
        below = torch.stack([grid[:, 2 * j + 1, :, 2 * j] for j in range(num_blocks // 2)], dim=1)
        first, second = inv[:, 0::2], inv[:, 1::2]
        corner = -torch.matmul(second, torch.matmul(below, first))
        inv = torch.cat([torch.cat([first, torch.zeros_like(first)], -1), torch.cat([corner, second], -1)], -2)
        block, num_blocks = 2 * block, num_blocks // 2
    return inv[:, 0, :n, :n]


def rms_norm_gated(
    x: torch.Tensor,  # [N, d]
    z: torch.Tensor,  # [N, d], the gate
    weight: torch.Tensor,  # [d]
    eps: float,
    *,
    activation: str = "silu",  # the gate's: "silu" or "sigmoid"
    norm_before_gate: bool = True,
    group_size: int | None = None,  # normalise groups of this many channels (None: all d)
    multiply_in_float32: bool = False,
) -> torch.Tensor:  # [N, d] in x's dtype
    """RMSNorm with an output gate, statistics in float32, in the three orders upstream uses:
    Qwen3_5RMSNormGated (the defaults): norm, weight multiplied in x's dtype, then * silu(z) in float32;
    NemotronHRMSNormGated (norm_before_gate=False, group_size=d / n_groups): x * silu(z), grouped norm, weight;
    KimiLinearRMSNormGated (activation="sigmoid", multiply_in_float32=True): norm, float32 weight, * sigmoid(z).
    (Our silu / sigmoid, which may differ from torch's by an ulp.)"""
    dtype = x.dtype
    h = x.to(torch.float32)
    gate = {"silu": silu, "sigmoid": sigmoid}[activation](z.to(torch.float32))
    if not norm_before_gate:
        h = h * gate
    grouped = h.unflatten(-1, (-1, group_size)) if group_size else h
    h = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)
    h = weight.to(torch.float32) * h if multiply_in_float32 else weight * h.to(dtype)
    if norm_before_gate:
        h = h * gate
    return h.to(dtype)
