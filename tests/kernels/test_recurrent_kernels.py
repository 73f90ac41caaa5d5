"""helios.kernels.kda (the KDA decode step: gated_delta's kernel with a decay per key channel) and helios.kernels.mamba
(the Mamba-2 scan) against their torch references and the layers' torch path, in Triton's CPU interpreter.

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_recurrent_kernels_cuda.py.
Every batch mixes fresh sequences (their slots hold NaN, which must never be read) with continuing ones, on
shuffled slots, beside spare slots that must stay untouched.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from helios.core.manifest import RecurrentConfig
from helios.layers.attention import AttentionMetadata
from tests.kernels.test_gated_delta import (
    _close,
    _garbage_fresh,
    _randn,
    _state_close,
    check_prefill_result,
    make_batch,
)


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


# --- KDA -------------------------------------------------------------------------------------------------------


def _kda_decode_inputs(device, dtype, num_heads, dk, dv, width, batch, seed=0):
    rows = batch.slots.shape[0]
    channels = num_heads * (2 * dk + dv)
    z = dict(device=device, dtype=dtype)
    return dict(
        mixed_qkv=_randn(rows, channels, seed=seed, scale=2.0, **z),
        conv_weight=_randn(channels, width, seed=seed + 1, scale=0.5, **z),
        conv_state=_garbage_fresh(_randn(batch.num_slots, width - 1, channels, seed=seed + 2, **z), batch),
        f=_randn(rows, num_heads * dk, seed=seed + 3, **z),
        b=_randn(rows, num_heads, seed=seed + 4, **z),
        A_log=_randn(num_heads, seed=seed + 5, device=device, scale=0.5),
        dt_bias=_randn(num_heads * dk, seed=seed + 6, device=device),
        state=_garbage_fresh(_randn(batch.num_slots, num_heads, dk, dv, seed=seed + 7, device=device), batch),
    )


def check_kda_decode(device, dtype, lower_bound=None, num_heads=2, dk=32, dv=64, width=4, num_splits=None,
                     starts=(0, 5, 1, 130), steps=2):
    """The fused KDA decode step against causal_conv_ref + kda_gates_ref + the per-channel rule, over `steps`."""
    from helios.kernels.kda import kda_decode, kda_decode_ref

    batch = make_batch([1] * len(starts), list(starts), device)
    inputs = _kda_decode_inputs(device, dtype, num_heads, dk, dv, width, batch)
    ours = {k: inputs[k].clone() for k in ("conv_state", "state")}
    ref = {k: inputs[k].clone() for k in ("conv_state", "state")}
    args = {k: v for k, v in inputs.items() if k not in ("conv_state", "state")}
    for step in range(steps):
        if step:  # continue every sequence from the state the previous step left
            batch.starts = batch.starts + 1
            args["mixed_qkv"] = _randn(*args["mixed_qkv"].shape, device=device, dtype=dtype, seed=20 + step, scale=2.0)
            args["f"] = _randn(*args["f"].shape, device=device, dtype=dtype, seed=30 + step)
        o = kda_decode(**args, **ours, slots=batch.slots, starts=batch.starts, lower_bound=lower_bound,
                       num_splits=num_splits)
        o_ref = kda_decode_ref(**args, **ref, slots=batch.slots, starts=batch.starts, lower_bound=lower_bound)
        _close(o.float(), o_ref.float(), dtype, device, f"step {step} output")
        _state_close(ours["state"], ref["state"], batch, torch.float32 if dtype == torch.float32 else dtype, device,
                     f"step {step} state")
        _state_close(ours["conv_state"], ref["conv_state"], batch, dtype, device, f"step {step} conv state")


def _kda_rule_inputs(device, dtype, num_tokens, num_heads, dk, dv, num_slots, batch, lower_bound=None):
    from helios.kernels.kda import kda_gates_ref

    q = _randn(num_tokens, num_heads, dk, device=device, dtype=dtype, seed=1)
    k = _randn(num_tokens, num_heads, dk, device=device, dtype=dtype, seed=2)
    v = _randn(num_tokens, num_heads, dv, device=device, dtype=dtype, seed=3)
    f = _randn(num_tokens, num_heads * dk, device=device, seed=4)
    b = _randn(num_tokens, num_heads, device=device, seed=5)
    g, beta = kda_gates_ref(f, b, _randn(num_heads, device=device, seed=6, scale=0.5),
                            _randn(num_heads * dk, device=device, seed=7), lower_bound)
    state = _garbage_fresh(_randn(num_slots, num_heads, dk, dv, device=device, seed=8, scale=0.1), batch)
    return q, k, v, g, beta.to(dtype), state


def check_kda_step(device, dtype, num_heads=3, dk=24, dv=40):
    """kda_rule with one token per sequence (the decode kernel without the conv, g given per key channel)."""
    from helios.kernels.gated_delta import gated_delta_rule_ref
    from helios.kernels.kda import kda_rule

    batch = make_batch([1, 1, 1], [4, 0, 1], device)
    q, k, v, g, beta, state = _kda_rule_inputs(device, dtype, 3, num_heads, dk, dv, batch.num_slots, batch)
    ours, ref = state.clone(), state.clone()
    o = kda_rule(q, k, v, g, beta, ours, batch.slots, batch.query_start_loc, batch.starts)
    o_ref = gated_delta_rule_ref(q, k, v, g, beta, ref, batch.slots, batch.query_start_loc, batch.starts)
    _close(o.float(), o_ref.float(), dtype, device, "output")
    _state_close(ours, ref, batch, dtype, device, "state")


def check_kda_prefill(device, dtype, query_lens=(70, 1, 130, 5), starts=(0, 9, 64, 0), num_heads=2, dk=64, dv=64,
                      lower_bound=None, safe_gate=False):
    """The chunked varlen path (fla's chunk_kda) against the token-by-token reference (CUDA only)."""
    from helios.kernels.gated_delta import gated_delta_rule_ref
    from helios.kernels.kda import kda_rule

    batch = make_batch(list(query_lens), list(starts), device)
    q, k, v, g, beta, state = _kda_rule_inputs(device, dtype, sum(query_lens), num_heads, dk, dv, batch.num_slots,
                                               batch, lower_bound)
    ours, ref = state.clone(), state.clone()
    o = kda_rule(q, k, v, g, beta, ours, batch.slots, batch.query_start_loc, batch.starts, safe_gate=safe_gate,
                 lower_bound=lower_bound)
    o_ref = gated_delta_rule_ref(q, k, v, g, beta, ref, batch.slots, batch.query_start_loc, batch.starts)
    check_prefill_result(o, o_ref, ours, ref, state, batch, dtype)


# --- Mamba-2 ---------------------------------------------------------------------------------------------------


def _mamba_inputs(device, dtype, num_tokens, num_heads, num_groups, head_dim, state_dim, batch, seed=0):
    """x, B, C as views of one conv-output-like row (as the layer splits them), dt a view of a wider row."""
    z = dict(device=device, dtype=dtype)
    inner, groups = num_heads * head_dim, num_groups * state_dim
    xbc = _randn(num_tokens, inner + 2 * groups, seed=seed, **z)
    x, B, C = xbc.split([inner, groups, groups], dim=-1)
    dt = _randn(num_tokens, num_heads + 3, seed=seed + 1, **z)[:, 2:2 + num_heads]
    state = _randn(batch.num_slots, num_heads, head_dim, state_dim, seed=seed + 2, device=device, scale=0.3)
    return dict(
        x=x.reshape(num_tokens, num_heads, head_dim), dt=dt,
        A_log=_randn(num_heads, seed=seed + 3, device=device, dtype=dtype, scale=0.5),
        B=B.reshape(num_tokens, num_groups, state_dim), C=C.reshape(num_tokens, num_groups, state_dim),
        D=_randn(num_heads, seed=seed + 4, device=device, dtype=dtype),
        dt_bias=_randn(num_heads, seed=seed + 5, device=device, dtype=dtype, scale=0.5),
        state=_garbage_fresh(state, batch),
    )


def check_mamba2_scan(device, dtype, query_lens=(1, 1, 1, 1), starts=(0, 5, 1, 130), num_heads=4, num_groups=2,
                      head_dim=24, state_dim=16, dt_limit=(0.0, float("inf")), steps=2, chunk_size=None):
    """mamba2_scan against the token-by-token reference and helios.layers.recurrent's torch path (the CPU path,
    chunked for longer sequences), then `steps - 1` decode steps continuing every sequence. chunk_size: the
    chunked kernel's grid for the first step (None: the sequential kernel)."""
    from helios.kernels.mamba import mamba2_scan, mamba2_scan_ref
    from helios.layers import recurrent

    lens = list(query_lens)
    batch = make_batch(lens, list(starts), device)
    for step in range(steps):
        inputs = _mamba_inputs(device, dtype, sum(lens), num_heads, num_groups, head_dim, state_dim, batch,
                               seed=10 * step)
        if step:
            inputs["state"] = ours
        state = inputs.pop("state")
        ours, ref, torch_path = state.clone(), state.clone(), state.clone()
        call = dict(slots=batch.slots, query_start_loc=batch.query_start_loc, starts=batch.starts, dt_limit=dt_limit)
        y = mamba2_scan(**inputs, state=ours, **call, chunk_size=chunk_size)
        y_ref = mamba2_scan_ref(**inputs, state=ref, **call)
        lists = [t.tolist() for t in (batch.slots, batch.query_start_loc, batch.starts)]
        y_torch = recurrent.mamba2_scan(**inputs, state=torch_path, slots=lists[0], query_start_loc=lists[1],
                                        starts=lists[2], chunk_size=chunk_size or 8, dt_limit=dt_limit)
        _close(y.float(), y_ref.float(), dtype, device, f"step {step} output vs the reference")
        _close(y.float(), y_torch.float(), dtype, device, f"step {step} output vs the torch path")
        _state_close(ours, ref, batch, dtype, device, f"step {step} state vs the reference")
        _state_close(ours, torch_path, batch, dtype, device, f"step {step} state vs the torch path")
        batch.starts = batch.starts + batch.query_start_loc.diff()
        lens = [1] * len(lens)
        batch.query_start_loc = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)


# --- the layers: fused (Triton) path = torch path ------------------------------------------------------------


def tie_weights(layers: dict, seed: int = 0, scale: dict | None = None) -> None:
    """Every layer of `layers` gets the same random parameters (1-d ones small)."""
    g = torch.Generator().manual_seed(seed)
    first = next(iter(layers.values()))
    weights = {name: torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * (0.5 if p.ndim == 1 else 1.0)
               for name, p in first.named_parameters()}
    for name, factor in (scale or {}).items():
        weights[name] = weights[name] * factor
    for layer in layers.values():
        for name, t in weights.items():
            owner, _, leaf = name.rpartition(".")
            (layer.get_submodule(owner) if owner else layer)._parameters[leaf] = torch.nn.Parameter(t, False)


def step_meta(query_lens, starts, slots, device="cpu") -> AttentionMetadata:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [s + n for s, n in zip(starts, query_lens)]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)]).to(device)
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(positions=positions, slot_mapping=positions, query_start_loc=torch.tensor(qsl, **i32),
                             seq_lens=torch.tensor(seq_lens, **i32), block_tables=torch.zeros(len(slots), 1, **i32),
                             query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, state_slots=torch.tensor(slots, **i32),
                             state_slots_cpu=slots)


KDA = RecurrentConfig(kind="kimi_delta", num_heads=2, num_key_heads=2, key_head_dim=16, value_head_dim=16,
                      conv_kernel=4)
KDA_SAFE = msgspec.structs.replace(KDA, gate_lower_bound=-5.0)  # glm5_next's gate
# chunk 16: the fused layer's prefill takes the chunked scan kernel
MAMBA = RecurrentConfig(kind="mamba2", num_heads=4, num_key_heads=2, key_head_dim=16, value_head_dim=8,
                        conv_kernel=4, chunk_size=16, conv_bias=True, norm_group_size=16)


def make_layers(config: RecurrentConfig, hidden: int, device="cpu", dtype=torch.float32) -> dict:
    """{False: the torch-path layer, True: the fused one}, same weights."""
    from helios.layers.kda import KimiDeltaAttention
    from helios.layers.mamba import Mamba2Mixer

    cls = KimiDeltaAttention if config.kind == "kimi_delta" else Mamba2Mixer
    layers = {fused: cls(hidden, config, 1e-6, fused=fused) for fused in (False, True)}
    tie_weights(layers)
    return {k: v.to(device, dtype) for k, v in layers.items()}


def layer_states(config: RecurrentConfig, num_slots: int, device="cpu", dtype=torch.float32):
    return (torch.zeros(num_slots, config.conv_kernel - 1, config.conv_dim, device=device, dtype=dtype),
            torch.zeros(num_slots, config.num_heads, config.key_head_dim, config.value_head_dim, device=device))


def check_layer(config, device="cpu", dtype=torch.float32, fused_prefill=False, tol=None):
    """A prefill of two prompts (the torch path, or both paths with fused_prefill), then a decode step of three
    sequences (one fresh, its slot NaN) and a mixed step: the fused layer = the torch one, outputs and slots."""
    hidden, num_slots = 32, 6
    layers = make_layers(config, hidden, device, dtype)
    g = torch.Generator().manual_seed(1)
    reference = layer_states(config, num_slots, device, dtype)
    ours = tuple(t.clone() for t in reference)
    tol = tol or dict(atol=2e-5, rtol=1e-5)

    def run(x, meta, both):
        with torch.inference_mode():
            want = layers[False](x, reference, meta)
            got = layers[True](x, ours, meta) if both else None
        return want, got

    prefill = torch.randn(9 + 5, hidden, generator=g).to(device, dtype)
    want, got = run(prefill, step_meta([9, 5], [0, 0], [3, 1], device), fused_prefill)
    if not fused_prefill:
        for t, r in zip(ours, reference):
            t.copy_(r)
    else:
        torch.testing.assert_close(got, want, **tol)
    for t in ours:
        t[4].fill_(float("nan"))  # slot 4: a fresh sequence's, never read
    steps = [([1, 1, 1], [9, 5, 0], [3, 1, 4])]
    if fused_prefill:  # a mixed step: a decode row beside a prefill chunk of a fresh sequence (slot 0 NaN)
        for t in ours:
            t[0].fill_(float("nan"))
        steps.append(([1, 6, 1], [10, 0, 6], [3, 0, 1]))
    for lens, starts, slots in steps:
        x = torch.randn(sum(lens), hidden, generator=g).to(device, dtype)
        want, got = run(x, step_meta(lens, starts, slots, device), True)
        torch.testing.assert_close(got, want, **tol)
        for t, r in zip(ours, reference):
            torch.testing.assert_close(t[slots], r[slots], **tol)


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound, num_splits", [(None, 1), (-5.0, 2)])
def test_kda_decode(interpreter, lower_bound, num_splits):
    check_kda_decode("cpu", torch.float32, lower_bound=lower_bound, num_splits=num_splits)


def test_kda_decode_bf16_one_row_and_odd_dims(interpreter):
    check_kda_decode("cpu", torch.bfloat16, starts=(3,), steps=1)
    check_kda_decode("cpu", torch.float32, num_heads=1, dk=24, dv=40, width=3, num_splits=2, starts=(0, 2, 7), steps=1)


def test_kda_step(interpreter):
    check_kda_step("cpu", torch.float32)


def test_kda_prefill_needs_cuda():
    from helios.kernels.kda import kda_rule

    batch = make_batch([2, 1], [0, 0], "cpu")
    q, g = torch.zeros(3, 1, 8), torch.zeros(3, 1, 8)
    with pytest.raises(AssertionError, match="CUDA only"):
        kda_rule(q, q, q, g, torch.zeros(3, 1), torch.zeros(5, 1, 8, 8), batch.slots, batch.query_start_loc,
                 batch.starts)


def test_mamba2_scan_decode_and_prefill(interpreter):
    check_mamba2_scan("cpu", torch.float32)  # decode: 4 rows, one fresh
    check_mamba2_scan("cpu", torch.float32, query_lens=(5, 1, 12), starts=(0, 3, 8), num_groups=1, head_dim=20,
                      dt_limit=(0.05, 0.8))  # prefill beside a decode row, head_dim over one tile, a dt clamp


def test_mamba2_chunked_prefill(interpreter):
    """The chunked kernel (16-row chunks on the absolute grid): a sequence over three chunks from a mid-chunk
    start, a fresh one ending mid-chunk, a decode row, then a decode step from the states it left."""
    from helios.kernels.mamba import kernel_chunk

    check_mamba2_scan("cpu", torch.float32, query_lens=(37, 20, 1), starts=(5, 0, 9), head_dim=8, chunk_size=16,
                      dt_limit=(0.0, 0.9))
    # the kernel's grid divides the layer's (the scheduler's split points); under 16 rows: the sequential kernel
    assert [kernel_chunk(c) for c in (None, 8, 16, 48, 128, 256)] == [None, None, 16, 16, 32, 32]


def test_mamba2_scan_bf16(interpreter):
    check_mamba2_scan("cpu", torch.bfloat16, query_lens=(1, 3), starts=(2, 0), steps=1)


def test_kda_layer_decode_matches_the_torch_path(interpreter):
    check_layer(KDA)
    check_layer(KDA_SAFE)


def test_mamba_layer_matches_the_torch_path(interpreter):
    check_layer(MAMBA, fused_prefill=True)  # the scan kernel runs prefill in the interpreter too

