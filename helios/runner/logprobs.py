"""Generation and prompt logprob records from raw logits (spec: "Generation/Prompt log probabilities").

Values are the raw distribution: float32 logit - logsumexp(logits) over the full vocabulary, before
temperature, penalties and filters. Non-finite values are reported as -9999.0, and ranks and orders are
computed on the reported values: rank = 1 + number of vocabulary entries with a strictly greater
reported logprob (equal values share a rank); natural alternatives are ordered by decreasing logprob,
then increasing token id, selected exactly (never by torch.topk's unspecified tie order).
Imports torch, helios.engine.messages and helios.runner.sampler (its rowwise helper) only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from helios.engine.messages import PositionLogprobs, TokenLogprob
from helios.runner.sampler import rowwise

NONFINITE_LOGPROB = -9999.0
_BLOCK_ELEMENTS = 1 << 23  # rows are processed in blocks of about this many logits (int64 keys: 64 MiB)


def reported_logprobs(logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows, vocab] float32
    """float32 logit - logsumexp(logits) as reported: non-finite -> -9999.0, -0.0 -> 0.0.

    NOTE: a float reduction's accumulation order depends on the batch shape (CUDA splits a row across
    blocks when there are few rows), so the sum of exp(x - max) is taken in exact fixed point instead:
    float32 weights in [0, 1] floored to multiples of 2**-S, S = 62 - vocab.bit_length(), summed as int64
    (exact in any order; the truncation, under vocab * 2**-S of a sum >= 1, is 1.5e-8 for a 152k
    vocabulary: finer than float32 accumulation), then lse = max + log(sum) in float64, rounded to
    float32. A row's values never depend on the rows it is batched with.
    """
    x = logits.to(torch.float32)
    vocab = x.shape[1]
    row_max = x.amax(-1, keepdim=True)  # [rows, 1], exact; nan when the row holds a nan
    bad = ~torch.isfinite(row_max)  # rows of only -inf, or with +inf or nan: every value non-finite
    safe_max = row_max.masked_fill(bad, 0.0)
    weights = rowwise((x - safe_max).masked_fill(bad, -math.inf), torch.exp)  # [rows, vocab] in [0, 1]
    shift = 62 - vocab.bit_length()  # vocab * 2**shift < 2**62: no int64 overflow
    # scaling a float32 by 2**shift and flooring it are exact in float32
    total = torch.floor(weights * float(2**shift)).to(torch.int64).sum(-1, keepdim=True)
    log_total = rowwise(total.double().clamp_min(1.0), torch.log)  # [rows, 1]; >= shift * ln 2 in good rows
    lse = (safe_max.double() + (log_total - shift * math.log(2.0))).to(torch.float32)
    lp = (x - lse).masked_fill(bad, math.nan)
    return torch.where(torch.isfinite(lp), lp, NONFINITE_LOGPROB) + 0.0


def _order_key(rep: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32 -> [rows, vocab] int64
    """A unique int64 key per entry ordering by (logprob descending, token id ascending) under topk.

    High 32 bits: the float's bits mapped to a signed integer of the same order (negative floats have
    their magnitude bits flipped); low 32 bits: 2**32 - 1 - token id. Requires no nan and no -0.0.
    """
    bits = rep.contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # in [-2**31, 2**31)
    ids = torch.arange(rep.shape[1], dtype=torch.int64, device=rep.device)
    return ordered * (1 << 32) + ((1 << 32) - 1 - ids)


def _tie_ranks(values: list[float]) -> list[int]:
    """Ranks of a list sorted by decreasing value that holds every entry greater than its last one."""
    ranks: list[int] = []
    for j, value in enumerate(values):
        ranks.append(ranks[-1] if j and value == values[j - 1] else j + 1)
    return ranks


def _block_records(
    logits: torch.Tensor,  # [rows, vocab] raw logits
    token_ids: list[int],  # [rows] the actual (chosen or next prompt) token of each row
    top_n: list[int],  # per row, natural alternatives wanted (ignored where explicit)
    explicit: list[tuple[int, ...] | None],  # per row, deduplicated explicit ids or None
) -> list[PositionLogprobs]:
    rows, vocab = logits.shape
    device = logits.device
    rep = reported_logprobs(logits)  # [rows, vocab]
    token = torch.tensor(token_ids, dtype=torch.int64, device=device)[:, None]  # [rows, 1]
    token_value = rep.gather(1, token)  # [rows, 1]
    token_rank = (rep > token_value).sum(-1) + 1  # [rows], an integer count: exact
    alternatives: list[list[TokenLogprob]] = [[] for _ in range(rows)]

    natural = [i for i in range(rows) if explicit[i] is None and top_n[i] > 0]
    if natural:
        num = min(max(top_n[i] for i in natural), vocab)
        sub = rep[torch.tensor(natural, device=device)] if len(natural) < rows else rep
        ids = _order_key(sub).topk(num, dim=-1, sorted=True).indices  # [n_natural, num], exact order
        values = sub.gather(1, ids)
        for i, row_ids, row_values in zip(natural, ids.tolist(), values.tolist()):
            row_ids, row_values = row_ids[: top_n[i]], row_values[: top_n[i]]
            alternatives[i] = [
                TokenLogprob(t, v, r) for t, v, r in zip(row_ids, row_values, _tie_ranks(row_values))
            ]

    listed = [i for i in range(rows) if explicit[i] is not None]
    if listed:
        width = max(len(explicit[i]) for i in listed)
        padded = [list(explicit[i]) + [0] * (width - len(explicit[i])) for i in listed]
        if min(min(row) for row in padded) < 0 or max(max(row) for row in padded) >= vocab:
            raise ValueError(f"explicit logprob token id outside the vocabulary of {vocab}")
        ids = torch.tensor(padded, dtype=torch.int64, device=device)  # [n_listed, width]
        sub = rep[torch.tensor(listed, device=device)] if len(listed) < rows else rep
        values = sub.gather(1, ids)
        ascending = torch.sort(sub, dim=-1).values  # exact permutation
        not_greater = torch.searchsorted(ascending, values.contiguous(), right=True)  # count <= value
        ranks = vocab - not_greater + 1
        for i, row_ids, row_values, row_ranks in zip(listed, padded, values.tolist(), ranks.tolist()):
            n = len(explicit[i])
            alternatives[i] = [TokenLogprob(t, v, r) for t, v, r in zip(row_ids[:n], row_values[:n], row_ranks[:n])]

    return [
        PositionLogprobs(token=TokenLogprob(t, v, r), alternatives=alts)
        for t, v, r, alts in zip(token_ids, token_value[:, 0].tolist(), token_rank.tolist(), alternatives)
    ]


def _records(
    logits: torch.Tensor,  # [rows, vocab]
    token_ids: list[int],
    top_n: list[int],
    explicit: list[tuple[int, ...] | None],
) -> list[PositionLogprobs]:
    rows, vocab = logits.shape
    block = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    out: list[PositionLogprobs] = []
    for start in range(0, rows, block):
        end = min(rows, start + block)
        out += _block_records(logits[start:end], token_ids[start:end], top_n[start:end], explicit[start:end])
    return out


def logprobs_for(
    logits: torch.Tensor,  # [batch, vocab] raw logits of the sampled positions (not modified)
    token_ids: torch.Tensor | Sequence[int],  # [batch] int, the sampled token of each row
    top_n: Sequence[int | None],  # per row: None = no logprobs, N >= 0 = top-N natural alternatives
    explicit: Sequence[tuple[int, ...] | None],  # per row: explicit alternative ids (replace top-N) or None
) -> list[PositionLogprobs | None]:
    """One generation logprob record per row, None for rows that asked for none.

    A row is explicit when explicit[i] is non-empty (duplicates dropped, first occurrence kept), else
    natural when top_n[i] is not None, else None. The record's `token` is always the sampled token with
    its logprob and rank. `alternatives` is exactly:
    - natural: the top-N entries (N clamped to the vocabulary) by decreasing logprob, then increasing id;
      the sampled token appears there only if it is naturally among them;
    - explicit: the explicit ids in caller order; the sampled token is NOT appended when absent (the
      protocol encoder appends it from `token`).
    """
    batch = logits.shape[0]
    if not (len(token_ids) == len(top_n) == len(explicit) == batch):
        raise ValueError("logprobs_for: logits, token_ids, top_n and explicit must have one entry per row")
    ids = [tuple(dict.fromkeys(e)) if e else None for e in explicit]
    want = [i for i in range(batch) if ids[i] is not None or top_n[i] is not None]
    out: list[PositionLogprobs | None] = [None] * batch
    if not want:
        return out
    rows = logits if len(want) == batch else logits[torch.tensor(want, device=logits.device)]
    tokens = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    records = _records(rows, [tokens[i] for i in want], [top_n[i] or 0 for i in want], [ids[i] for i in want])
    for i, record in zip(want, records):
        out[i] = record
    return out


def prompt_logprobs_for(
    logits: torch.Tensor,  # [num_positions, vocab] raw logits; row p predicts next_token_ids[p]
    next_token_ids: torch.Tensor | Sequence[int],  # [num_positions] int, the actual next prompt token of each row
    top_n: int,  # natural alternatives per position (0 = the actual token only)
) -> list[PositionLogprobs]:
    """One prompt logprob record per position: the actual next token with logprob and rank, and the top-N
    natural alternatives (same rules as logprobs_for). Rows are processed in blocks, so a long prefill
    chunk never materializes more than a few [rows, vocab] temporaries.
    """
    num_positions = logits.shape[0]
    if len(next_token_ids) != num_positions:
        raise ValueError("prompt_logprobs_for: one next token per logits row")
    if num_positions == 0:
        return []
    next_ids = next_token_ids.tolist() if isinstance(next_token_ids, torch.Tensor) else list(next_token_ids)
    return _records(logits, next_ids, [top_n] * num_positions, [None] * num_positions)
