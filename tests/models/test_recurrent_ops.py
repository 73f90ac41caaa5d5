"""The recurrent layers' torch ops (helios.layers.recurrent) against transformers' torch paths, run one sequence at
a time: the causal conv, and the three scans (gated delta rule, Kimi delta rule, Mamba-2) over mixed batches (fresh
prefill, continued prefill, decode, one-token prompts) on scattered slots, float32 and bf16; the chunk grid's
exactness (a prompt split on multiples of the chunk, a sequence alone or in any batch, one or two threads: the same
bits); the gated norms and gates. Whole layers composed from the ops: test_recurrent_layers.py."""

from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from helios.layers.recurrent import (
    causal_conv,
    gated_delta_gates,
    gated_delta_rule,
    kimi_delta_gates,
    kimi_delta_rule,
    mamba2_scan,
    rms_norm_gated,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla, when installed, warns that Triton has no CPU driver
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.nemotron_h import modeling_nemotron_h as nemotron
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

# the torch functions themselves, under the hub-kernel / fla / mamba_ssm dispatch decorators
hf_conv_fn = inspect.unwrap(qwen3_5.causal_conv1d_fn)
hf_conv_update = inspect.unwrap(qwen3_5.causal_conv1d_update)
hf_chunk_gdr = inspect.unwrap(qwen3_5.torch_chunk_gated_delta_rule)
hf_recurrent_gdr = inspect.unwrap(qwen3_5.torch_recurrent_gated_delta_rule)
hf_chunk_kda = inspect.unwrap(kimi.chunk_kimi_delta_attention)
hf_recurrent_kda = inspect.unwrap(kimi.recurrent_kimi_delta_attention)
hf_chunk_mamba2 = inspect.unwrap(nemotron.mamba2_chunk_scan)
hf_mamba2_update = inspect.unwrap(nemotron.mamba2_selective_state_update)

NUM_SLOTS = 12


@contextmanager
def num_threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class Batch:
    """A step's layout: sequences (start, length) on slots; fresh sequences' slots hold NaN, so reading one shows."""

    def __init__(self, seqs: list[tuple[int, int]], slots: list[int]):
        self.starts = [s for s, _ in seqs]
        self.lengths = [n for _, n in seqs]
        self.slots = slots
        self.qsl = [0]
        for n in self.lengths:
            self.qsl.append(self.qsl[-1] + n)

    @property
    def num_tokens(self) -> int:
        return self.qsl[-1]

    def rows(self, i: int) -> slice:
        return slice(self.qsl[i], self.qsl[i + 1])

    def states(self, *shape: int, dtype=torch.float32, gen=None) -> torch.Tensor:  # [NUM_SLOTS, *shape]
        state = torch.randn(NUM_SLOTS, *shape, generator=gen).to(dtype)
        for slot, start in zip(self.slots, self.starts):
            if start == 0:
                state[slot] = float("nan")
        return state

    def args(self) -> tuple[list[int], list[int], list[int]]:
        return self.slots, self.qsl, self.starts


# fresh prefill across chunk ends, a prefill continuing mid-chunk, decodes, a one-token prompt, a short prompt
MIXED = Batch([(0, 40), (5, 1), (0, 1), (37, 30), (120, 1), (0, 2), (16, 17), (64, 1)], [3, 7, 0, 11, 5, 9, 1, 2])


# ---- causal conv


def conv_inputs(batch: Batch, channels: int, kernel: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch.num_tokens, channels, generator=g).to(dtype)
    weight = (torch.randn(channels, kernel, generator=g) * 0.5).to(dtype)
    bias = torch.randn(channels, generator=g).to(dtype)
    return x, weight, bias, batch.states(kernel - 1, channels, dtype=dtype, gen=g)


def conv_reference(x, weight, bias, state, batch: Batch, activation="silu"):
    """HF per sequence: causal_conv1d_fn for a fresh sequence, causal_conv1d_update (state [1, C, K-1]) otherwise."""
    outs, new_states = [], {}
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        xs = x[batch.rows(i)].t()[None]  # [1, C, L]
        if start == 0:
            outs.append(hf_conv_fn(xs, weight, bias, activation=activation)[0].t())
            window = F.pad(xs, (weight.shape[1] - 1, 0))
            new_states[slot] = window[0, :, -(weight.shape[1] - 1):].t().to(state.dtype)
        else:
            s = state[slot].t()[None].clone()
            outs.append(hf_conv_update(xs, s, weight, bias, activation=activation)[0].t())
            new_states[slot] = s[0].t().to(state.dtype)
    return torch.cat(outs), new_states


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv_matches_hf(dtype, tol, with_bias):
    x, weight, bias, state = conv_inputs(MIXED, 24, 4, dtype)
    bias = bias if with_bias else None
    expected, expected_states = conv_reference(x, weight, bias, state, MIXED)
    out = causal_conv(x, weight, state, *MIXED.args(), bias=bias)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    for slot, s in expected_states.items():
        assert torch.equal(state[slot], s), slot  # the last K-1 inputs, exactly


def test_causal_conv_keeps_zeros_before_a_short_fresh_sequence():
    batch = Batch([(0, 2), (0, 1)], [4, 6])
    x, weight, _, state = conv_inputs(batch, 8, 4, torch.float32)
    causal_conv(x, weight, state, *batch.args(), activation=None)
    assert torch.equal(state[4], torch.cat([torch.zeros(1, 8), x[0:2]]))
    assert torch.equal(state[6], torch.cat([torch.zeros(2, 8), x[2:3]]))


# ---- the scans: one case per op, each with its inputs, its call and HF's per-sequence reference


class Scan:
    """One recurrent op under test: `make` builds per-token tensors (sliced by rows), fixed params and the state;
    `run` calls the op; `reference` runs HF's torch functions one sequence at a time."""

    name = ""
    chunk_size = 64

    def run(self, tensors, params, state, slots, qsl, starts, chunk_size=None):
        raise NotImplementedError


class GatedDelta(Scan):
    name = "gated_delta"

    def make(self, batch, dtype, seed=0, heads=(2, 4), dims=(16, 24), decay=1.0):
        g = torch.Generator().manual_seed(seed)
        (hk, hv), (dk, dv), t = heads, dims, batch.num_tokens
        q, k = (torch.randn(t, hk, dk, generator=g).to(dtype) for _ in range(2))
        v = torch.randn(t, hv, dv, generator=g).to(dtype)
        # as the layer makes them: g = -exp(A_log) * softplus(a + dt_bias) in float32, beta = sigmoid(b)
        a_log = torch.rand(hv, generator=g) * 2 - 1
        log_decay = -a_log.exp() * F.softplus(torch.randn(t, hv, generator=g)) * decay
        beta = torch.sigmoid(torch.randn(t, hv, generator=g)).to(dtype)
        return (q, k, v, log_decay, beta), (), batch.states(hv, dk, dv, gen=g) * 0.5

    def run(self, tensors, params, state, slots, qsl, starts, chunk_size=None):
        return gated_delta_rule(*tensors, state, slots, qsl, starts, chunk_size=chunk_size or self.chunk_size)

    def reference_one(self, tensors, params, initial, one_token):
        kw = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        if one_token:
            return hf_recurrent_gdr(*tensors, **kw)
        return hf_chunk_gdr(*tensors, chunk_size=self.chunk_size, **kw)


class KimiDelta(GatedDelta):
    name = "kimi_delta"

    def make(self, batch, dtype, seed=0, heads=4, dims=(16, 24), decay=1.0):
        g = torch.Generator().manual_seed(seed)
        (dk, dv), t = dims, batch.num_tokens
        q, k = (torch.randn(t, heads, dk, generator=g).to(dtype) for _ in range(2))
        v = torch.randn(t, heads, dv, generator=g).to(dtype)
        # per key channel, as KimiLinearForgetGate: -exp(A_log) * softplus(f + dt_bias)
        a_log = torch.rand(heads, 1, generator=g) * 2 - 1
        log_decay = -a_log.exp() * F.softplus(torch.randn(t, heads, dk, generator=g) * 2) * decay
        beta = torch.sigmoid(torch.randn(t, heads, generator=g)).to(dtype)
        return (q, k, v, log_decay, beta), (), batch.states(heads, dk, dv, gen=g) * 0.5

    def run(self, tensors, params, state, slots, qsl, starts, chunk_size=None):
        return kimi_delta_rule(*tensors, state, slots, qsl, starts, chunk_size=chunk_size or self.chunk_size)

    def reference_one(self, tensors, params, initial, one_token):
        kw = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        if one_token:
            return hf_recurrent_kda(*tensors, **kw)
        return hf_chunk_kda(*tensors, chunk_size=self.chunk_size, **kw)


class Mamba2(Scan):
    name = "mamba2"
    chunk_size = 16

    def make(self, batch, dtype, seed=0, heads=(8, 2), dims=(16, 16), decay=1.0):
        g = torch.Generator().manual_seed(seed)
        (h, groups), (p, n), t = heads, dims, batch.num_tokens
        x = torch.randn(t, h, p, generator=g).to(dtype)
        dt = torch.randn(t, h, generator=g).to(dtype)
        b, c = (torch.randn(t, groups, n, generator=g).to(dtype) for _ in range(2))
        a_log = torch.log(torch.arange(1, h + 1, dtype=torch.float32) * decay)  # HF's initialisation
        d, dt_bias = torch.randn(h, generator=g), torch.randn(h, generator=g) * 0.5
        return (x, dt, b, c), (a_log, d, dt_bias), batch.states(h, p, n, gen=g) * 0.5

    def run(self, tensors, params, state, slots, qsl, starts, chunk_size=None):
        (x, dt, b, c), (a_log, d, dt_bias) = tensors, params
        return mamba2_scan(x, dt, a_log, b, c, d, dt_bias, state, slots, qsl, starts, chunk_size or self.chunk_size)

    def reference_one(self, tensors, params, initial, one_token):
        (x, dt, b, c), (a_log, d, dt_bias) = tensors, params
        p, n = x.shape[3], b.shape[-1]
        a = -a_log.exp()
        if one_token:  # as mamba2_scan_forward calls it
            state = initial.clone()
            y = hf_mamba2_update(state, x[:, 0], dt.transpose(1, 2).expand(-1, -1, p),
                                 a[:, None, None].expand(-1, p, n), b[:, 0], c[:, 0], d[:, None].expand(-1, p),
                                 dt_bias=dt_bias[:, None].expand(-1, p), dt_softplus=True)
            return y[:, None], state
        return hf_chunk_mamba2(x, dt, a, b, c, self.chunk_size, D=d, dt_bias=dt_bias, initial_states=initial,
                               dt_softplus=True, return_final_states=True)


SCANS = {case.name: case for case in (GatedDelta(), KimiDelta(), Mamba2())}


def reference(case: Scan, tensors, params, state, batch: Batch):
    """HF per sequence: the recurrent form for one token with a state (as the layers call it), else the chunked form."""
    outs, new_states = [], {}
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        r = batch.rows(i)
        initial = state[slot][None].clone() if start > 0 else None
        o, s = case.reference_one([t[r][None] for t in tensors], params, initial, batch.lengths[i] == 1 and start > 0)
        outs.append(o[0].to(tensors[0].dtype))
        new_states[slot] = s[0]
    return torch.cat(outs), new_states


BATCHES = {
    "prefill_from_zero": Batch([(0, 150), (0, 64), (0, 2), (0, 65)], [2, 0, 8, 5]),
    "prefill_from_state": Batch([(64, 100), (37, 30), (130, 2), (63, 1 + 64)], [1, 4, 10, 6]),
    "decode": Batch([(7, 1), (200, 1), (1, 1), (64, 1), (0, 1)], [9, 2, 5, 11, 0]),
    "decode_on_consecutive_slots": Batch([(7, 1), (0, 1), (30, 1)], [5, 4, 6]),  # updated in place, not gathered
    "mixed": MIXED,
}


def close(actual, expected, tol):
    """Within tol of the largest magnitude (at least 1): Mamba-2's outputs run to ~100, the delta rules' to ~1."""
    torch.testing.assert_close(actual, expected, atol=tol * max(1.0, expected.abs().max().item()), rtol=tol)


def check_against_hf(case: Scan, batch: Batch, dtype, tol, **make):
    tensors, params, state = case.make(batch, dtype, **make)
    expected, expected_states = reference(case, tensors, params, state, batch)
    out = case.run(tensors, params, state, *batch.args())
    assert out.dtype == dtype and state.dtype == torch.float32
    close(out, expected, tol)
    for slot, s in expected_states.items():
        close(state[slot], s, tol)  # bf16: HF's Mamba-2 step writes dt * B * x rounded to bf16


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("op", list(SCANS))
def test_scan_matches_hf(op, name, dtype, tol):
    """float32 within 1e-5; bf16 (inputs rounded, state float32) within 2 bf16 ulps of the largest output. (HF's
    bf16 Mamba-2 step rounds the state to bf16 before reading it; ours reads it in float32.)"""
    check_against_hf(SCANS[op], BATCHES[name], dtype, tol)


@pytest.mark.parametrize("op,make", [
    ("gated_delta", dict(heads=(16, 32), dims=(128, 128))),  # qwen3_5
    ("kimi_delta", dict(heads=8, dims=(128, 128))),  # kimi_linear's head size
    ("mamba2", dict(heads=(32, 4), dims=(64, 128))),  # nemotron_h's head and state sizes
])
def test_scan_matches_hf_at_real_head_sizes(op, make):
    check_against_hf(SCANS[op], Batch([(0, 70), (3, 1), (64, 3)], [1, 0, 2]), torch.float32, 1e-5, **make)


@pytest.mark.parametrize("op", ["kimi_delta", "mamba2"])
def test_scan_matches_hf_under_strong_decay(op):
    """Decays of tens of nats a token: a chunk's decays span far more than a float's range (kimi's per-channel
    scores must never form exp(+cum)), and the state forgets within a few tokens."""
    check_against_hf(SCANS[op], BATCHES["mixed"], torch.float32, 1e-5, decay=30.0)


def sequential_float64(q, k, v, g, beta, s0):
    """The gated delta rule token by token in float64: one sequence, q/k [L, Hk, dk], s0 [Hv, dk, dv]."""
    def norm(x):
        return x.double() * torch.rsqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    group = v.shape[1] // k.shape[1]
    q = norm(q).repeat_interleave(group, 1) * q.shape[-1] ** -0.5
    k = norm(k).repeat_interleave(group, 1)
    s, out = s0.double(), []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        delta = (v[t].double() - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t].double()[:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(out), s


def test_gated_delta_rule_with_repeated_keys():
    """The chunk's triangular system at its worst (one key, or its negation, for every token; no decay, beta ~1):
    the blocked inverse stays as close to a float64 token-by-token run as HF's triangular solve."""
    case, batch = SCANS["gated_delta"], Batch([(0, 64), (64, 64), (0, 40)], [0, 1, 2])
    (q, k, v, g, beta), params, state = case.make(batch, torch.float32, dims=(16, 16))
    k[:] = k[0]
    k[::3] = -k[0]
    g.zero_()
    beta.fill_(0.999)
    initial = state.clone()
    expected, expected_states = reference(case, (q, k, v, g, beta), params, state, batch)
    out = case.run((q, k, v, g, beta), params, state, *batch.args())
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        r = batch.rows(i)
        exact, exact_state = sequential_float64(q[r], k[r], v[r], g[r], beta[r],
                                                initial[slot] if start else torch.zeros(4, 16, 16))
        hf_error = (expected[r].double() - exact).abs().max()
        assert (out[r].double() - exact).abs().max() <= max(hf_error, 1e-6), i
        torch.testing.assert_close(out[r], expected[r], atol=1e-5, rtol=1e-5)
        assert (state[slot].double() - exact_state).abs().max() <= 1e-5, i
        torch.testing.assert_close(state[slot], expected_states[slot], atol=1e-5, rtol=1e-5)


def run_pieces(case: Scan, tensors, params, state, start: int, cuts: list[int], chunk_size: int, slot: int = 3):
    """One sequence from position `start`, run as the pieces between `cuts` (row offsets); outputs concatenated."""
    outs, bounds = [], [0, *cuts, tensors[0].shape[0]]
    for a, b in zip(bounds, bounds[1:]):
        piece = [t[a:b] for t in tensors]
        outs.append(case.run(piece, params, state, [slot], [0, b - a], [start + a], chunk_size=chunk_size))
    return torch.cat(outs)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("op", list(SCANS))
def test_scan_split_on_the_chunk_grid_is_exact(op, chunk_size):
    """A prompt run whole, or in pieces that start on multiples of the chunk: the same output bits and the same
    final state (fresh slot memory NaN, never read)."""
    case, batch = SCANS[op], Batch([(0, 3 * chunk_size + 9)], [3])
    tensors, params, state = case.make(batch, torch.float32)
    whole_state = torch.zeros_like(state)
    whole = run_pieces(case, tensors, params, whole_state, 0, [], chunk_size)
    for cuts in ([chunk_size], [chunk_size, 3 * chunk_size], [2 * chunk_size]):
        state = torch.full_like(whole_state, float("nan"))
        pieces = run_pieces(case, tensors, params, state, 0, cuts, chunk_size)
        assert torch.equal(pieces, whole), cuts
        assert torch.equal(state[3], whole_state[3]), cuts
    # a prefill continuing from the middle of a chunk agrees with the whole run to rounding
    state = torch.zeros_like(whole_state)
    pieces = run_pieces(case, tensors, params, state, 0, [chunk_size + 5], chunk_size)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[3], whole_state[3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", list(SCANS))
def test_scan_is_batch_invariant(op):
    """Each sequence of a mixed batch, alone on its slot: bit-identical rows and state."""
    case, batch = SCANS[op], MIXED
    tensors, params, state = case.make(batch, torch.float32)
    state_all = state.clone()
    out = case.run(tensors, params, state_all, *batch.args(), chunk_size=16)
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        r, alone, s = batch.rows(i), Batch([(start, batch.lengths[i])], [slot]), state.clone()
        o = case.run([t[r] for t in tensors], params, s, *alone.args(), chunk_size=16)
        assert torch.equal(o, out[r]) and torch.equal(s[slot], state_all[slot]), i


def test_conv_norms_and_gates_are_batch_invariant():
    """The conv, and the elementwise ops a layer applies around the scans: one row alone, or at any batch offset."""
    batch = MIXED
    x, weight, bias, conv_state = conv_inputs(batch, 40, 4, torch.float32)
    conv_all = conv_state.clone()
    conv_out = causal_conv(x, weight, conv_all, *batch.args(), bias=bias)
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        r, alone, c = batch.rows(i), Batch([(start, batch.lengths[i])], [slot]), conv_state.clone()
        o = causal_conv(x[r], weight, c, *alone.args(), bias=bias)
        assert torch.equal(o, conv_out[r]) and torch.equal(c[slot], conv_all[slot]), i
    ops = [
        lambda t: rms_norm_gated(t[:, :16], t[:, 16:32], torch.ones(16), 1e-6),
        lambda t: rms_norm_gated(t[:, :16], t[:, 16:32], torch.ones(16), 1e-6, norm_before_gate=False, group_size=8),
        lambda t: rms_norm_gated(t[:, :16], t[:, 16:32], torch.ones(16), 1e-6, activation="sigmoid",
                                 multiply_in_float32=True),
        lambda t: gated_delta_gates(t[:, :4] * 10, t[:, 4:8], torch.zeros(4), torch.ones(4)),
        lambda t: kimi_delta_gates(t[:, :16] * 10, t[:, 16:20], torch.zeros(4), torch.ones(16)),
        lambda t: kimi_delta_gates(t[:, :16] * 10, t[:, 16:20], torch.zeros(4), torch.ones(16), lower_bound=-5.0),
    ]
    for op in ops:
        whole = op(conv_out)
        for t in range(batch.num_tokens):
            one = op(conv_out[t : t + 1])
            assert all(torch.equal(a, b[t : t + 1]) for a, b in zip(one, whole)) if isinstance(one, tuple) \
                else torch.equal(one, whole[t : t + 1]), t


def test_ops_give_the_same_bits_at_one_and_two_threads():
    """At real head sizes, where the products are large enough for torch to thread them, and with odd widths, so
    that the threads' shares of an elementwise op end mid-row."""
    batch = Batch([(0, 70), (5, 1), (9, 1), (64, 41)], [1, 0, 2, 4])
    cases = [(SCANS["gated_delta"], dict(heads=(4, 8), dims=(128, 128))),
             (SCANS["kimi_delta"], dict(heads=8, dims=(128, 128))),
             (SCANS["mamba2"], dict(heads=(32, 4), dims=(64, 128)))]
    inputs = [case.make(batch, torch.float32, **make) for case, make in cases]
    x, weight, bias, conv_state = conv_inputs(batch, 1001, 4, torch.float32)
    z = torch.randn(batch.num_tokens * 8, 128)
    results = []
    for n in (1, 2):
        got = []
        with num_threads(n):
            for (case, _), (tensors, params, state) in zip(cases, inputs):
                s = state.clone()
                got += [case.run(tensors, params, s, *batch.args()), s[batch.slots]]
            c = conv_state.clone()
            got += [causal_conv(x, weight, c, *batch.args(), bias=bias), c[batch.slots]]
            got.append(rms_norm_gated(got[0].reshape(-1, 128), z, torch.ones(128), 1e-6))
            got.append(rms_norm_gated(got[0].reshape(-1, 128), z, torch.ones(128), 1e-6, norm_before_gate=False,
                                      group_size=64))
            got += gated_delta_gates(x[:, :999], x[:, 1:1000], torch.zeros(999), torch.zeros(999))
            got += kimi_delta_gates(x[:, :992], x[:, 1:32], torch.zeros(31), torch.zeros(992))
        results.append(got)
    for i, (one, two) in enumerate(zip(*results)):
        assert torch.equal(one, two), i


# ---- norms and gates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "kimi_linear"])
def test_rms_norm_gated_matches_hf(family, dtype):
    """Each family's gated norm, to an ulp of float32 before the final cast (our silu and sigmoid are torch's
    formulas without its SIMD exp)."""
    g = torch.Generator().manual_seed(1)
    x, z = torch.randn(100, 32, generator=g).to(dtype), torch.randn(100, 32, generator=g).to(dtype)
    if family == "qwen3_5":
        norm, kw = qwen3_5.Qwen3_5RMSNormGated(32, eps=1e-6), {}
    elif family == "nemotron_h":
        norm, kw = nemotron.NemotronHRMSNormGated(32, group_size=8, eps=1e-6), dict(norm_before_gate=False,
                                                                                      group_size=8)
    else:
        norm, kw = kimi.KimiLinearRMSNormGated(32, eps=1e-6), dict(activation="sigmoid", multiply_in_float32=True)
    norm = norm.to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=g))
        expected = norm(x, z)
    out = rms_norm_gated(x, z, norm.weight.detach(), 1e-6, **kw)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **({"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {}))


def test_gated_delta_gates_match_the_hf_layer():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(50, 4, generator=g) * 10, torch.randn(50, 4, generator=g).to(torch.bfloat16)
    a_log, dt_bias = torch.randn(4, generator=g), torch.randn(4, generator=g)
    decay, beta = gated_delta_gates(a, b, a_log, dt_bias)
    assert decay.dtype == torch.float32 and beta.dtype == torch.bfloat16
    torch.testing.assert_close(decay, -a_log.exp() * F.softplus(a + dt_bias), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(beta, b.sigmoid())


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kimi_delta_gates_match_the_hf_forget_gates(lower_bound):
    """KimiLinearForgetGate's formula; with a lower bound, glm5_next's safe gate (Glm5NextTextForgetGate)."""
    g = torch.Generator().manual_seed(1)
    f, b = torch.randn(50, 4 * 16, generator=g) * 10, torch.randn(50, 4, generator=g).to(torch.bfloat16)
    a_log, dt_bias = torch.randn(4, generator=g), torch.randn(4 * 16, generator=g)
    decay, beta = kimi_delta_gates(f, b, a_log, dt_bias, lower_bound=lower_bound)
    x = (f + dt_bias).view(50, 4, 16)
    if lower_bound is None:
        expected = -a_log.exp()[:, None] * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    else:
        expected = lower_bound * torch.sigmoid(a_log.exp()[:, None] * x)
    torch.testing.assert_close(decay, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(beta, b.sigmoid())
