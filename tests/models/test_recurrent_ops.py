"""The recurrent layers' torch ops (helios.layers.recurrent) against transformers' torch paths, run one sequence at
a time: mixed batches (fresh prefill, continued prefill, decode, one-token prompts) on scattered slots, float32 and
bf16; the chunk grid's exactness (a prompt split on multiples of the chunk, a sequence alone or in any batch, one
or two threads: the same bits); and whole layers composed from the ops against the HF layer's forward."""

from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from helios.layers.recurrent import causal_conv, gated_delta_gates, gated_delta_rule, rms_norm_gated

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla, when installed, warns that Triton has no CPU driver
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

# the torch functions themselves, under the hub-kernel / fla dispatch decorators
hf_conv_fn = inspect.unwrap(qwen3_5.causal_conv1d_fn)
hf_conv_update = inspect.unwrap(qwen3_5.causal_conv1d_update)
hf_chunk_gdr = inspect.unwrap(qwen3_5.torch_chunk_gated_delta_rule)
hf_recurrent_gdr = inspect.unwrap(qwen3_5.torch_recurrent_gated_delta_rule)

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


# ---- gated delta rule


def gdr_inputs(batch: Batch, num_k_heads: int, num_v_heads: int, dk: int, dv: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = batch.num_tokens
    q = torch.randn(t, num_k_heads, dk, generator=g).to(dtype)
    k = torch.randn(t, num_k_heads, dk, generator=g).to(dtype)
    v = torch.randn(t, num_v_heads, dv, generator=g).to(dtype)
    # as the layer makes them: g = -exp(A_log) * softplus(a + dt_bias) in float32, beta = sigmoid(b)
    a_log = torch.rand(num_v_heads, generator=g) * 2 - 1
    g_ = -a_log.exp() * F.softplus(torch.randn(t, num_v_heads, generator=g))
    beta = torch.sigmoid(torch.randn(t, num_v_heads, generator=g)).to(dtype)
    state = batch.states(num_v_heads, dk, dv, gen=g) * 0.5
    return q, k, v, g_, beta, state


def gdr_reference(q, k, v, g, beta, state, batch: Batch, chunk_size=64):
    """HF per sequence: the recurrent form for one token with a state (as the layer), else the chunked form."""
    outs, new_states = [], {}
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        r = batch.rows(i)
        initial = state[slot][None].clone() if start > 0 else None
        args = (q[r][None], k[r][None], v[r][None], g[r][None], beta[r][None])
        if batch.lengths[i] == 1:
            o, s = hf_recurrent_gdr(*args, initial_state=initial, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
        else:
            o, s = hf_chunk_gdr(*args, chunk_size=chunk_size, initial_state=initial, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        new_states[slot] = s[0]
    return torch.cat(outs), new_states


BATCHES = {
    "prefill_from_zero": Batch([(0, 150), (0, 64), (0, 2), (0, 65)], [2, 0, 8, 5]),
    "prefill_from_state": Batch([(64, 100), (37, 30), (130, 2), (63, 1 + 64)], [1, 4, 10, 6]),
    "decode": Batch([(7, 1), (200, 1), (1, 1), (64, 1), (0, 1)], [9, 2, 5, 11, 0]),
    "decode_on_consecutive_slots": Batch([(7, 1), (0, 1), (30, 1)], [5, 4, 6]),  # updated in place, not gathered
    "mixed": MIXED,
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])  # bf16: 2 ulps at 0.4
def test_gated_delta_rule_matches_hf(name, dtype, tol):
    batch = BATCHES[name]
    q, k, v, g, beta, state = gdr_inputs(batch, 2, 4, 16, 24, dtype)
    expected, expected_states = gdr_reference(q, k, v, g, beta, state, batch)
    out = gated_delta_rule(q, k, v, g, beta, state, *batch.args())
    assert out.dtype == dtype and state.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    for slot, s in expected_states.items():
        torch.testing.assert_close(state[slot], s, atol=1e-5 if dtype == torch.float32 else 1e-4, rtol=1e-5)


def test_gated_delta_rule_matches_hf_at_real_head_sizes():
    """128-wide heads, 16 q/k heads for 32 v heads (qwen3_5's shape), chunk 64: float32 within 1e-5."""
    batch = Batch([(0, 70), (3, 1), (64, 3)], [1, 0, 2])
    q, k, v, g, beta, state = gdr_inputs(batch, 16, 32, 128, 128, torch.float32)
    expected, expected_states = gdr_reference(q, k, v, g, beta, state, batch)
    out = gated_delta_rule(q, k, v, g, beta, state, *batch.args())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for slot, s in expected_states.items():
        torch.testing.assert_close(state[slot], s, atol=1e-5, rtol=1e-5)


def sequential_float64(q, k, v, g, beta, s0):
    """The delta rule token by token in float64: one sequence, q/k [L, Hk, dk], s0 [Hv, dk, dv]."""
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
    batch = Batch([(0, 64), (64, 64), (0, 40)], [0, 1, 2])
    q, k, v, g, beta, state = gdr_inputs(batch, 2, 4, 16, 16, torch.float32)
    k[:] = k[0]
    k[::3] = -k[0]
    g.zero_()
    beta.fill_(0.999)
    initial = state.clone()
    expected, expected_states = gdr_reference(q, k, v, g, beta, state, batch)
    out = gated_delta_rule(q, k, v, g, beta, state, *batch.args())
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        r = batch.rows(i)
        exact, exact_state = sequential_float64(q[r], k[r], v[r], g[r], beta[r],
                                                initial[slot] if start else torch.zeros(4, 16, 16))
        hf_error = (expected[r].double() - exact).abs().max()
        assert (out[r].double() - exact).abs().max() <= max(hf_error, 1e-6), i
        torch.testing.assert_close(out[r], expected[r], atol=1e-5, rtol=1e-5)
        assert (state[slot].double() - exact_state).abs().max() <= 1e-5, i
        torch.testing.assert_close(state[slot], expected_states[slot], atol=1e-5, rtol=1e-5)


def run_pieces(op, tensors, state, start: int, cuts: list[int], slot: int = 3, **kw):
    """One sequence from position `start`, run as the pieces between `cuts` (row offsets); outputs concatenated."""
    outs, bounds = [], [0, *cuts, tensors[0].shape[0]]
    for a, b in zip(bounds, bounds[1:]):
        outs.append(op(*(t[a:b] for t in tensors), state, [slot], [0, b - a], [start + a], **kw))
    return torch.cat(outs)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_gated_delta_rule_split_on_the_chunk_grid_is_exact(chunk_size):
    """A prompt run whole, or in pieces that start on multiples of the chunk: the same output bits and the same
    final state (fresh slot memory NaN, never read)."""
    batch = Batch([(0, 3 * chunk_size + 9)], [3])
    q, k, v, g, beta, _ = gdr_inputs(batch, 2, 4, 16, 16, torch.float32)
    tensors = (q, k, v, g, beta)
    whole_state = torch.zeros(NUM_SLOTS, 4, 16, 16)
    whole = run_pieces(gated_delta_rule, tensors, whole_state, 0, [], chunk_size=chunk_size)
    for cuts in ([chunk_size], [chunk_size, 3 * chunk_size], [2 * chunk_size]):
        state = torch.full((NUM_SLOTS, 4, 16, 16), float("nan"))
        pieces = run_pieces(gated_delta_rule, tensors, state, 0, cuts, chunk_size=chunk_size)
        assert torch.equal(pieces, whole), cuts
        assert torch.equal(state[3], whole_state[3]), cuts
    # a prefill continuing from the middle of a chunk agrees with the whole run to rounding
    state = torch.zeros(NUM_SLOTS, 4, 16, 16)
    pieces = run_pieces(gated_delta_rule, tensors, state, 0, [chunk_size + 5], chunk_size=chunk_size)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[3], whole_state[3], atol=1e-5, rtol=1e-5)


def test_ops_are_batch_invariant():
    """Each sequence of a mixed batch, alone on its slot: bit-identical rows and states for every op."""
    batch = MIXED
    q, k, v, g, beta, state = gdr_inputs(batch, 2, 4, 16, 16, torch.float32)
    x, weight, bias, conv_state = conv_inputs(batch, 24, 4, torch.float32)
    state_all, conv_all = state.clone(), conv_state.clone()
    out = gated_delta_rule(q, k, v, g, beta, state_all, *batch.args(), chunk_size=16)
    conv_out = causal_conv(x, weight, conv_all, *batch.args(), bias=bias)
    for i, (start, slot) in enumerate(zip(batch.starts, batch.slots)):
        r, alone = batch.rows(i), Batch([(start, batch.lengths[i])], [slot])
        s, c = state.clone(), conv_state.clone()
        o = gated_delta_rule(q[r], k[r], v[r], g[r], beta[r], s, *alone.args(), chunk_size=16)
        assert torch.equal(o, out[r]) and torch.equal(s[slot], state_all[slot]), i
        o = causal_conv(x[r], weight, c, *alone.args(), bias=bias)
        assert torch.equal(o, conv_out[r]) and torch.equal(c[slot], conv_all[slot]), i
    # the elementwise ops a layer applies around them: one row alone, or at any offset of a batch
    z = torch.randn(batch.num_tokens, 4, 16)
    norm = rms_norm_gated(out.reshape(-1, 16), z.reshape(-1, 16), torch.ones(16), 1e-6).view(out.shape)
    gates = gated_delta_gates(x[:, :4] * 10, x[:, 4:8], torch.zeros(4), torch.ones(4))
    for t in range(batch.num_tokens):
        assert torch.equal(rms_norm_gated(out[t], z[t], torch.ones(16), 1e-6), norm[t]), t
        assert all(torch.equal(a, b[t]) for a, b in zip(gated_delta_gates(x[t, :4] * 10, x[t, 4:8], torch.zeros(4),
                                                                          torch.ones(4)), gates)), t


def test_ops_give_the_same_bits_at_one_and_two_threads():
    """At qwen3_5's head sizes, where the products are large enough for torch to thread them, and with odd
    widths, so that the threads' shares of an elementwise op end mid-row."""
    batch = Batch([(0, 70), (5, 1), (9, 1), (64, 41)], [1, 0, 2, 4])
    q, k, v, g, beta, state = gdr_inputs(batch, 4, 8, 128, 128, torch.float32)
    x, weight, bias, conv_state = conv_inputs(batch, 1001, 4, torch.float32)
    z = torch.randn(batch.num_tokens * 8, 128)
    results = []
    for n in (1, 2):
        s, c = state.clone(), conv_state.clone()
        with num_threads(n):
            o = gated_delta_rule(q, k, v, g, beta, s, *batch.args())
            co = causal_conv(x, weight, c, *batch.args(), bias=bias)
            norm = rms_norm_gated(o.reshape(-1, 128), z, torch.ones(128), 1e-6)
            gates = gated_delta_gates(x[:, :999], x[:, 1:1000], torch.zeros(999), torch.zeros(999))
        results.append((o, s[batch.slots], co, c[batch.slots], norm, *gates))
    for one, two in zip(*results):
        assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_hf(dtype):
    """To an ulp of float32 before the final cast: our silu is F.silu's formula without its SIMD exp."""
    g = torch.Generator().manual_seed(1)
    x, z = torch.randn(100, 16, generator=g).to(dtype), torch.randn(100, 16, generator=g).to(dtype)
    norm = qwen3_5.Qwen3_5RMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
        expected = norm(x, z)
    out = rms_norm_gated(x, z, norm.weight.detach(), 1e-6)
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


# ---- the whole GDN layer


def tiny_gdn(dtype) -> qwen3_5.Qwen3_5GatedDeltaNet:
    config = Qwen3_5TextConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                               intermediate_size=128, num_hidden_layers=4)
    torch.manual_seed(0)
    layer = qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        layer.dt_bias.normal_(0, 1)
        layer.norm.weight.normal_(1, 0.2)
    return layer.to(dtype).eval()


def gdn_layer(layer, x, conv_state, state, slots, query_start_loc, starts):
    """The GDN layer from helios' ops and plain matmuls of its weights: x [T, hidden] -> [T, hidden]."""
    num_tokens = x.shape[0]
    key_dim, value_dim, dv = layer.key_dim, layer.value_dim, layer.head_v_dim
    batch = (slots, query_start_loc, starts)
    qkv = causal_conv(x @ layer.in_proj_qkv.weight.t(), layer.conv1d.weight.squeeze(1), conv_state, *batch,
                      bias=layer.conv1d.bias, activation=layer.activation)
    q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
    z = x @ layer.in_proj_z.weight.t()
    g, beta = gated_delta_gates(x @ layer.in_proj_a.weight.t(), x @ layer.in_proj_b.weight.t(), layer.A_log,
                                layer.dt_bias)
    o = gated_delta_rule(q.view(num_tokens, -1, layer.head_k_dim), k.view(num_tokens, -1, layer.head_k_dim),
                         v.view(num_tokens, -1, dv), g, beta, state, *batch)
    o = rms_norm_gated(o.reshape(-1, dv), z.reshape(-1, dv), layer.norm.weight, layer.norm.variance_epsilon)
    return o.reshape(num_tokens, value_dim) @ layer.out_proj.weight.t()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 8e-3)])  # bf16: 2 ulps at 0.8
@torch.no_grad()
def test_gdn_layer_from_the_ops_matches_hf(dtype, tol):
    """Two prompts (100 and 30 tokens) through HF's forward (no cache) against the composition: whole in one step,
    then in steps: A[0:64] + B[0:30], A[64:100] + B's decode, A's decode + B's decode, states in slots."""
    layer = tiny_gdn(dtype)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randn(101, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)]
    expected = [layer(p[None])[0] for p in prompts]
    conv_state = torch.full((NUM_SLOTS, 3, layer.conv_dim), float("nan"), dtype=dtype)
    state = torch.full((NUM_SLOTS, 4, 16, 16), float("nan"))
    slots = [7, 2]

    whole = gdn_layer(layer, torch.cat(prompts), conv_state, state, slots, [0, 101, 133], [0, 0])
    torch.testing.assert_close(whole, torch.cat(expected), atol=tol, rtol=tol)

    steps = [((0, 64), (0, 30)), ((64, 100), (30, 31)), ((100, 101), (31, 32))]
    got = [[], []]
    for step in steps:
        x = torch.cat([p[a:b] for p, (a, b) in zip(prompts, step)])
        n = [b - a for a, b in step]
        out = gdn_layer(layer, x, conv_state, state, slots, [0, n[0], n[0] + n[1]], [a for a, _ in step])
        got[0].append(out[: n[0]])
        got[1].append(out[n[0]:])
    for rows, exp in zip(got, expected):
        torch.testing.assert_close(torch.cat(rows), exp, atol=tol, rtol=tol)
