"""helios.runner.logprobs against a float64 python reference: values, ranks with ties, order, -9999.0, explicit ids."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helios.runner.logprobs as logprobs_module
from helios.engine.messages import PositionLogprobs, TokenLogprob
from helios.runner.logprobs import NONFINITE_LOGPROB, logprobs_for, prompt_logprobs_for

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]

# --- the reference --------------------------------------------------------------------------------


def ref_reported(row: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a float32 row, non-finite -> -9999.0."""
    x = row.astype(np.float64)
    finite = np.isfinite(x)
    if not finite.any() or np.isnan(x).any() or np.isposinf(x).any():
        return np.full(x.shape, NONFINITE_LOGPROB)
    m = x[finite].max()
    lse = m + math.log(np.exp(x[finite] - m).sum())
    lp = x - lse
    return np.where(np.isfinite(lp), lp, NONFINITE_LOGPROB)


def ref_record(row: np.ndarray, token: int, top_n: int | None, explicit) -> PositionLogprobs:
    rep = ref_reported(row)
    rank = lambda i: 1 + int((rep > rep[i]).sum())  # noqa: E731
    entry = lambda i: TokenLogprob(i, float(rep[i]), rank(i))  # noqa: E731
    if explicit:
        alternatives = [entry(i) for i in dict.fromkeys(explicit)]
    else:
        order = sorted(range(len(rep)), key=lambda i: (-rep[i], i))  # python sort, ties by id
        alternatives = [entry(i) for i in order[: top_n or 0]]
    return PositionLogprobs(token=entry(token), alternatives=alternatives)


def assert_same(got: PositionLogprobs, want: PositionLogprobs, tol: float = 1e-5) -> None:
    pairs = [(got.token, want.token)] + list(zip(got.alternatives, want.alternatives, strict=True))
    for g, w in pairs:
        assert (g.token_id, g.rank) == (w.token_id, w.rank), (got, want)
        if w.logprob == NONFINITE_LOGPROB:
            assert g.logprob == NONFINITE_LOGPROB
        else:
            assert abs(g.logprob - w.logprob) <= tol * max(1.0, abs(w.logprob))


def grid_logits(rng: np.random.Generator, rows: int, vocab: int, num_neg_inf: int = 0) -> np.ndarray:
    """Logits on a grid of 1/4 (many exact ties; distinct values stay distinct in float32 logprobs)."""
    x = (rng.integers(-24, 24, size=(rows, vocab)) / 4).astype(np.float32)
    for r in range(rows):
        x[r, rng.choice(vocab, size=num_neg_inf, replace=False)] = -np.inf
    return x


# --- natural alternatives -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(5))
def test_natural_alternatives_match_reference(seed, device):
    rng = np.random.default_rng(seed)
    rows, vocab = 8, 257
    x = grid_logits(rng, rows, vocab, num_neg_inf=int(rng.integers(0, 40)))
    tokens = rng.integers(0, vocab, size=rows)
    top_n = [None, 0, 1, 2, 5, 20, 20, 7]
    got = logprobs_for(torch.from_numpy(x).to(device), torch.from_numpy(tokens).to(device), top_n, [None] * rows)
    assert got[0] is None
    for r in range(1, rows):
        assert_same(got[r], ref_record(x[r], int(tokens[r]), top_n[r], None))


@pytest.mark.parametrize("device", DEVICES)
def test_ties_select_the_lowest_ids_not_topk_order(device):
    vocab = 4096
    x = torch.zeros(1, vocab)
    x[0, [4000, 17, 3999]] = 1.0  # three above a tie of 4093 equal entries
    got = logprobs_for(x.to(device), torch.tensor([4095], device=device), [6], [None])[0]
    assert [a.token_id for a in got.alternatives] == [17, 3999, 4000, 0, 1, 2]
    assert [a.rank for a in got.alternatives] == [1, 1, 1, 4, 4, 4]
    assert got.token.rank == 4 and got.token.logprob == got.alternatives[-1].logprob


def test_all_equal_row():
    vocab = 50
    got = logprobs_for(torch.full((1, vocab), 3.5), torch.tensor([49]), [20], [None])[0]
    assert [a.token_id for a in got.alternatives] == list(range(20))
    assert {a.rank for a in got.alternatives} == {1} and got.token.rank == 1
    assert abs(got.token.logprob + math.log(vocab)) < 1e-6


def test_top_n_beyond_the_vocabulary_is_clamped():
    x = torch.tensor([[0.0, 1.0, 2.0]])
    got = logprobs_for(x, torch.tensor([0]), [20], [None])[0]
    assert [(a.token_id, a.rank) for a in got.alternatives] == [(2, 1), (1, 2), (0, 3)]


# --- explicit ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_ids_in_caller_order_deduplicated_without_the_sampled_token(device):
    rng = np.random.default_rng(7)
    x = grid_logits(rng, 3, 100, num_neg_inf=5)
    explicit = [(50, 3, 50, 99, 3), (7,), ()]  # () behaves as omission: natural top-2
    tokens = np.array([11, 7, 4])
    got = logprobs_for(torch.from_numpy(x).to(device), torch.from_numpy(tokens).to(device), [5, None, 2], explicit)
    assert [a.token_id for a in got[0].alternatives] == [50, 3, 99]  # sampled 11 not appended
    assert [a.token_id for a in got[1].alternatives] == [7]  # sampled and listed: listed once
    for r in range(3):
        assert_same(got[r], ref_record(x[r], int(tokens[r]), [5, None, 2][r], explicit[r]))
    neg_inf = int(np.flatnonzero(np.isinf(x[0]))[0])
    rec = logprobs_for(torch.from_numpy(x[:1]), torch.tensor([neg_inf]), [None], [(neg_inf, 0)])[0]
    assert rec.alternatives[0].logprob == NONFINITE_LOGPROB and rec.alternatives[0].rank == 96


def test_explicit_id_outside_the_vocabulary_is_rejected():
    with pytest.raises(ValueError):
        logprobs_for(torch.zeros(1, 10), torch.tensor([0]), [None], [(10,)])


# --- non-finite values -------------------------------------------------------------------------------------


def test_negative_infinity_reports_minus_9999():
    x = torch.tensor([[-math.inf, 2.0, -math.inf, 2.0, 0.0, -math.inf]])
    got = logprobs_for(x, torch.tensor([2]), [5], [None])[0]
    assert got.token == TokenLogprob(2, NONFINITE_LOGPROB, 4)  # 1 + three finite entries
    assert [(a.token_id, a.rank) for a in got.alternatives] == [(1, 1), (3, 1), (4, 3), (0, 4), (2, 4)]
    assert got.alternatives[-1].logprob == NONFINITE_LOGPROB


def test_nan_row_reports_minus_9999_everywhere():
    x = torch.tensor([[0.0, math.nan, 1.0]])
    got = logprobs_for(x, torch.tensor([2]), [2], [None])[0]
    assert got.token == TokenLogprob(2, NONFINITE_LOGPROB, 1)
    assert got.alternatives == [TokenLogprob(0, NONFINITE_LOGPROB, 1), TokenLogprob(1, NONFINITE_LOGPROB, 1)]


def test_certain_token_reports_positive_zero():
    x = torch.tensor([[-0.0, -math.inf, -math.inf]])
    got = logprobs_for(x, torch.tensor([0]), [1], [None])[0]
    assert got.token.logprob == 0.0 and math.copysign(1.0, got.token.logprob) == 1.0
    assert got.token.rank == 1 and got.alternatives == [got.token]


# --- values, invariance, prompt records ------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [7, 50_000, 151_936])
def test_values_are_logit_minus_an_accurate_logsumexp(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g) * 4
    tokens = torch.randint(0, vocab, (4,), generator=g)
    got = logprobs_for(x, tokens, [3] * 4, [None] * 4)
    for r in range(4):
        lse64 = torch.logsumexp(x[r].double(), 0)
        lse32 = x[r, tokens[r]] - torch.tensor(got[r].token.logprob, dtype=torch.float32)
        # the float32 lse used is within one float32 ulp of the exact one
        assert abs(lse32.double() - lse64) <= torch.finfo(torch.float32).eps * max(1.0, abs(lse64.item()))
        # and the value is exactly float32(logit) - that float32 lse
        assert got[r].token.logprob == (x[r, tokens[r]] - lse32).item()


@pytest.mark.parametrize("device", DEVICES)
def test_records_do_not_depend_on_the_batch(device):
    rng = np.random.default_rng(3)
    x = torch.from_numpy((rng.standard_normal((9, 150_001)) * 3).astype(np.float32)).to(device)
    tokens = torch.from_numpy(rng.integers(0, 150_001, 9)).to(device)
    top_n = [5, None, 0, 20, 1, 3, 20, 2, 4]
    explicit = [None, None, None, (1, 2, 3), None, None, None, (999,), None]
    batched = logprobs_for(x, tokens, top_n, explicit)
    for r in range(9):
        assert logprobs_for(x[r : r + 1].clone(), tokens[r : r + 1], [top_n[r]], [explicit[r]]) == [batched[r]]


def test_logits_are_not_modified():
    x = torch.randn(3, 40)
    before = x.clone()
    logprobs_for(x, torch.tensor([0, 1, 2]), [5, 5, None], [None, (1, 2), None])
    prompt_logprobs_for(x, torch.tensor([0, 1, 2]), 3)
    assert torch.equal(x, before)


def test_prompt_logprobs_match_generation_records_across_blocks(monkeypatch):
    rng = np.random.default_rng(5)
    num_positions, vocab = 23, 97
    x = torch.from_numpy(grid_logits(rng, num_positions, vocab, num_neg_inf=3))
    next_ids = torch.from_numpy(rng.integers(0, vocab, num_positions))
    whole = prompt_logprobs_for(x, next_ids, 4)
    monkeypatch.setattr(logprobs_module, "_BLOCK_ELEMENTS", vocab * 5)  # blocks of 5 rows
    assert prompt_logprobs_for(x, next_ids, 4) == whole
    assert whole == logprobs_for(x, next_ids, [4] * num_positions, [None] * num_positions)
    for p in range(num_positions):
        assert_same(whole[p], ref_record(x[p].numpy(), int(next_ids[p]), 4, None))
    assert prompt_logprobs_for(x[:0], next_ids[:0], 4) == []
    assert all(r.alternatives == [] for r in prompt_logprobs_for(x, next_ids, 0))


def test_bfloat16_logits_are_promoted():
    x = torch.randn(2, 30).to(torch.bfloat16)
    got = logprobs_for(x, torch.tensor([1, 2]), [3, 3], [None, None])
    assert got == logprobs_for(x.float(), torch.tensor([1, 2]), [3, 3], [None, None])


# --- properties --------------------------------------------------------------------------------------------

VALUES = [-math.inf, -4.0, -1.0, -0.5, 0.0, 0.5, 2.0, 7.25]


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    values=st.lists(st.sampled_from(VALUES), min_size=1, max_size=30),
    top_n=st.integers(0, 25),
)
def test_property_matches_reference(data, values, top_n):
    vocab = len(values)
    x = np.array(values, dtype=np.float32)
    token = data.draw(st.integers(0, vocab - 1))
    explicit = data.draw(st.one_of(st.none(), st.lists(st.integers(0, vocab - 1), max_size=8).map(tuple)))
    got = logprobs_for(torch.from_numpy(x[None]), torch.tensor([token]), [top_n], [explicit])[0]
    assert_same(got, ref_record(x, token, top_n, explicit))
    if not explicit:
        assert len(got.alternatives) == min(top_n, vocab)
