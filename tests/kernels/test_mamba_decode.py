"""helios.kernels.mamba.mamba2_decode (the conv and the scan step in one launch) = the fused layer's two-launch path
(gated_delta.causal_conv, then mamba2_scan) and the references, outputs and both states (Triton interpreter; the
check runs on CUDA in tests/gpu/test_layer_folds_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import tolerance


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _inputs(device, dtype, starts, num_heads, num_groups, head_dim, state_dim, width, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, num_slots = len(starts), len(starts) + 2
    channels = num_heads * head_dim + 2 * num_groups * state_dim
    wide = torch.randn(rows, channels + 24, generator=g)  # in_proj's row: xBC is a strided view of it

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device)

    return dict(
        xbc=wide.to(device, dtype)[:, 8: 8 + channels], dt=rand(rows, num_heads).to(dtype),
        conv_weight=rand(channels, width, scale=0.5).to(dtype), conv_bias=rand(channels, scale=0.1).to(dtype)
        if bias else None, conv_state=rand(num_slots, width - 1, channels).to(dtype),
        A_log=rand(num_heads, scale=0.5), D=rand(num_heads), dt_bias=rand(num_heads, scale=0.5),
        state=rand(num_slots, num_heads, head_dim, state_dim, scale=0.3),
        slots=torch.tensor([num_slots - 1 - i for i in range(rows)], dtype=torch.int32, device=device),
        starts=torch.tensor(starts, dtype=torch.int32, device=device), num_groups=num_groups)


def check_mamba2_decode(device, dtype, starts=(3, 0, 1), num_heads=4, num_groups=2, head_dim=20, state_dim=16,
                        width=4, bias=True, dt_limit=(0.0, float("inf")), f32=None):
    """mamba2_decode against causal_conv + mamba2_scan (the Triton path it replaces) and mamba2_decode_ref; the
    conv state and the ssm state updated alike at every slot (fresh rows' slots NaN, never read)."""
    from helios.kernels.gated_delta import causal_conv
    from helios.kernels.mamba import mamba2_decode, mamba2_decode_ref, mamba2_scan

    inputs = _inputs(device, dtype, starts, num_heads, num_groups, head_dim, state_dim, width, bias)
    for start, slot in zip(starts, inputs["slots"].tolist()):
        if start == 0:  # a fresh sequence's slot is never read
            inputs["conv_state"][slot].fill_(float("nan"))
            inputs["state"][slot].fill_(float("nan"))
    ours, two, ref = ({**inputs, "conv_state": inputs["conv_state"].clone(), "state": inputs["state"].clone()}
                      for _ in range(3))
    got = mamba2_decode(**ours, dt_limit=dt_limit)
    rows = len(starts)
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=device)
    y = causal_conv(two["xbc"], two["conv_weight"], two["conv_state"], two["slots"], qsl, two["starts"],
                    bias=two["conv_bias"], activation="silu")
    inner, groups = num_heads * head_dim, num_groups * state_dim
    xs, b, c = y.split([inner, groups, groups], dim=-1)
    want = mamba2_scan(xs.reshape(rows, num_heads, head_dim), two["dt"], two["A_log"],
                       b.reshape(rows, num_groups, state_dim), c.reshape(rows, num_groups, state_dim), two["D"],
                       two["dt_bias"], two["state"], two["slots"], qsl, two["starts"], dt_limit=dt_limit)
    want_ref = mamba2_decode_ref(**ref, dt_limit=dt_limit)
    tol = (f32 or tolerance(dtype)) if dtype == torch.float32 else tolerance(dtype)
    assert got.dtype == dtype and got.shape == (rows, num_heads, head_dim)
    slots = inputs["slots"].long()
    for other, out in ((two, want), (ref, want_ref)):
        torch.testing.assert_close(got, out, **tol)
        torch.testing.assert_close(ours["conv_state"][slots], other["conv_state"][slots], rtol=0, atol=0)
        torch.testing.assert_close(ours["state"][slots], other["state"][slots], **tol)
    from helios.kernels._triton import arrival_counters

    assert not arrival_counters(ours["state"].device, "mamba2_decode").any(), "the arrival counters are left zero"
    untouched = [s for s in range(inputs["state"].shape[0]) if s not in slots.tolist()]
    torch.testing.assert_close(ours["conv_state"][untouched], inputs["conv_state"][untouched], rtol=0, atol=0)
    return got, want


def test_mamba2_decode_float32(interpreter):
    check_mamba2_decode("cpu", torch.float32)  # two head-dim tiles, two heads a group: 4 arrivals per group
    check_mamba2_decode("cpu", torch.float32, starts=(7,), num_heads=2, num_groups=2, head_dim=16, width=3,
                        bias=False, dt_limit=(0.05, 0.8))  # one program per group: no counter


def test_mamba2_decode_bf16(interpreter):
    check_mamba2_decode("cpu", torch.bfloat16, starts=(5, 0))
