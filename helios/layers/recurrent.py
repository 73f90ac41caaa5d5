"""Recurrent (linear-attention) layer ops over helios' flattened batch: the CPU/torch reference of each kernel.

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
# written with exp and log1p, whose two paths agree (checked by the batch and thread tests).


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
    num_tokens, num_v_heads, v_dim = v.shape
    group = num_v_heads // k.shape[1]
    q = l2norm(q.to(torch.float32))
    k = l2norm(k.to(torch.float32))
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)  # [T, Hv, dk]
    g, beta = g.to(torch.float32), beta.to(torch.float32)
    out = torch.empty(num_tokens, num_v_heads, v_dim, dtype=v.dtype, device=v.device)
    lengths = _lengths(query_start_loc)
    one_token = sorted((i for i, n in enumerate(lengths) if n == 1), key=lambda i: slots[i])
    if one_token:
        rows = torch.tensor([query_start_loc[i] for i in one_token], device=v.device)
        s, write_back = _slot_rows(state, [slots[i] for i in one_token], [starts[i] == 0 for i in one_token])
        o = _recurrent_step(q[rows], k[rows], v[rows].to(torch.float32), g[rows], beta[rows], s)
        write_back()
        out[rows] = o.to(v.dtype)
    for i, n in enumerate(lengths):
        if n < 2:
            continue
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        s = state[slots[i]] if starts[i] > 0 else None
        o, s = _chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], s, starts[i], chunk_size)
        state[slots[i]] = s
        out[rows] = o
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


def _recurrent_step(
    q: torch.Tensor,  # [B, H, dk] float32, normalised
    k: torch.Tensor,  # [B, H, dk] float32, normalised
    v: torch.Tensor,  # [B, H, dv] float32
    g: torch.Tensor,  # [B, H]
    beta: torch.Tensor,  # [B, H]
    s: torch.Tensor,  # [B, H, dk, dv] float32, updated in place
) -> torch.Tensor:  # [B, H, dv] float32
    """One token of B sequences at once, in HF's recurrent order (decay, read, delta, write, read)."""
    num_seqs, num_heads, key_dim, value_dim = s.shape
    q = q / key_dim**0.5
    s.mul_(g.exp()[..., None, None])
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


def _chunked(
    q: torch.Tensor,  # [L, H, dk] float32, normalised
    k: torch.Tensor,  # [L, H, dk] float32, normalised
    v: torch.Tensor,  # [L, H, dv]
    g: torch.Tensor,  # [L, H] float32
    beta: torch.Tensor,  # [L, H] float32
    s: torch.Tensor | None,  # [H, dk, dv] float32, None: zero
    start: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [L, H, dv] in v's dtype, the final state [H, dk, dv]
    """torch_chunk_gated_delta_rule for one sequence, chunk by chunk (UT transform inside a chunk, the state
    carried between chunks); HF's zero padding of the last chunk is dropped, which changes no real row."""
    scale = q.shape[-1] ** -0.5
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for a, b in _chunk_bounds(start, q.shape[0], chunk_size):
        # head-major copies of the chunk: [H, n, d] and [H, n]
        qc, kc = q[a:b].transpose(0, 1).contiguous() * scale, k[a:b].transpose(0, 1).contiguous()
        vc = v[a:b].transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
        gc, bc = g[a:b].t().contiguous(), beta[a:b].t().contiguous()
        n = b - a
        cum = gc.cumsum(dim=-1)  # [H, n] log of the decay from the chunk's start through each row
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        pair = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()  # [H, n, n]
        k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
        # HF solves (I + strictly_lower(system)) x = rhs for two right-hand sides (solve_triangular, unitriangular)
        inverse = _unit_lower_inverse((k_beta @ kc.transpose(-1, -2)) * pair)
        attn = (qc @ kc.transpose(-1, -2)) * pair
        new_values = inverse @ v_beta
        cum_exp = cum.exp()[..., None]
        if s is None:  # a fresh sequence's first chunk: HF's zero state adds exact zeros
            o = attn @ new_values
            v_new = new_values
        else:
            v_new = new_values - (inverse @ (k_beta * cum_exp)) @ s
            o = (qc * cum_exp) @ s + attn @ v_new
        last = cum[:, -1:]  # [H, 1]
        k_tail = kc * (last - cum).exp()[..., None]  # each key decayed to the chunk's end
        write = k_tail.transpose(-1, -2) @ v_new
        s = write if s is None else s * last.exp()[..., None] + write
        out[a:b] = o.transpose(0, 1).to(v.dtype)
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
) -> torch.Tensor:  # [N, d] in x's dtype
    """Qwen3_5RMSNormGated: norm in float32, weight multiplied in x's dtype, then * silu(z) in float32 (our silu,
    which may differ from F.silu by an ulp)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * silu(z.to(torch.float32))).to(dtype)
