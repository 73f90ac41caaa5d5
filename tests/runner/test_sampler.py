"""helios.runner.sampler against a numpy reference: penalties, temperature, filters, seeded draws, batch invariance."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helios.engine.messages import SamplingParams
import helios.runner.sampler as sampler_module
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.sampler import SamplerState, _top_k_top_p, sample, transform_logits

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


# --- the reference -------------------------------------------------------------------------------


def ref_scores(logits: np.ndarray, params: SamplingParams, prompt, outputs) -> tuple[np.ndarray, float]:
    """Straightforward float32 numpy transform (top-p mass in float64) and the top-p decision margin."""
    x = logits.astype(np.float32).copy()
    vocab = x.shape[0]
    if params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0:
        seen = np.zeros(vocab, dtype=bool)
        seen[list(prompt) + list(outputs)] = True
        counts = np.bincount(np.asarray(outputs, dtype=np.int64), minlength=vocab).astype(np.float32)
        rep = np.where(seen, np.float32(params.repetition_penalty), np.float32(1.0))
        x = np.where(x > 0, x / rep, x * rep).astype(np.float32)
        x = (x - np.float32(params.frequency_penalty) * counts).astype(np.float32)
        x = (x - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32)).astype(np.float32)
    if params.temperature < 1e-5:
        return x, math.inf
    x = (x / np.float32(params.temperature)).astype(np.float32)
    if 0 < params.top_k < vocab:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x = np.where(x < kth, np.float32(-np.inf), x)
    margin = math.inf
    if params.top_p < 1:
        xs = np.sort(x)[::-1].astype(np.float64)
        w = np.exp(xs - xs[0])
        total = w.sum()
        before = np.cumsum(w) - w
        keep = before < params.top_p * total
        n = max(1, int(keep.sum()))
        x = np.where(x < xs[n - 1], np.float32(-np.inf), x)
        # position 0 is always kept, whatever the comparison says
        margin = float(np.min(np.abs(before[1:] - params.top_p * total), initial=np.inf) / total)
    if params.min_p > 0:
        m = x.max()
        x = np.where((x - m) < np.float32(math.log(min(params.min_p, 1.0))), np.float32(-np.inf), x)
    return x.astype(np.float32), margin


def ref_probs(scores: np.ndarray) -> np.ndarray:
    s = scores.astype(np.float64)
    w = np.exp(s - s.max())
    return w / w.sum()


def planted_logits(rng: np.random.Generator, vocab: int, scale: float = 2.0) -> np.ndarray:
    x = (rng.standard_normal(vocab) * scale).astype(np.float32)
    ties = rng.integers(0, vocab, size=(vocab // 8, 2))
    x[ties[:, 0]] = x[ties[:, 1]]  # planted exact ties
    return x


@pytest.fixture(params=["generator", pytest.param("counter", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="the counter-based noise is a Triton kernel"))])
def noise(request, monkeypatch):
    """Each request's torch generator (the CPU's noise), or the counter-based kernel (a GPU's; on CPU tensors only
    where Triton interprets)."""
    counter = request.param == "counter"
    monkeypatch.setattr(sampler_module, "counter_noise",
                        lambda device: counter and (device.type == "cuda" or interpret_mode()))
    return request.param


def make_states(params_list, prompts, device=None):
    return [SamplerState(p, prompt, device) for p, prompt in zip(params_list, prompts)]


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 5.0, 5.0, -1.0]])
    states = make_states([SamplingParams(temperature=t) for t in (0.0, 1e-6, 0.0)], [[], [], []])
    assert sample(logits, states) == [1, 0, 2]
    assert all(s._generator is None for s in states)  # greedy consumes no randomness


def test_greedy_row_in_a_mixed_batch_ignores_temperature_and_filters():
    rng = np.random.default_rng(0)
    x = planted_logits(rng, 300)
    x[[7, 200]] = x.max() + 1.0  # a tie at the top
    logits = torch.from_numpy(np.stack([x, x, x]))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.0, top_p=0.1),
    ]
    tokens = sample(logits, make_states(params, [[], [], []]))
    assert tokens[0] == 7 and tokens[2] == 7


# --- penalties and transforms against the reference ------------------------------------------------


def test_penalties_worked_example():
    # prompt [1, 2] counts for repetition only; outputs [2, 3, 3] for all three penalties
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    state = SamplerState(params, [1, 2])
    for t in (2, 3, 3):
        state.append(t)
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    assert transform_logits(logits, [state])[0].tolist() == [1.0, 1.0, -2.75, -1.0, 3.0]


def test_penalty_statistics_follow_appends():
    rng = np.random.default_rng(1)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    state = SamplerState(params, [5, 6, 6])
    x = planted_logits(rng, 64)
    outputs = []
    for t in [3, 5, 9, 9, 63, 0]:
        got = transform_logits(torch.from_numpy(x[None]), [state])[0].numpy()
        assert np.array_equal(got, ref_scores(x, params, [5, 6, 6], outputs)[0])
        state.append(t)
        outputs.append(t)


RANDOM_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=10),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, top_p=0.95),
    SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, top_k=40),
    SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5),
    SamplingParams(temperature=2.0, top_p=0.5, repetition_penalty=0.9),
    SamplingParams(temperature=0.6, top_p=0.95, top_k=64, presence_penalty=-0.5, min_p=0.01),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.0),
    SamplingParams(temperature=1.0, min_p=1.0),
]


@pytest.mark.parametrize("window", [1024, 16, 1])
@pytest.mark.parametrize("seed", range(6))
def test_transform_matches_reference(seed, window, monkeypatch):
    monkeypatch.setattr(sampler_module, "TOP_P_WINDOW", window)
    rng = np.random.default_rng(seed)
    vocab = 513
    rows = [planted_logits(rng, vocab, scale=float(rng.uniform(0.5, 4))) for _ in RANDOM_PARAMS]
    rows[0][:10] = -np.inf  # masked logits stay masked
    prompts = [rng.integers(0, vocab, size=int(rng.integers(0, 30))).tolist() for _ in RANDOM_PARAMS]
    outputs = [rng.integers(0, vocab, size=int(rng.integers(0, 30))).tolist() for _ in RANDOM_PARAMS]
    states = make_states(RANDOM_PARAMS, prompts)
    for state, out in zip(states, outputs):
        for t in out:
            state.append(t)
    logits = torch.from_numpy(np.stack(rows))
    before = logits.clone()
    got = transform_logits(logits, states).numpy()
    assert torch.equal(logits, before)  # the caller's logits are never modified
    for i, params in enumerate(RANDOM_PARAMS):
        want, margin = ref_scores(rows[i], params, prompts[i], outputs[i])
        if margin < 1e-6:
            continue  # the reference's float64 mass is too close to top_p to decide
        assert np.array_equal(got[i], want), (i, params)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_ignores_the_sorted_width(seed):
    # the window of sorted entries is a batch-dependent choice: the result must not depend on it
    rng = np.random.default_rng(seed)
    vocab = 40
    x = torch.from_numpy(np.stack([planted_logits(rng, vocab, scale=0.3) for _ in range(6)]))
    x[0, :12] = x[0, 3]  # a tie group straddling the k-th entry
    top_k = [4, 40, 40, 10, 1, 40]
    top_p = [0.99, 0.9, 0.999, 0.5, 0.3, 1e-9]
    full = _top_k_top_p(x, top_k, top_p, width=vocab)
    for width in range(10, vocab):
        assert torch.equal(_top_k_top_p(x, top_k, top_p, width=width), full), width
    # flat rows without top-k escalate the window (x16) until the cutoff is inside it
    x = torch.from_numpy(np.stack([planted_logits(rng, 600, scale=0.1) for _ in range(3)]))
    top_k, top_p = [600, 600, 600], [0.999, 0.5, 0.05]
    full = _top_k_top_p(x, top_k, top_p, width=600)
    for width in (1, 2, 5, 37, 599):
        assert torch.equal(_top_k_top_p(x, top_k, top_p, width=width), full), width


@pytest.mark.parametrize("top_k", [0, -1, 7, 8, 100])
def test_top_k_off_values(top_k):
    x = torch.randn(1, 7)
    got = transform_logits(x, [SamplerState(SamplingParams(temperature=0.5, top_k=top_k), [])])
    assert torch.equal(got, x / torch.tensor([[0.5]]))


# --- supports and distributions by sampling ----------------------------------------------------------


def sampled_support(x: np.ndarray, params: SamplingParams, num: int) -> tuple[set[int], np.ndarray]:
    vocab = x.shape[0]
    states = [SamplerState(SamplingParams(**{**_fields(params), "seed": s}), []) for s in range(num)]
    tokens = sample(torch.from_numpy(np.tile(x, (num, 1))), states)
    return set(tokens), np.bincount(tokens, minlength=vocab) / num


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def test_top_k_keeps_ties_at_the_cutoff():
    x = np.array([5.0, 4.0, 4.0, 4.0, 1.0, 0.0, 3.9, -2.0], dtype=np.float32)
    support, _ = sampled_support(x, SamplingParams(temperature=2.0, top_k=2), 600)
    assert support == {0, 1, 2, 3}
    support, _ = sampled_support(x, SamplingParams(temperature=2.0, top_k=5), 600)
    assert support == {0, 1, 2, 3, 6}


@pytest.mark.parametrize(
    ("top_p", "expected"), [(0.3, {0}), (0.65, {0, 1}), (0.75, {0, 1, 2}), (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3, 4})]
)
def test_top_p_support(top_p, expected):
    probs = np.array([0.4, 0.3, 0.2, 0.09, 0.01])
    x = np.log(probs).astype(np.float32)
    support, _ = sampled_support(x, SamplingParams(temperature=1.0, top_p=top_p), 2000)
    assert support == expected


@pytest.mark.parametrize(("min_p", "expected"), [(0.25, {0, 1, 2}), (0.4, {0, 1}), (0.9, {0}), (0.01, {0, 1, 2, 3})])
def test_min_p_support(min_p, expected):
    probs = np.array([0.5, 0.25, 0.15, 0.1])
    x = np.log(probs).astype(np.float32)
    support, _ = sampled_support(x, SamplingParams(temperature=1.0, min_p=min_p), 1500)
    assert support == expected


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.7, top_p=0.7),
    ],
)
def test_filtered_distribution_matches_reference(params):
    x = np.array([2.0, 1.5, 1.5, 0.3, -0.5, -1.0, 0.9], dtype=np.float32)
    num = 20000
    support, freq = sampled_support(x, params, num)
    probs = ref_probs(ref_scores(x, params, [], [])[0])
    assert support == set(np.flatnonzero(probs > 0).tolist())
    sigma = np.sqrt(probs * (1 - probs) / num)
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-3), (freq, probs)


def test_one_generator_across_steps_matches_the_distribution(noise):
    x = np.array([1.0, 0.0, -1.0, 0.5], dtype=np.float32)
    state = SamplerState(SamplingParams(temperature=1.0, seed=123), [])
    logits = torch.from_numpy(x[None])
    num = 4000 if noise == "generator" else 500  # NOTE: the counter's kernel is interpreted here
    tokens = []
    for _ in range(num):
        tokens += sample(logits, [state])
        state.append(tokens[-1])
    freq = np.bincount(tokens, minlength=4) / num
    probs = ref_probs(x)
    assert np.all(np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / num) + 1e-3)


# --- seeds, resumption and batch invariance ------------------------------------------------------------


def step_logits(req: int, step: int, vocab: int) -> torch.Tensor:  # [vocab], the same alone or batched
    g = torch.Generator().manual_seed(10_000 * req + step)
    x = torch.randn(vocab, generator=g) * 3
    x[torch.randint(0, vocab, (vocab // 10,), generator=g)] = x[torch.randint(0, vocab, (1,), generator=g)]
    return x


def run_steps(params_list, prompts, order_of_steps, vocab, num_steps, device="cpu"):
    """Sample num_steps tokens for every request; order_of_steps(step) -> the groups sampled together."""
    states = make_states(params_list, prompts, device)
    tokens = [[] for _ in params_list]
    for step in range(num_steps):
        for group in order_of_steps(step):
            logits = torch.stack([step_logits(r, step, vocab) for r in group]).to(device)
            for r, t in zip(group, sample(logits, [states[r] for r in group])):
                tokens[r].append(t)
                states[r].append(t)
    return tokens


BATCH_PARAMS = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02),
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5),
    dict(temperature=1.0, top_k=1),
    dict(temperature=2.0, top_p=0.5, repetition_penalty=0.9),
    dict(temperature=1e-6),
    dict(temperature=1.0, top_k=0),
    dict(temperature=0.6, top_p=0.95, top_k=64, presence_penalty=-0.5),
    dict(temperature=1.0, min_p=0.3, frequency_penalty=-0.2),
    dict(temperature=1.0, seed=3),  # the same seed as request 3, other params
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("vocab", "noise"), [(1003, "generator"), (2053, "generator"), (1003, "counter")],
                         indirect=["noise"])
def test_batch_invariance(device, vocab, noise):
    params_list = [SamplingParams(**{"seed": i, **p}) for i, p in enumerate(BATCH_PARAMS)]
    rng = random.Random(vocab)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in params_list]
    n, num_steps = len(params_list), 20 if noise == "generator" else 8  # NOTE: the counter's kernel interpreted
    together = run_steps(params_list, prompts, lambda step: [list(range(n))], vocab, num_steps, device)
    alone = run_steps(params_list, prompts, lambda step: [[r] for r in range(n)], vocab, num_steps, device)

    def shuffled_groups(step):
        order = list(range(n))
        random.Random(step).shuffle(order)
        cuts = sorted(random.Random(step + 99).sample(range(1, n), 3))
        return [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]

    mixed = run_steps(params_list, prompts, shuffled_groups, vocab, num_steps, device)
    assert together == alone == mixed
    assert together[0] != together[1]  # the requests do differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [1003, 32_000, 151_936])
def test_cuda_exp_and_log_ignore_the_batch(vocab):
    # the premise of sampler._rowwise on CUDA: an element's exp/log never depends on its offset
    x = torch.randn(37, vocab, device="cuda") * 20
    for op in (torch.exp, torch.log):
        y = op(x.abs()) if op is torch.log else op(x)
        assert torch.equal(y, torch.stack([op(r.abs()) if op is torch.log else op(r) for r in x]))
        assert torch.equal(y[5:9], op(x[5:9].abs()) if op is torch.log else op(x[5:9]))


def test_transform_is_bitwise_batch_invariant():
    vocab = 1003
    params_list = [SamplingParams(**{"seed": i, **p}) for i, p in enumerate(BATCH_PARAMS)]
    prompts = [[i, i + 1, 2 * i] for i in range(len(params_list))]
    states = make_states(params_list, prompts)
    for i, s in enumerate(states):
        for t in range(i):
            s.append(3 * t)
    logits = torch.stack([step_logits(r, 0, vocab) for r in range(len(states))])
    together = transform_logits(logits, states)
    for r, s in enumerate(states):
        assert torch.equal(transform_logits(logits[r : r + 1].clone(), [s])[0], together[r])


def test_seeded_reproducibility(noise):
    vocab, steps = 1000, 30
    flat = [[0]] * 1  # one group of one request

    def run(seed):
        return run_steps([SamplingParams(temperature=1.0, seed=seed)], [[]], lambda _: flat, vocab, steps)[0]

    assert run(5) == run(5)
    assert run(5) != run(6)
    # seeds outside the generator's range are folded, not rejected
    assert run(-1) == run((1 << 64) - 1)


def test_resume_after_preemption_continues_the_same_stream(noise):
    vocab = 500
    params = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, seed=42)
    full = run_steps([params], [[1, 2, 3]], lambda _: [[0]], vocab, 10)[0]
    # re-sent after 5 tokens: the runner appends them to a fresh state, then samples on
    state = SamplerState(params, [1, 2, 3])
    for t in full[:5]:
        state.append(t)
    resumed = []
    for step in range(5, 10):
        t = sample(step_logits(0, step, vocab)[None], [state])[0]
        resumed.append(t)
        state.append(t)
    assert resumed == full[5:]


# --- properties -------------------------------------------------------------------------------------

GRID = [-math.inf, -3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0, 3.0]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.sampled_from(GRID), min_size=2, max_size=40).filter(lambda v: any(math.isfinite(a) for a in v)),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.integers(-1, 45),
    top_p=st.sampled_from([0.1, 0.5, 0.77, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.2, 0.6]),
    repetition_penalty=st.sampled_from([1.0, 0.8, 1.5]),
    frequency_penalty=st.sampled_from([0.0, 0.7, -0.3]),
    presence_penalty=st.sampled_from([0.0, 0.4]),
    history=st.lists(st.integers(0, 1), max_size=6),
    seed=st.integers(0, 2**63),
)
def test_sampled_token_lies_in_the_reference_support(values, history, **fields):
    x = np.array(values, dtype=np.float32)
    params = SamplingParams(**fields)
    prompt, outputs = [0], [h for h in history]
    state = SamplerState(params, prompt)
    for t in outputs:
        state.append(t)
    want, margin = ref_scores(x, params, prompt, outputs)
    got = transform_logits(torch.from_numpy(x[None]), [state])[0].numpy()
    if margin >= 1e-6:
        assert np.array_equal(got, want)
    token = sample(torch.from_numpy(x[None]), [state])[0]
    assert np.isfinite(got[token])
    if params.temperature < 1e-5:
        assert token == int(np.argmax(got))
