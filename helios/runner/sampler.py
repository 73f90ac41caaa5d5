"""Per-request sampling state and the batch sampler: penalties, temperature, top-k, top-p, min-p, seeded draw.

Batch invariance is the contract: a request gets bit-identical tokens alone or in any batch. Batched
math is restricted to operations whose per-element result cannot depend on the batch: IEEE-exact
elementwise ops (+ - * /, compare, select), selections (max, argmax, sort, gather) and integer sums.
Everything else (exp, log, the noise draw) runs row by row, except exp/log on CUDA (see rowwise) and the
noise on a GPU: one counter-based kernel launch whose values depend on (seed, position, token id) alone.
Imports torch, helios.engine.messages, helios.runner.penalties and helios.kernels (the GPU argmax).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from helios.engine.messages import SamplingParams
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.layers.transfer import device_tensor, to_device
from helios.runner.penalties import apply_penalties

GREEDY_TEMPERATURE = 1e-5  # below this temperature a request is sampled greedily (argmax)
_SEED_MASK = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny  # the smallest exponential noise kept (log stays finite)


class SamplerState:
    """The sampling state of one request: its params, its generator and its token statistics.

    The generator is seeded from params.seed and lives on the logits' device (created at the first
    draw unless `device` is given). Prompt tokens count for the repetition penalty; output tokens
    count for repetition, presence and frequency (as vLLM does).
    NOTE: draw n (n = 0, 1, ...) of the generator belongs to output position n. Tokens appended without
    being drawn here (outputs re-sent after preemption, forced tokens) are skipped in the generator at
    the next draw, so a resumed request continues exactly as an uninterrupted one would.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        device: torch.device | str | None = None,
    ):
        self.params = params
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.is_greedy = params.temperature < GREEDY_TEMPERATURE
        self.has_penalties = (
            params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        self._generator: torch.Generator | None = None
        self._num_draws = 0  # generator draws consumed so far (one vocab-sized draw per position)
        self._counted = False  # drawn by the counter-based device noise (counter_draw): no generator state
        # penalty statistics on the logits' device, built at first use and then kept in sync
        self._prompt_mask: torch.Tensor | None = None  # [vocab] bool
        self._output_counts: torch.Tensor | None = None  # [vocab] int32
        self._num_counted = 0  # output tokens already folded into the tensors above
        if device is not None:
            self._generator = self._new_generator(torch.device(device))

    def append(self, token_id: int) -> None:
        """Record one output token (sampled, forced or re-sent after preemption)."""
        self.output_token_ids.append(int(token_id))

    # --- used by sample() -------------------------------------------------------------------------

    def _new_generator(self, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(self.params.seed & _SEED_MASK)
        return generator

    def draw_exponential(self, out: torch.Tensor) -> None:  # out: [vocab] float32, filled in place
        """Fill `out` with Exponential(1) noise for the next output position, from this request's generator."""
        if self._counted:
            raise RuntimeError("a request's sampler state cannot leave the counter-based noise after sampling")
        if self._generator is None or self._generator.device != out.device:
            if self._generator is not None and self._num_draws:
                raise RuntimeError("a request's sampler state cannot move between devices after sampling")
            self._generator = self._new_generator(out.device)
        # skip the draws of positions that were appended without being drawn here
        while self._num_draws < len(self.output_token_ids):
            torch.empty_like(out).exponential_(generator=self._generator)
            self._num_draws += 1
        out.exponential_(generator=self._generator)
        self._num_draws += 1

    def counter_draw(self) -> tuple[int, int]:
        """(seed as a signed 64-bit int, output position) of the next draw by the counter-based device noise
        (helios.kernels.sampling.exponential_log_noise), which keeps no generator: a position appended without a
        draw is skipped for free. One request keeps one kind of noise."""
        if self._num_draws and not self._counted:
            raise RuntimeError("a request's sampler state cannot move to the counter-based noise after sampling")
        self._counted = True
        position = len(self.output_token_ids)
        self._num_draws = position + 1
        seed = self.params.seed & _SEED_MASK
        return (seed - (1 << 64) if seed >= 1 << 63 else seed), position

    def penalty_tensors(self, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([vocab] bool: token in the prompt, [vocab] int32: count in the output), synced with append()."""
        if self._prompt_mask is None or self._prompt_mask.device != device or self._prompt_mask.numel() != vocab_size:
            self._prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
            self._num_counted = 0
            if self.prompt_token_ids:
                self._prompt_mask[_token_index(self.prompt_token_ids, vocab_size, device)] = True
        assert self._output_counts is not None
        pending = self.output_token_ids[self._num_counted :]
        if len(pending) > 4:  # a re-sent request: one scatter instead of many small adds
            index = _token_index(pending, vocab_size, device)
            ones = torch.ones(len(pending), dtype=torch.int32, device=device)
            self._output_counts.index_put_((index,), ones, accumulate=True)  # integer adds: exact
        else:
            # NOTE: a slice update needs no host-to-device index copy (which would sync the stream)
            for t in pending:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"token id {t} outside the vocabulary of {vocab_size}")
                self._output_counts[t : t + 1] += 1
        self._num_counted = len(self.output_token_ids)
        return self._prompt_mask, self._output_counts


def _token_index(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"token id outside the vocabulary of {vocab_size}")
    return device_tensor(token_ids, torch.int64, device)


def rowwise(x: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # x: [rows, ...]
    """Apply a transcendental elementwise op (exp, log) so that each row's result ignores the batch.

    NOTE: CPU kernels split a contiguous buffer into a SIMD body and a scalar tail (and threads split it
    anywhere), and the two paths may use different exp/log implementations, so an element's result could
    depend on its offset in the batch: we call the op once per row. CUDA elementwise kernels evaluate the
    same function for every element whatever its position, so they take the whole batch at once
    (test_cuda_exp_and_log_ignore_the_batch checks this on the device).
    """
    if x.device.type == "cuda" or x.shape[0] == 1:
        return op(x)
    return torch.stack([op(row) for row in x])


def _param_tensor(values: list, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    return device_tensor(values, dtype, device)


TOP_P_WINDOW = 1024  # top-p first looks for its cutoff among this many largest logits of a row


def _top_k_top_p(
    x: torch.Tensor,  # [rows, vocab] float32 tempered logits
    top_k: list[int],  # per row, in 1..vocab (vocab = off)
    top_p: list[float],  # per row, 1.0 = off
    width: int | None = None,  # how many of the largest entries to sort (None: as few as suffice)
) -> torch.Tensor:  # [rows, vocab] with filtered tokens at -inf
    """Keep, per row, the tokens at or above a cutoff value: the k-th largest, then the top-p cutoff.

    Ties at a cutoff are kept (the support never depends on token ids). top-p keeps the shortest
    prefix of the sorted, top-k-filtered distribution whose mass reaches top_p (a token is kept when
    the mass strictly before it is below top_p), measured in exact fixed point: weights exp(x - max)
    in [0, 1] are floored to multiples of 2**-S and summed as int64 (exact in any order), and compared
    with top_p * total in float64 on integers below 2**53. Only the `width` largest entries are sorted
    (torch.topk: exact values); a row whose cutoff may lie beyond them is redone with a 16x wider window
    (at last the whole sorted row), so the result never depends on `width`, hence on the other rows.
    """
    rows, vocab = x.shape
    device = x.device
    has_k = [k < vocab for k in top_k]
    if width is None:
        wanted = [k if hk else (TOP_P_WINDOW if p < 1.0 else 1) for k, hk, p in zip(top_k, has_k, top_p)]
        width = min(vocab, max(wanted))
    if width == vocab:
        values, index = torch.sort(x, dim=-1, descending=True)  # [rows, vocab]
    else:
        values, index = torch.topk(x, width, dim=-1)  # [rows, width], sorted descending
    k_index = _param_tensor([min(k, width) - 1 for k in top_k], device, torch.int64)[:, None]
    no_k = _param_tensor([not hk for hk in has_k], device, torch.bool)[:, None]
    cutoff_k = values.gather(1, k_index).masked_fill(no_k, -math.inf)  # [rows, 1]
    if all(p >= 1.0 for p in top_p):
        return x.masked_fill(x < cutoff_k, -math.inf)

    # a row of only -inf keeps a finite max so that x - max never becomes nan
    row_max = values[:, :1].clamp_min(torch.finfo(torch.float32).min)
    weights = rowwise(x - row_max, torch.exp)  # [rows, vocab] in [0, 1]
    shift = 53 - vocab.bit_length()  # vocab * 2**shift <= 2**53: sums stay exact in float64
    # NOTE: float32 is exact here: scaling by 2**shift and flooring a float32 both give a float32
    fixed = torch.floor(weights * float(2**shift)).to(torch.int64)
    fixed = fixed.masked_fill(x < cutoff_k, 0)  # top-k first
    total = fixed.sum(-1, keepdim=True)  # [rows, 1] int64, exact
    window = fixed.gather(1, index)  # [rows, width] in sorted order (ties have equal weights)
    before = window.cumsum(-1) - window  # mass strictly before each sorted position
    p = _param_tensor(top_p, device, torch.float64)[:, None]
    in_p = (before.double() < p * total.double()) & (values >= cutoff_k)  # a prefix of the window
    num_kept = in_p.sum(-1).clamp_min(1)  # [rows]; the max is always kept
    cutoff = values.gather(1, (num_kept - 1)[:, None])
    cutoff = torch.where(p >= 1.0, cutoff_k, cutoff)
    out = x.masked_fill(x < cutoff, -math.inf)
    if width < vocab:
        # NOTE: with top-k the window holds every kept value (ties beyond it equal the k-th); without,
        # a row that keeps the whole window may keep more: redo those with a 16x wider window.
        full = [i for i, n in enumerate(num_kept.tolist()) if n == width and not has_k[i] and top_p[i] < 1.0]
        if full:
            wider = min(vocab, 16 * width)
            redo = _top_k_top_p(x[full], [top_k[i] for i in full], [top_p[i] for i in full], width=wider)
            out[torch.tensor(full, device=device)] = redo
    return out


def _min_p(
    x: torch.Tensor,  # [rows, vocab] float32 tempered (and top-k/top-p filtered) logits
    min_p: list[float],  # per row, > 0
) -> torch.Tensor:  # [rows, vocab] with filtered tokens at -inf
    """Keep tokens with p >= min_p * p_max, evaluated as (x - max) >= float32(log(min_p))."""
    row_max = x.amax(-1, keepdim=True)  # [rows, 1], exact
    threshold = _param_tensor([math.log(min(p, 1.0)) for p in min_p], x.device)[:, None]
    return x.masked_fill((x - row_max) < threshold, -math.inf)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:  # [len(rows), vocab]: x itself when all rows
    return x if len(rows) == x.shape[0] else x[device_tensor(rows, torch.int64, x.device)]


def _with_rows(x: torch.Tensor, rows: list[int], values: torch.Tensor, *, owned: bool) -> torch.Tensor:
    """x with `rows` replaced by values; writes into x only when it is `owned` (never the caller's logits)."""
    if len(rows) == x.shape[0]:
        return values
    if not owned:
        x = x.clone()
    x[device_tensor(rows, torch.int64, x.device)] = values
    return x


def transform_logits(
    logits: torch.Tensor,  # [batch, vocab] float32 raw logits (not modified)
    states: Sequence[SamplerState],
) -> torch.Tensor:  # [batch, vocab] float32; may be `logits` itself when nothing applies
    """The scores the draw uses, row by row: penalties; then for sampled (non-greedy) rows temperature,
    top-k, top-p and min-p, filtered tokens at -inf. Greedy rows get penalized logits only.

    Sampling row i draws argmax(scores[i] - log(E)) with E ~ Exponential(1) i.i.d. (the Gumbel-max
    form of the exponential race), i.e. a sample of softmax(scores[i]).
    """
    batch, vocab = logits.shape
    if len(states) != batch:
        raise ValueError(f"{batch} logit rows but {len(states)} sampler states")
    x = logits.to(torch.float32)
    owned = x is not logits
    penalized = [i for i, s in enumerate(states) if s.has_penalties]
    if penalized:
        prompt_masks, counts = zip(*(states[i].penalty_tensors(vocab, x.device) for i in penalized))
        params = [states[i].params for i in penalized]
        values = apply_penalties(
            _rows(x, penalized),
            torch.stack(prompt_masks),
            torch.stack(counts),
            _param_tensor([p.repetition_penalty for p in params], x.device),
            _param_tensor([p.frequency_penalty for p in params], x.device),
            _param_tensor([p.presence_penalty for p in params], x.device),
        )
        x, owned = _with_rows(x, penalized, values, owned=owned), True
    sampled = [i for i, s in enumerate(states) if not s.is_greedy]
    if not sampled:
        return x
    params = [states[i].params for i in sampled]
    temperature = _param_tensor([p.temperature for p in params], x.device)[:, None]
    y = _rows(x, sampled) / temperature  # [num_sampled, vocab]: a new tensor
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # 0 and -1 both mean off
    top_p = [p.top_p for p in params]
    filtered = [j for j in range(len(params)) if top_k[j] < vocab or top_p[j] < 1.0]
    if filtered:
        values = _top_k_top_p(_rows(y, filtered), [top_k[j] for j in filtered], [top_p[j] for j in filtered])
        y = _with_rows(y, filtered, values, owned=True)
    with_min_p = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if with_min_p:
        values = _min_p(_rows(y, with_min_p), [params[j].min_p for j in with_min_p])
        y = _with_rows(y, with_min_p, values, owned=True)
    return _with_rows(x, sampled, y, owned=owned)


def draw_logits(
    logits: torch.Tensor,  # [batch, vocab] float32 (not modified)
    masks: Sequence[bytes | None],  # per row: allowed tokens as little-endian int32 bitmask words, None: all
    biases: Sequence[tuple[tuple[int, float], ...]] = (),  # per row: (token id, bias) pairs (logit_bias)
) -> torch.Tensor:  # [batch, vocab] float32: `logits` itself when nothing applies, else a copy
    """What the draw reads before penalties and temperature: each row's logit_bias added, then structured
    output's token mask (helios/engine/constraint.py), refused tokens at -inf. Tokens past a mask's last word
    are refused; mask bits past the vocabulary are ignored. Logprobs never read this: they stay raw."""
    batch, vocab = logits.shape
    if len(masks) != batch or (biases and len(biases) != batch):
        raise ValueError(f"{batch} logit rows but {len(masks)} token masks and {len(biases)} bias lists")
    biased = [i for i, b in enumerate(biases) if b]
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not biased and not rows:
        return logits
    out = logits.clone()
    if biased:
        index = [(i, t) for i in biased for t, _ in biases[i]]
        values = device_tensor([v for i in biased for _, v in biases[i]], out.dtype, out.device)
        row_ids, token_ids = zip(*index)
        # NOTE: one indexed add: a row's ids are distinct (resolve_sampling merged duplicates)
        out.index_put_((device_tensor(row_ids, torch.int64, out.device),
                        device_tensor(token_ids, torch.int64, out.device)), values, accumulate=True)
    if rows:
        num_words = (vocab + 31) // 32
        packed = bytearray(4 * num_words * len(rows))
        for j, i in enumerate(rows):
            m = masks[i][: 4 * num_words]
            packed[4 * num_words * j : 4 * num_words * j + len(m)] = m
        words = to_device(torch.frombuffer(packed, dtype=torch.int32).view(len(rows), num_words), logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words[:, :, None] >> shifts) & 1).view(len(rows), 32 * num_words)[:, :vocab].bool()
        index = device_tensor(rows, torch.int64, logits.device)
        out[index] = out[index].masked_fill(~allowed, -math.inf)
    return out


def sample(
    logits: torch.Tensor,  # [batch, vocab] float32 raw logits (not modified)
    states: Sequence[SamplerState],
    forced_token_ids: Sequence[int | None] | None = None,  # per row: an id to return instead of sampling
) -> list[int]:
    """One token id per row. Greedy rows (temperature < 1e-5) take the argmax, lowest id on ties, and
    consume no randomness; sampled rows draw one vocab-sized Exponential(1) vector from their own
    generator, so a request's tokens do not depend on the batch it is in. A forced row (the engine's
    reasoning close at the thinking budget) returns its id untouched and draws nothing now; its position's
    draw is skipped at the next one (SamplerState NOTE). The caller appends the returned ids to the states
    (SamplerState.append).
    """
    if forced_token_ids is not None and any(t is not None for t in forced_token_ids):
        if len(forced_token_ids) != len(states):
            raise ValueError(f"{len(states)} sampler states but {len(forced_token_ids)} forced entries")
        free = [i for i, t in enumerate(forced_token_ids) if t is None]
        drawn = iter(sample(_rows(logits, free), [states[i] for i in free]) if free else [])
        return [int(t) if t is not None else next(drawn) for t in forced_token_ids]
    return sample_device(logits, states).tolist()


def sample_device(
    logits: torch.Tensor,  # [batch, vocab] float32 raw logits (not modified)
    states: Sequence[SamplerState],
) -> torch.Tensor:  # [batch] int64 on the logits' device
    """sample() without forced rows and without reading the ids back: the ids stay on the device, so the
    caller can enqueue more work (the runner's speculative next decode step) before it waits for them.
    The same rules and the same generator draws as sample(); the caller appends the ids to the states.
    """
    scores = transform_logits(logits, states)  # [batch, vocab]
    sampled = [i for i, s in enumerate(states) if not s.is_greedy]
    if sampled:
        if counter_noise(scores.device):
            from helios.kernels.sampling import exponential_log_noise

            seeds, positions = zip(*(states[i].counter_draw() for i in sampled))
            # NOTE: one copy for both; the positions start 16-byte aligned, as in the kernel the core compiled ahead
            # of time (Triton specializes a pointer on its alignment: an odd offset would compile another)
            n, m = len(sampled), len(sampled) + len(sampled) % 2
            ids = device_tensor(seeds + (0,) * (m - n) + positions, torch.int64, scores.device)
            log_noise = exponential_log_noise(ids[:n], ids[m:], scores.shape[1])
        else:
            noise = torch.empty((len(sampled), scores.shape[1]), dtype=torch.float32, device=scores.device)
            for row, i in enumerate(sampled):
                states[i].draw_exponential(noise[row])
            log_noise = rowwise(noise.clamp_min_(_TINY), torch.log)  # finite: -inf scores stay -inf
        # scores is not the caller's tensor here: transform_logits copied it for the sampled rows
        scores = _with_rows(scores, sampled, _rows(scores, sampled) - log_noise, owned=True)
    # NOTE: argmax returns the first maximal index: greedy ties go to the lowest token id.
    return argmax(scores)


def counter_noise(device: torch.device) -> bool:
    """Whether a batch's noise comes from one launch of the counter-based kernel (on a GPU: a generator per row
    costs a launch and a Python call per sampled row each step, host time at a large batch) rather than from
    each request's torch generator (elsewhere: the interpreter would run the kernel over every vocabulary)."""
    return device.type == "cuda" and HAS_TRITON and not interpret_mode()


def argmax(scores: torch.Tensor) -> torch.Tensor:  # [batch, vocab] float32 -> [batch] int64
    """Row argmax, lowest id on ties: helios.kernels.sampling's two-launch kernel on a GPU (torch's gives a
    row to one block), torch's elsewhere."""
    if scores.is_cuda and HAS_TRITON and not interpret_mode():
        from helios.kernels.sampling import argmax_rows

        return argmax_rows(scores.contiguous())
    return scores.argmax(dim=-1)
