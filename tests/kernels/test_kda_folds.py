"""KDA's decode launch with its small per-head projections and its output norm folded in (Triton interpreter):
kda_decode with f_b's weight = kda_decode of f_b's product, kda_decode with the gated output norm (g_b's product
inside) = the gated norm's own launch after it on g_b's product, and each row's result independent of the rows beside
it (bit for bit).

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_kimi_folds_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_gated_delta import _randn, make_batch
from tests.kernels.test_recurrent_kernels import _kda_decode_inputs

STARTS = (0, 5, 1, 130)  # a fresh sequence (its slots NaN) beside continuing ones


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _inputs(device, dtype, starts, num_heads=2, dk=32, dv=64, df=32):
    """A decode batch, kda_decode's inputs but f, and f_a [B, df], f_b's weight [H*dk, df]."""
    batch = make_batch([1] * len(starts), list(starts), device)
    inputs = _kda_decode_inputs(device, dtype, num_heads, dk, dv, 4, batch)
    inputs.pop("f")
    f_a = _randn(len(starts), df, device=device, seed=40, dtype=dtype)
    f_b = _randn(num_heads * dk, df, device=device, seed=41, dtype=dtype, scale=df**-0.5)
    return batch, inputs, f_a, f_b


def _decode(inputs, rows, slots, starts, f, **kwargs):
    """kda_decode of `rows` of the batch on copies of its states: (output, conv state, state)."""
    from helios.kernels.kda import kda_decode

    args = {k: v.clone() if k in ("conv_state", "state") else v[rows] if k in ("mixed_qkv", "b") else v
            for k, v in inputs.items()}
    o = kda_decode(**args, f=f[rows], slots=slots[rows], starts=starts[rows], **kwargs)
    return o, args["conv_state"], args["state"]


def check_f_b_fold(device, dtype, lower_bound=None, num_splits=None, tol=None, **shape):
    """The folded f (its own float32 sums, rounded to f_a's dtype) = F.linear's, so every output and state too."""
    batch, inputs, f_a, f_b = _inputs(device, dtype, STARTS, **shape)
    rows, kw = slice(None), dict(lower_bound=lower_bound, num_splits=num_splits)
    folded = _decode(inputs, rows, batch.slots, batch.starts, f_a, f_b_weight=f_b, **kw)
    unfolded = _decode(inputs, rows, batch.slots, batch.starts, F.linear(f_a, f_b), **kw)
    live = batch.slots.long()
    for name, a, b in zip(("output", "conv state", "state"), folded, unfolded):
        if name != "output":
            a, b = a[live], b[live]
        torch.testing.assert_close(a.float(), b.float(), **(tol or dict(atol=2e-6, rtol=2e-6)), msg=name)


def check_rows_alone(device, dtype, num_splits=None, **shape):
    """Each row of a folded decode alone = the row in the batch, bit for bit."""
    batch, inputs, f_a, f_b = _inputs(device, dtype, STARTS, **shape)
    together = _decode(inputs, slice(None), batch.slots, batch.starts, f_a, f_b_weight=f_b, num_splits=num_splits)[0]
    for i in range(len(STARTS)):
        alone = _decode(inputs, slice(i, i + 1), batch.slots, batch.starts, f_a, f_b_weight=f_b,
                        num_splits=num_splits)[0]
        assert torch.equal(alone, together[i : i + 1]), f"row {i}"


def check_output_norm_fold(device, dtype, num_splits=None, tol=None, num_heads=2, dv=128, dz=48, **shape):
    """The output norm in the decode launch (the last split program reads the stored output and gates back) =
    kda_decode then gated_rms_norm of g_b's product (float32: within its rounding; bf16: a rounded gate may differ by
    an ulp), twice (the second launch checks the arrival counters were zeroed), and = the torch reference."""
    from helios.kernels.gated_norm import gated_rms_norm
    from helios.kernels.kda import GatedOutputNorm, kda_decode_ref

    batch, inputs, f_a, f_b = _inputs(device, dtype, STARTS, num_heads=num_heads, dv=dv, **shape)
    g_a = _randn(len(STARTS), dz, device=device, seed=42, dtype=dtype)
    g_b = _randn(num_heads * dv, dz, device=device, seed=43, dtype=dtype, scale=dz**-0.5)
    weight = 1 + _randn(dv, device=device, seed=44, dtype=dtype, scale=0.1)
    norm = GatedOutputNorm(g_a, g_b, weight, 1e-6)
    rows, kw = slice(None), dict(f_b_weight=f_b, num_splits=num_splits)
    close = tol or (dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2))
    for _ in range(2):
        got = _decode(inputs, rows, batch.slots, batch.starts, f_a, output_norm=norm, **kw)[0]
        o = _decode(inputs, rows, batch.slots, batch.starts, f_a, **kw)[0]
        want = gated_rms_norm(o.reshape(-1, dv), F.linear(g_a, g_b).reshape(-1, dv), weight, 1e-6,
                              activation="sigmoid", multiply_in_float32=True)
        torch.testing.assert_close(got.reshape(-1, dv).float(), want.float(), **close)
    args = {k: v.clone() for k, v in inputs.items()}
    ref = kda_decode_ref(**args, f=f_a, slots=batch.slots, starts=batch.starts, f_b_weight=f_b, output_norm=norm)
    torch.testing.assert_close(got.float(), ref.float(), **close)


@pytest.mark.parametrize("lower_bound, num_splits", [(None, 1), (-5.0, 2)])
def test_kda_decode_folds_f_b(interpreter, lower_bound, num_splits):
    check_f_b_fold("cpu", torch.float32, lower_bound, num_splits)


def test_kda_decode_fold_bf16_rows_alone(interpreter):
    """bf16: the folded step = the unfolded one within bf16's rounding of f; each row alone = in the batch."""
    check_f_b_fold("cpu", torch.bfloat16, tol=dict(atol=3e-2, rtol=3e-2))
    check_rows_alone("cpu", torch.bfloat16)


@pytest.mark.parametrize("dtype, num_splits", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 4)],
                         ids=["fp32", "fp32-split2", "bf16-split4"])
def test_kda_decode_folds_the_output_norm(interpreter, dtype, num_splits):
    check_output_norm_fold("cpu", dtype, num_splits)
