"""The sampling tail's reductions: the greedy argmax, a one-pass per-row log-softmax normalizer, and exact
top-N logprobs.

`argmax_rows` splits each row into 4096-wide chunks: one program per (row, chunk) finds the chunk's maximum and
its lowest id, a second kernel picks the first chunk holding the row's maximum. torch.argmax gives a one-row
reduction over a 128k vocabulary to a single block (28 us a decode step on the H200); two short launches over
the whole chip take a few. Ties go to the lowest id, as torch's do; a nan counts as +inf.

`row_logsumexp` is a Triton kernel: one program per row of logits [B, V] keeps a running max and rescaled
sum over fixed BLOCK-wide tiles, so it reads the row once (torch.logsumexp makes an amax pass, then an
exp-sum pass, through temporaries), and a row's result never depends on the rows batched with it (the
reduction order is fixed by V and BLOCK alone), which the runner's batch-invariance contract requires.

`exponential_log_noise` draws the sampler's noise for a whole batch in one launch: log E with E ~ Exponential(1),
counter-based (Philox keyed by the request's seed, counted by the output position and the token id), so a row's
noise depends on (seed, position) alone, never on the batch or on earlier draws, and skipping a position costs
nothing. E = -log(u) with u = (r + 0.5) / 2**32 for a 32-bit draw r, in float64: u never rounds to 1, so E > 1e-10
and log E stays finite (in float32, u near 1 rounds to 1 and E to 0, which a -inf score turns into nan).

`top_logprobs` stays in torch: one torch.topk over a unique int64 key per entry (the reported logprob's
order-preserving bits, then 2**32 - 1 - token id) is a radix select on CUDA, already memory-bound for N <= 20,
and its result is exact: decreasing logprob, ties by increasing token id, never topk's unspecified tie
order. A Triton top-k would need tl.sort/tl.topk, which are not long-standing Triton APIs.
Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import check_last_dim_contiguous, jit, require_triton, tl

NONFINITE_LOGPROB = -9999.0  # what helios.runner.logprobs reports for a non-finite logprob
_BLOCK = 4096


@jit
def _row_logsumexp_kernel(
    x_ptr,  # [num_rows, vocab] float32
    max_ptr,  # [num_rows] float32
    lse_ptr,  # [num_rows] float32
    stride_x,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # per-lane running max and rescaled sum; lanes merge once at the end
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        idx = start + offs
        x = tl.load(x_ptr + row * stride_x + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # NOTE: a lane that is -inf so far exponentiates against 0 (exp(-inf) = 0), not -inf - -inf = nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    g = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(s * tl.exp(m - g), axis=0)
    lse = g + tl.log(total)  # total == 0 (all -inf) gives -inf; a nan logit makes it nan, as torch does
    lse = tl.where(row_max == float("inf"), float("inf"), lse)
    tl.store(max_ptr + row, row_max)
    tl.store(lse_ptr + row, lse)


_ARGMAX_BLOCK = 4096
_NO_ID = 2**31 - 1  # past any id (the kernels spell it out: Triton reads no plain globals)


@jit
def _argmax_chunk_kernel(
    x_ptr,  # [num_rows, vocab] float32
    val_ptr,  # [num_rows, num_chunks] float32: each chunk's maximum
    idx_ptr,  # [num_rows, num_chunks] int32: its lowest id
    stride_x,
    vocab,
    num_chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + idx, mask=idx < vocab, other=float("-inf"))
    x = tl.where(x != x, float("inf"), x)
    best = tl.max(x, axis=0)
    # padding lanes hold -inf too: their ids (>= vocab) lose to any real id of an all -inf chunk
    first = tl.min(tl.where(x == best, idx, 2147483647), axis=0)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@jit
def _argmax_merge_kernel(
    val_ptr,  # [num_rows, num_chunks] float32
    idx_ptr,  # [num_rows, num_chunks] int32
    out_ptr,  # [num_rows] int64
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    v = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=2147483647)
    best = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == best, i, 2147483647), axis=0).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] float32 -> [num_rows] int64
    """torch.argmax(x, dim=-1) for float32 rows (lowest id on ties), in two launches."""
    require_triton()
    assert x.dim() == 2 and x.dtype == torch.float32, "x must be [num_rows, vocab] float32"
    check_last_dim_contiguous("x", x)
    num_rows, vocab = x.shape
    assert 0 < vocab < _NO_ID, f"vocabulary of {vocab}"
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    num_chunks = -(-vocab // _ARGMAX_BLOCK)
    vals = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=x.device)
    _argmax_chunk_kernel[(num_rows, num_chunks)](x, vals, ids, x.stride(0), vocab, num_chunks, BLOCK=_ARGMAX_BLOCK,
                                                 num_warps=4)
    block_c = max(16, 1 << (num_chunks - 1).bit_length())
    _argmax_merge_kernel[(num_rows,)](vals, ids, out, num_chunks, BLOCK_C=block_c, num_warps=1)
    return out


_NOISE_BLOCK = 1024  # Philox counters per program; each gives four draws, stored as four BLOCK-wide stripes


@jit
def _exponential_log_noise_kernel(
    seed_ptr,  # [num_rows] int64: the request's 64-bit seed, two's complement
    pos_ptr,  # [num_rows] int64: the output position the draw belongs to
    out_ptr,  # [num_rows, vocab] float32
    stride_out,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    i = tl.arange(0, BLOCK)
    counter = (blk * BLOCK + i).to(tl.uint32)
    zero = counter * 0
    pos_lo = zero + (pos & 0xFFFFFFFF).to(tl.uint32)
    pos_hi = zero + (pos >> 32).to(tl.uint32)
    # counter words: (token block lane, position low, position high, 0); the key is the seed
    r0, r1, r2, r3 = tl.philox(seed, counter, pos_lo, pos_hi, zero)
    idx = blk * (4 * BLOCK) + i
    out = out_ptr + row * stride_out + idx
    tl.store(out, _log_exponential(r0), mask=idx < vocab)
    tl.store(out + BLOCK, _log_exponential(r1), mask=idx + BLOCK < vocab)
    tl.store(out + 2 * BLOCK, _log_exponential(r2), mask=idx + 2 * BLOCK < vocab)
    tl.store(out + 3 * BLOCK, _log_exponential(r3), mask=idx + 3 * BLOCK < vocab)


@jit
def _log_exponential(r):  # uint32 draws -> float32 log E
    u = (r.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # (r + 0.5) / 2**32, exact in float64
    e = (-tl.log(u)).to(tl.float32)  # >= 1.16e-10: never 0
    return tl.log(e)


def exponential_log_noise(
    seeds: torch.Tensor,  # [num_rows] int64 (a 64-bit seed as its two's complement)
    positions: torch.Tensor,  # [num_rows] int64 >= 0
    vocab: int,
) -> torch.Tensor:  # [num_rows, vocab] float32: log E, E ~ Exponential(1) i.i.d.
    """The sampler's log-noise for one draw per row, a function of (seed, position, token id) alone."""
    require_triton()
    assert seeds.dtype == positions.dtype == torch.int64 and seeds.shape == positions.shape and seeds.dim() == 1
    num_rows = seeds.shape[0]
    out = torch.empty(num_rows, vocab, dtype=torch.float32, device=seeds.device)
    if num_rows == 0:
        return out
    grid = (num_rows, -(-vocab // (4 * _NOISE_BLOCK)))
    _exponential_log_noise_kernel[grid](seeds, positions, out, out.stride(0), vocab, BLOCK=_NOISE_BLOCK, num_warps=4)
    return out


def row_logsumexp(
    logits: torch.Tensor,  # [num_rows, vocab] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # (row max [num_rows], logsumexp [num_rows]) float32
    require_triton()
    assert logits.dim() == 2 and logits.dtype == torch.float32, "logits must be [num_rows, vocab] float32"
    check_last_dim_contiguous("logits", logits)
    num_rows, vocab = logits.shape
    row_max = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(row_max)
    if num_rows == 0:
        return row_max, lse
    _row_logsumexp_kernel[(num_rows,)](logits, row_max, lse, logits.stride(0), vocab, BLOCK=_BLOCK, num_warps=8)
    return row_max, lse


def row_logsumexp_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.amax(dim=-1), torch.stack([torch.logsumexp(row, dim=0) for row in logits])


def reported_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    lse: torch.Tensor,  # [num_rows] float32
) -> torch.Tensor:  # [num_rows, vocab] float32
    """logit - lse as reported: non-finite -> NONFINITE_LOGPROB, -0.0 -> 0.0 (helios.runner.logprobs' rule)."""
    lp = logits - lse[:, None]
    return torch.where(torch.isfinite(lp), lp, NONFINITE_LOGPROB) + 0.0


def _order_key(rep: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] float32 -> int64
    """Unique key ordering by (value descending, token id ascending) under topk; needs no nan, no -0.0."""
    bits = rep.contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # same order as the floats, in [-2**31, 2**31)
    ids = torch.arange(rep.shape[1], dtype=torch.int64, device=rep.device)
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids)


def top_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] float32 raw logits
    num: int,  # N <= 20 in practice; clamped to the vocabulary
    lse: torch.Tensor | None = None,  # [num_rows] float32, from row_logsumexp when already computed
) -> tuple[torch.Tensor, torch.Tensor]:  # (values [num_rows, N] float32, token ids [num_rows, N] int64)
    """The N largest reported logprobs per row, by decreasing value then increasing token id."""
    if lse is None:
        lse = row_logsumexp(logits)[1] if logits.is_cuda else row_logsumexp_ref(logits)[1]
    rep = reported_logprobs(logits, lse)
    num = min(num, logits.shape[1])
    ids = _order_key(rep).topk(num, dim=-1, sorted=True).indices
    return rep.gather(1, ids), ids


def top_logprobs_ref(logits, num, lse=None):
    """A stable descending sort: equal values keep increasing token order."""
    if lse is None:
        lse = row_logsumexp_ref(logits)[1]
    rep = reported_logprobs(logits, lse)
    values, ids = torch.sort(rep, dim=-1, descending=True, stable=True)
    num = min(num, logits.shape[1])
    return values[:, :num], ids[:, :num]
