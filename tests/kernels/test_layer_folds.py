"""helios.kernels.relu2 and helios.kernels.output_gate = the torch ops they replace (Triton interpreter): float32
within rounding, bf16 bit for bit where the torch path rounds; the check_* functions run on CUDA too
(tests/gpu/test_layer_folds_cuda.py)."""

from __future__ import annotations

import pytest
import torch

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _rows(device, dtype, num_tokens, width, seed, stride_pad=0):
    """[num_tokens, width] normal values, as a row-strided view when stride_pad > 0, with zeros, signed zeros
    and large values in the first row."""
    g = torch.Generator().manual_seed(seed)
    wide = 3 * torch.randn(num_tokens, width + stride_pad, generator=g)
    wide[0, :4] = torch.tensor([0.0, -0.0, 40.0, -40.0])
    return wide.to(device, dtype)[:, :width]


def check_relu2(device, dtype, num_tokens=3, width=1500, stride_pad=0):
    """relu2 = helios.layers.moe.relu2 (torch's relu then square) bit for bit, in either dtype."""
    from helios.kernels.relu2 import relu2, relu2_ref
    from helios.layers.moe import relu2 as torch_relu2

    x = _rows(device, dtype, num_tokens, width, 0, stride_pad)
    got = relu2(x)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == x.shape
    torch.testing.assert_close(got, torch_relu2(x), rtol=0, atol=0)
    torch.testing.assert_close(got, relu2_ref(x), rtol=0, atol=0)


def check_sigmoid_gate(device, dtype, num_tokens=3, width=1500, stride_pad=0, max_flips=0.0):
    """sigmoid_gate = o * torch.sigmoid(g): float32 within rounding; bf16 bit for bit, or (on CUDA, where the
    kernel's exp and torch's differ in float32's last bits) off by one bf16 ulp on at most max_flips of them."""
    from helios.kernels.output_gate import sigmoid_gate, sigmoid_gate_ref

    o = _rows(device, dtype, num_tokens, width, 1)
    g = _rows(device, dtype, num_tokens, width, 2, stride_pad)  # a view of the wider qkv row, as attention's
    got, want = sigmoid_gate(o, g), sigmoid_gate_ref(o, g)
    assert got.dtype == dtype and got.is_contiguous() and got.shape == o.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
        return
    diff = got != want
    assert diff.float().mean().item() <= max_flips, f"{int(diff.sum())} of {diff.numel()} differ"
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)  # one ulp at most


@DTYPES
def test_relu2_matches_torch(interpreter, dtype):
    check_relu2("cpu", dtype)
    check_relu2("cpu", dtype, num_tokens=1, width=48, stride_pad=16)


@DTYPES
def test_sigmoid_gate_matches_torch(interpreter, dtype):
    check_sigmoid_gate("cpu", dtype)
    check_sigmoid_gate("cpu", dtype, num_tokens=1, width=48, stride_pad=32)


def test_empty_batches(interpreter):
    from helios.kernels.output_gate import sigmoid_gate
    from helios.kernels.relu2 import relu2

    x = torch.zeros(0, 8)
    assert relu2(x).shape == (0, 8) and sigmoid_gate(x, x).shape == (0, 8)


@DTYPES
def test_fused_relu2_mlp_matches_the_torch_layer(interpreter, dtype):
    """helios.layers.relu2.FusedRelu2MLP: fused (the relu2 launch) = unfused (torch's relu and square), same bits."""
    from helios.layers.relu2 import FusedRelu2MLP
    from tests.kernels.test_recurrent_kernels import tie_weights

    layers = {fused: FusedRelu2MLP(32, 80, fused=fused) for fused in (False, True)}
    tie_weights(layers, seed=4)
    layers = {fused: layer.to(dtype) for fused, layer in layers.items()}
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layers[True](x), layers[False](x), rtol=0, atol=0)
