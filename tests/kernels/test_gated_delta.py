"""helios.kernels.gated_delta against its torch references (Triton's CPU interpreter here; tests/gpu runs the same
checks compiled, plus fla's chunked prefill), and the references against transformers' qwen3_5 torch functions.

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_gated_delta_cuda.py.
Every batch mixes fresh sequences (starts == 0: their slot holds NaN garbage, which must never be read) with
continuing ones, on shuffled slots, with spare slots that must stay untouched.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.kernels.cases import tolerance


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


@dataclass
class Batch:
    slots: torch.Tensor  # [B] int32
    starts: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_slots: int


def make_batch(query_lens, starts, device, num_slots=None, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    num_slots = num_slots or len(query_lens) + 3
    slots = torch.randperm(num_slots, generator=g)[: len(query_lens)]
    qsl = torch.tensor([0] + query_lens).cumsum(0)
    i32 = dict(dtype=torch.int32, device=device)
    return Batch(slots.to(**i32), torch.tensor(starts, **i32), qsl.to(**i32), num_slots)


def _randn(*shape, device, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def _garbage_fresh(t: torch.Tensor, batch: Batch) -> torch.Tensor:
    """NaN in the slots of fresh sequences: a kernel that reads them (instead of zeros) fails every comparison."""
    fresh = batch.slots[batch.starts == 0].long()
    t[fresh] = float("nan")
    return t


def _close(actual, expected, dtype, device, what):
    tol = dict(tolerance(dtype))
    if device != "cpu" or dtype != torch.float32:
        tol = dict(atol=max(tol["atol"], 1e-4), rtol=max(tol["rtol"], 1e-4))  # reduction orders, exp on the device
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def _state_close(actual, expected, batch, dtype, device, what):
    """Slots of the batch compared; every other slot must be bit-identical to before (NaN included)."""
    used = batch.slots.long()
    _close(actual[used], expected[used], dtype, device, what)
    keep = torch.ones(actual.shape[0], dtype=torch.bool, device=actual.device)
    keep[used] = False
    assert torch.equal(actual[keep].nan_to_num(7.0), expected[keep].nan_to_num(7.0)), f"{what}: other slots changed"


# --- checks ------------------------------------------------------------------------------------------------


def check_causal_conv(device, dtype, query_lens=(5, 1, 9, 2), starts=(0, 7, 3, 12), width=4, channels=96,
                      bias=False, activation="silu"):
    from helios.kernels.gated_delta import causal_conv, causal_conv_ref

    batch = make_batch(list(query_lens), list(starts), device)
    x = _randn(sum(query_lens), channels, device=device, dtype=dtype, scale=2.0)
    weight = _randn(channels, width, device=device, dtype=dtype, seed=1)
    b = _randn(channels, device=device, dtype=dtype, seed=2) if bias else None
    conv_state = _garbage_fresh(_randn(batch.num_slots, width - 1, channels, device=device, dtype=dtype, seed=3), batch)
    actual, expected = conv_state.clone(), conv_state.clone()
    y = causal_conv(x, weight, actual, batch.slots, batch.query_start_loc, batch.starts, b, activation)
    y_ref = causal_conv_ref(x, weight, expected, batch.slots, batch.query_start_loc, batch.starts, b, activation)
    _close(y, y_ref, dtype, device, "conv output")
    used = batch.slots.long()
    assert torch.equal(actual[used], expected[used]), "conv state: the last K-1 inputs, copied exactly"
    _state_close(actual, expected, batch, dtype, device, "conv state")
    # planar (q, k, v groups each contiguous, as fla takes them): the same values, column group by column group
    groups = (channels // 4 + 3, channels // 4 + 3, channels - 2 * (channels // 4 + 3))  # not tile-aligned
    parts = causal_conv(x, weight, conv_state.clone(), batch.slots, batch.query_start_loc, batch.starts, b, activation,
                        planar=groups)
    assert all(t.is_contiguous() for t in parts) and [t.shape[1] for t in parts] == list(groups)
    assert torch.equal(torch.cat(parts, dim=1), y)


def check_causal_conv_norm_heads(device, dtype, head=16, num_heads=3, dv=40, query_lens=(5, 1, 9, 2),
                                 starts=(0, 7, 3, 12)):
    """causal_conv's norm_head: the q and k heads l2-normalized (eps 1e-6) from the conv's float32 values (against
    the reference conv in float32, normalized after), v and the conv state as the plain planar conv leaves them."""
    from helios.kernels.gated_delta import _l2norm_ref, causal_conv, causal_conv_ref

    batch = make_batch(list(query_lens), list(starts), device)
    width = num_heads * head
    groups = (width, width, num_heads * dv)
    channels = sum(groups)
    x = _randn(sum(query_lens), channels, device=device, dtype=dtype, scale=2.0)
    weight = _randn(channels, 4, device=device, dtype=dtype, seed=1)
    conv_state = _garbage_fresh(_randn(batch.num_slots, 3, channels, device=device, dtype=dtype, seed=3), batch)
    plain_state = conv_state.clone()
    y_ref = causal_conv_ref(x.float(), weight.float(), conv_state.clone().float(), batch.slots, batch.query_start_loc,
                            batch.starts)  # on a float32 copy of the state
    q, k, v = causal_conv(x, weight, conv_state, batch.slots, batch.query_start_loc, batch.starts, planar=groups,
                          norm_head=head)
    plain = causal_conv(x, weight, plain_state, batch.slots, batch.query_start_loc, batch.starts, planar=groups)
    for got, lo in ((q, 0), (k, width)):
        want = _l2norm_ref(y_ref[:, lo : lo + width].reshape(-1, num_heads, head)).reshape(-1, width)
        _close(got.float(), want, dtype, device, "normalized heads")
        norms = got.float().reshape(-1, num_heads, head).norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms), atol=2e-2 if dtype != torch.float32 else 1e-5,
                                   rtol=0)
    assert torch.equal(v, plain[2]), "v: as the plain planar conv"
    used = batch.slots.long()
    assert torch.equal(conv_state[used], plain_state[used]), "the conv state: as the plain conv leaves it"


def _decode_inputs(device, dtype, num_k_heads, num_v_heads, dk, dv, width, batch, seed=0):
    channels = 2 * num_k_heads * dk + num_v_heads * dv
    rows = batch.slots.shape[0]
    z = dict(device=device, dtype=dtype)
    return dict(
        mixed_qkv=_randn(rows, channels, seed=seed, scale=2.0, **z),
        conv_weight=_randn(channels, width, seed=seed + 1, scale=0.5, **z),
        conv_state=_garbage_fresh(_randn(batch.num_slots, width - 1, channels, seed=seed + 2, **z), batch),
        a=_randn(rows, num_v_heads, seed=seed + 3, **z),
        b=_randn(rows, num_v_heads, seed=seed + 4, **z),
        A_log=_randn(num_v_heads, seed=seed + 5, device=device, scale=0.5),
        dt_bias=_randn(num_v_heads, seed=seed + 6, device=device),
        state=_garbage_fresh(_randn(batch.num_slots, num_v_heads, dk, dv, seed=seed + 7, device=device), batch),
    )


def check_decode(device, dtype, num_k_heads=2, num_v_heads=4, dk=32, dv=64, width=4, num_splits=None,
                 starts=(0, 5, 1, 130), conv_bias=False, steps=2):
    """The fused decode step against causal_conv_ref + gate + gated_delta_rule_ref, over `steps` steps."""
    from helios.kernels.gated_delta import gated_delta_decode, gated_delta_decode_ref

    batch = make_batch([1] * len(starts), list(starts), device)
    inputs = _decode_inputs(device, dtype, num_k_heads, num_v_heads, dk, dv, width, batch)
    bias = _randn(inputs["mixed_qkv"].shape[1], device=device, dtype=dtype, seed=9) if conv_bias else None
    ours = {k: inputs[k].clone() for k in ("conv_state", "state")}
    ref = {k: inputs[k].clone() for k in ("conv_state", "state")}
    args = {k: v for k, v in inputs.items() if k not in ("conv_state", "state")}
    for step in range(steps):
        if step:  # continue every sequence from the state the previous step left
            batch.starts = batch.starts + 1
            args["mixed_qkv"] = _randn(*args["mixed_qkv"].shape, device=device, dtype=dtype, seed=20 + step, scale=2.0)
        o = gated_delta_decode(**args, **ours, slots=batch.slots, starts=batch.starts, num_k_heads=num_k_heads,
                               conv_bias=bias, num_splits=num_splits)
        o_ref = gated_delta_decode_ref(**args, **ref, slots=batch.slots, starts=batch.starts,
                                       num_k_heads=num_k_heads, conv_bias=bias)
        _close(o.float(), o_ref.float(), dtype, device, f"step {step} output")
        _state_close(ours["state"], ref["state"], batch, torch.float32 if dtype == torch.float32 else dtype, device,
                     f"step {step} state")
        _state_close(ours["conv_state"], ref["conv_state"], batch, dtype, device, f"step {step} conv state")


def check_decode_padded_rows(device, num_splits=None):
    """Padded rows of a graph bucket share the scratch slot S-1: real rows' outputs and slots are unaffected."""
    from helios.kernels.gated_delta import gated_delta_decode, gated_delta_decode_ref

    real = make_batch([1, 1], [3, 0], device, num_slots=5)  # real slots among 0..4; 5 is the scratch slot
    padded = Batch(torch.cat([real.slots, torch.full((3,), 5, dtype=torch.int32, device=device)]),
                   torch.cat([real.starts, torch.tensor([1, 0, 9], dtype=torch.int32, device=device)]),
                   torch.arange(6, dtype=torch.int32, device=device), 6)
    inputs = _decode_inputs(device, torch.float32, 2, 4, 32, 64, 4, padded)
    args = {k: v for k, v in inputs.items() if k not in ("conv_state", "state")}
    conv_state, state = inputs["conv_state"].clone(), inputs["state"].clone()
    o = gated_delta_decode(**args, conv_state=conv_state, state=state, slots=padded.slots, starts=padded.starts,
                           num_k_heads=2, num_splits=num_splits)
    ref_conv, ref_state = inputs["conv_state"].clone(), inputs["state"].clone()
    rows = {k: v[:2] if k in ("mixed_qkv", "a", "b") else v for k, v in args.items()}
    o_ref = gated_delta_decode_ref(**rows, conv_state=ref_conv,
                                   state=ref_state, slots=real.slots, starts=real.starts, num_k_heads=2)
    _close(o[:2], o_ref, torch.float32, device, "real rows")
    keep = torch.arange(5, device=device)  # every slot but the scratch one
    _close(state[keep], ref_state[keep], torch.float32, device, "real slots")
    _close(conv_state[keep], ref_conv[keep], torch.float32, device, "real conv slots")


def check_recurrent_step(device, dtype, num_k_heads=2, num_v_heads=6, dk=24, dv=40, strided=True):
    """gated_delta_rule with one token per sequence (the decode kernel without the conv): q/k/v as strided views."""
    from helios.kernels.gated_delta import gated_delta_rule, gated_delta_rule_ref

    batch = make_batch([1, 1, 1], [4, 0, 1], device)
    rows = 3
    qkv = _randn(rows, 2 * num_k_heads * dk + num_v_heads * dv, device=device, dtype=dtype, seed=1)
    q, k, v = qkv.split([num_k_heads * dk, num_k_heads * dk, num_v_heads * dv], dim=-1)
    q, k, v = q.view(rows, num_k_heads, dk), k.view(rows, num_k_heads, dk), v.view(rows, num_v_heads, dv)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = -torch.rand(rows, num_v_heads, generator=torch.Generator().manual_seed(2)).to(device) * 2
    beta = torch.rand(rows, num_v_heads, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    state = _garbage_fresh(_randn(batch.num_slots, num_v_heads, dk, dv, device=device, seed=4), batch)
    ours, ref = state.clone(), state.clone()
    o = gated_delta_rule(q, k, v, g, beta, ours, batch.slots, batch.query_start_loc, batch.starts)
    o_ref = gated_delta_rule_ref(q, k, v, g, beta, ref, batch.slots, batch.query_start_loc, batch.starts)
    _close(o.float(), o_ref.float(), dtype, device, "output")
    _state_close(ours, ref, batch, dtype, device, "state")


def check_prefill(device, dtype, query_lens=(70, 1, 130, 5), starts=(0, 9, 64, 0), num_k_heads=2, num_v_heads=6,
                  dk=64, dv=64):
    """The chunked varlen path (fla) against the token-by-token reference, then a decode step continuing it."""
    from helios.kernels.gated_delta import gated_delta_rule, gated_delta_rule_ref

    batch = make_batch(list(query_lens), list(starts), device)
    T = sum(query_lens)
    q = _randn(T, num_k_heads, dk, device=device, dtype=dtype, seed=1)
    k = _randn(T, num_k_heads, dk, device=device, dtype=dtype, seed=2)
    v = _randn(T, num_v_heads, dv, device=device, dtype=dtype, seed=3)
    g = -torch.rand(T, num_v_heads, generator=torch.Generator().manual_seed(4)).to(device) * 0.5
    beta = torch.rand(T, num_v_heads, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    state = _garbage_fresh(_randn(batch.num_slots, num_v_heads, dk, dv, device=device, seed=6, scale=0.1), batch)
    ours, ref = state.clone(), state.clone()
    o = gated_delta_rule(q, k, v, g, beta, ours, batch.slots, batch.query_start_loc, batch.starts)
    o_ref = gated_delta_rule_ref(q, k, v, g, beta, ref, batch.slots, batch.query_start_loc, batch.starts)
    check_prefill_result(o, o_ref, ours, ref, state, batch, dtype)


def check_prefill_result(o, o_ref, ours, ref, state_before, batch, dtype):
    """fla's chunked outputs and final states against the token-by-token reference (loose: fla's tf32 / bf16
    dots); every slot outside the batch unchanged, NaN included."""
    loose = dict(atol=2e-2, rtol=2e-2) if dtype == torch.float32 else dict(atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(o.float(), o_ref.float(), **loose)
    used = batch.slots.long()
    torch.testing.assert_close(ours[used], ref[used], **loose)
    others = torch.ones(batch.num_slots, dtype=torch.bool, device=ours.device)
    others[used] = False
    assert torch.equal(ours[others].nan_to_num(7.0), state_before[others].nan_to_num(7.0))


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


@pytest.mark.parametrize("bias, activation", [(False, "silu"), (True, None)])
def test_causal_conv(interpreter, bias, activation):
    check_causal_conv("cpu", torch.float32, bias=bias, activation=activation)


@pytest.mark.parametrize("dtype, head", [(torch.float32, 16), (torch.bfloat16, 32), (torch.float32, 128)],
                         ids=["fp32-16", "bf16-32", "fp32-128"])
def test_causal_conv_normalizes_q_and_k_heads(interpreter, dtype, head):
    check_causal_conv_norm_heads("cpu", dtype, head=head, num_heads=3 if head < 128 else 1)


def test_causal_conv_bf16_decode_rows_and_width_3(interpreter):
    check_causal_conv("cpu", torch.bfloat16)
    check_causal_conv("cpu", torch.float32, query_lens=(1, 1, 1), starts=(0, 4, 1), width=3)  # T == B: decode rows
    check_causal_conv("cpu", torch.float32, query_lens=(2, 40), starts=(5, 1), channels=130)  # short, multi-tile


@pytest.mark.parametrize("num_splits, num_v_heads", [(1, 4), (2, 4), (4, 8)])
def test_decode(interpreter, num_splits, num_v_heads):  # a key head's tiles: its value heads x dv / 64 columns
    check_decode("cpu", torch.float32, num_v_heads=num_v_heads, num_splits=num_splits)


def test_decode_bf16_bias_and_odd_dims(interpreter):
    check_decode("cpu", torch.bfloat16, conv_bias=True, num_splits=2)
    check_decode("cpu", torch.float32, num_k_heads=1, num_v_heads=3, dk=24, dv=40, width=3, num_splits=3)


def test_decode_padded_rows_share_the_scratch_slot(interpreter):
    check_decode_padded_rows("cpu", num_splits=2)
    check_decode_padded_rows("cpu", num_splits=1)


@pytest.mark.parametrize("strided", [True, False])
def test_recurrent_step(interpreter, strided):
    check_recurrent_step("cpu", torch.float32, strided=strided)


def test_prefill_needs_cuda():
    from helios.kernels.gated_delta import gated_delta_rule

    batch = make_batch([2, 1], [0, 0], "cpu")
    q = torch.zeros(3, 1, 8)
    v = torch.zeros(3, 1, 8)
    g = torch.zeros(3, 1)
    with pytest.raises(AssertionError, match="CUDA only"):
        gated_delta_rule(q, q, v, g, g, torch.zeros(5, 1, 8, 8), batch.slots, batch.query_start_loc, batch.starts)


def test_decode_splits_fill_the_chip():
    from helios.kernels.gated_delta import decode_splits

    assert decode_splits(1, 16, 12, 132) == 12  # 16 key heads: every tile its own program
    assert decode_splits(8, 16, 12, 132) == 3  # 384 programs
    assert decode_splits(64, 16, 12, 132) == 1  # one program per key head


# --- CPU: the references against transformers' qwen3_5 torch functions ----------------------------------------


def _hf():
    return pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def test_conv_ref_matches_transformers():
    from helios.kernels.gated_delta import causal_conv_ref

    hf = _hf()
    width, channels = 4, 24
    batch = make_batch([6, 1, 3], [0, 2, 9], "cpu")
    x = _randn(10, channels, device="cpu", scale=2.0)
    weight = _randn(channels, width, device="cpu", seed=1)
    conv_state = _garbage_fresh(_randn(batch.num_slots, width - 1, channels, device="cpu", seed=3), batch)
    before = conv_state.clone()
    y = causal_conv_ref(x, weight, conv_state, batch.slots, batch.query_start_loc, batch.starts)
    qsl = batch.query_start_loc.tolist()
    for i, slot in enumerate(batch.slots.tolist()):
        seq = x[qsl[i]:qsl[i + 1]].T[None]  # [1, C, L]
        old = before[slot].T if batch.starts[i] > 0 else torch.zeros(channels, width - 1)
        if seq.shape[-1] == 1 and batch.starts[i] > 0:  # decode: transformers keeps K columns (the first unused)
            hf_state = torch.cat([torch.full((channels, 1), 5.0), old], dim=1)[None]
            out = hf.causal_conv1d_update(seq, hf_state, weight, None, activation="silu")
            torch.testing.assert_close(hf_state[0, :, 1:].T, conv_state[slot])
        else:  # prefill: the state's columns prepended, as causal_conv1d_forward does
            out = hf.causal_conv1d_fn(torch.cat([old[None], seq], -1), weight, None, activation="silu")
            out = out[..., width - 1:]
        torch.testing.assert_close(y[qsl[i]:qsl[i + 1]], out[0].T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunked", [False, True])
def test_rule_ref_matches_transformers(chunked):
    from helios.kernels.gated_delta import gated_delta_rule_ref

    hf = _hf()
    fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    hk, hv, dk, dv = 2, 4, 16, 8
    batch = make_batch([70, 1, 5], [0, 3, 64], "cpu")
    T = 76
    q, k = _randn(T, hk, dk, device="cpu", seed=1), _randn(T, hk, dk, device="cpu", seed=2)
    v = _randn(T, hv, dv, device="cpu", seed=3)
    g = -torch.rand(T, hv, generator=torch.Generator().manual_seed(4))
    beta = torch.rand(T, hv, generator=torch.Generator().manual_seed(5))
    state = _garbage_fresh(_randn(batch.num_slots, hv, dk, dv, device="cpu", seed=6), batch)
    before = state.clone()
    o = gated_delta_rule_ref(q, k, v, g, beta, state, batch.slots, batch.query_start_loc, batch.starts)
    qsl = batch.query_start_loc.tolist()
    for i, slot in enumerate(batch.slots.tolist()):
        r = slice(qsl[i], qsl[i + 1])
        init = before[slot][None] if batch.starts[i] > 0 else None
        o_hf, s_hf = fn(q[r][None], k[r][None], v[r][None], g[r][None], beta[r][None], initial_state=init,
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[r], o_hf[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state[slot], s_hf[0], atol=2e-5, rtol=2e-5)


def test_decode_ref_matches_transformers_gate():
    """The fused decode's gate, split and head mapping against transformers' layer arithmetic (float32)."""
    from helios.kernels.gated_delta import gated_delta_decode_ref

    hf = _hf()
    hk, hv, dk, dv, width = 2, 4, 16, 8, 4
    batch = make_batch([1, 1], [7, 2], "cpu")
    inputs = _decode_inputs("cpu", torch.float32, hk, hv, dk, dv, width, batch)
    hf_conv = inputs["conv_state"][batch.slots.long()].transpose(1, 2)  # [B, C, K-1]
    hf_conv = torch.cat([torch.zeros(2, hf_conv.shape[1], 1), hf_conv], -1)
    hf_state = inputs["state"][batch.slots.long()].clone()
    o = gated_delta_decode_ref(**inputs, slots=batch.slots, starts=batch.starts, num_k_heads=hk)
    y = hf.causal_conv1d_update(inputs["mixed_qkv"][:, :, None], hf_conv, inputs["conv_weight"], None, "silu")
    q, k, v = y[..., 0].split([hk * dk, hk * dk, hv * dv], -1)
    g = -inputs["A_log"].exp() * torch.nn.functional.softplus(inputs["a"] + inputs["dt_bias"])
    o_hf, _ = hf.torch_recurrent_gated_delta_rule(
        q.reshape(2, 1, hk, dk), k.reshape(2, 1, hk, dk), v.reshape(2, 1, hv, dv), g[:, None],
        inputs["b"].sigmoid()[:, None], initial_state=hf_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf[:, 0], atol=2e-5, rtol=2e-5)


def test_chunked_prefill_glue_gathers_and_scatters_by_slot():
    """The fla call's glue (gather by slot, zeros for fresh sequences, cu_seqlens, scatter back) on the CPU, with
    transformers' torch chunked rule standing in for fla's chunk_gated_delta_rule (same varlen interface)."""
    from helios.kernels.gated_delta import chunked_by_slot, gated_delta_rule_ref

    hf = _hf()

    def fake_fla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                 cu_seqlens_cpu, chunk_size):
        assert scale == q.shape[-1] ** -0.5 and output_final_state and use_qk_l2norm_in_kernel
        assert cu_seqlens.dtype == torch.int64
        assert initial_state is None if fresh_only else initial_state.shape[0] == len(cu_seqlens) - 1
        assert cu_seqlens_cpu is None or (cu_seqlens_cpu.device.type == "cpu" and torch.equal(cu_seqlens_cpu,
                                                                                              cu_seqlens.cpu()))
        calls.append((cu_seqlens, cu_seqlens_cpu))
        outs, finals = [], []
        bounds = cu_seqlens.tolist()
        for i in range(len(bounds) - 1):
            r = slice(bounds[i], bounds[i + 1])
            o, final = hf.torch_chunk_gated_delta_rule(q[:, r], k[:, r], v[:, r], g[:, r], beta[:, r], chunk_size,
                                                       None if fresh_only else initial_state[i:i + 1], True, True)
            outs.append(o)
            finals.append(final)
        return torch.cat(outs, 1), torch.cat(finals)

    fresh_only = False
    batch = make_batch([70, 2, 5], [0, 3, 64], "cpu")
    hk, hv, dk, dv, T = 2, 4, 16, 8, 77
    q, k = _randn(T, hk, dk, device="cpu", seed=1), _randn(T, hk, dk, device="cpu", seed=2)
    v = _randn(T, hv, dv, device="cpu", seed=3)
    g = -torch.rand(T, hv, generator=torch.Generator().manual_seed(4))
    beta = torch.rand(T, hv, generator=torch.Generator().manual_seed(5))
    state = _garbage_fresh(_randn(batch.num_slots, hv, dk, dv, device="cpu", seed=6), batch)
    ref = state.clone()
    o_ref = gated_delta_rule_ref(q, k, v, g, beta, ref, batch.slots, batch.query_start_loc, batch.starts)
    # the step's (device, host) pair, as fla_cu_seqlens derives it once for every layer of a step, or none
    qsl = batch.query_start_loc
    calls = []
    for pair in (None, (qsl.to(torch.int64, copy=True), torch.tensor(qsl.tolist(), dtype=torch.int64))):
        ours = state.clone()
        o = chunked_by_slot(fake_fla, q, k, v, g, beta, ours, batch.slots, qsl, batch.starts, 64, pair)
        torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
        _state_close(ours, ref, batch, torch.float32, "cpu", "state")
    assert calls[1][0] is pair[0] and calls[1][1] is pair[1]  # the same tensors: fla's layout cache hits
    # a step of new prompts only (all_fresh, a host fact): fla gets no initial state, the results are the same
    fresh_only, batch = True, make_batch([70, 2, 5], [0, 0, 0], "cpu")
    for all_fresh in (False, True):
        fresh_only = all_fresh
        state = _garbage_fresh(_randn(batch.num_slots, hv, dk, dv, device="cpu", seed=6), batch)
        ref, ours = state.clone(), state.clone()
        o_ref = gated_delta_rule_ref(q, k, v, g, beta, ref, batch.slots, batch.query_start_loc, batch.starts)
        o = chunked_by_slot(fake_fla, q, k, v, g, beta, ours, batch.slots, batch.query_start_loc, batch.starts, 64,
                            None, all_fresh)
        torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
        _state_close(ours, ref, batch, torch.float32, "cpu", "state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_step_gates_in_one_launch_match_the_torch_gates(interpreter, dtype):
    """delta_gates (a prompt step's gates, one launch) against helios.layers.recurrent's: GDN's per-head decay from
    strided views of the projection, KDA's per-channel decay with kimi's softplus and with the safe gate; beta the
    same sigmoid. To rounding (Triton's exp and log), and a row's values the same alone as in its batch."""
    from helios.kernels.gated_delta import GATE_SAFE, GATE_SOFTPLUS_KIMI, delta_gates
    from helios.layers import recurrent

    num_rows, heads, dk = 37, 16, 8
    projected = _randn(num_rows, 3 * heads + 5, device="cpu", dtype=dtype, seed=1, scale=4.0)  # a, b as split views
    a, b = projected[:, 5:5 + heads], projected[:, 5 + heads:5 + 2 * heads]
    A_log, dt_bias = _randn(heads, device="cpu", dtype=dtype, seed=2), _randn(heads, device="cpu", dtype=dtype, seed=3)
    g, beta = delta_gates(a, b, A_log, dt_bias)
    g_ref, beta_ref = recurrent.gated_delta_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and g.is_contiguous() and beta.dtype == dtype
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, beta_ref, **tolerance(dtype))
    alone = delta_gates(a[7:8], b[7:8], A_log, dt_bias)
    assert torch.equal(alone[0], g[7:8]) and torch.equal(alone[1], beta[7:8])
    f = _randn(num_rows, heads * dk, device="cpu", dtype=dtype, seed=4, scale=3.0)
    dt_channels = _randn(heads * dk, device="cpu", dtype=dtype, seed=5)
    for form, bound in ((GATE_SOFTPLUS_KIMI, None), (GATE_SAFE, -5.0)):
        g, beta = delta_gates(f, b, A_log, dt_channels, form, bound)
        g_ref, beta_ref = recurrent.kimi_delta_gates(f, b, A_log, dt_channels, bound)
        torch.testing.assert_close(g.view(num_rows, heads, dk), g_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(beta, beta_ref, **tolerance(dtype))


# --- packaging: fla stays optional at import time ---------------------------------------------------------------


def test_module_imports_without_fla():
    code = "import sys, helios.kernels.gated_delta; assert 'fla' not in sys.modules, 'fla imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fla_signature_has_what_the_prefill_passes():
    import inspect
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Triton is not supported on current platform" on a CPU-only machine
        chunk = pytest.importorskip("fla.ops.gated_delta_rule").chunk_gated_delta_rule
        chunk_kda = pytest.importorskip("fla.ops.kda").chunk_kda  # helios.kernels.kda's prefill
    params = inspect.signature(chunk).parameters
    for name in ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens"):
        assert name in params, name
    params = inspect.signature(chunk_kda).parameters
    for name in ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
                 "safe_gate", "lower_bound"):
        assert name in params, name
