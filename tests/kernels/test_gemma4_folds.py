"""gemma4's folds = the torch ops they replace (Triton interpreter here; tests/gpu/test_mlp_folds_cuda.py on CUDA):
the final soft-cap (helios.kernels.softcap for div, tanh, mul), the per-layer-input gate act(gate) * ple of two
tensors (helios.kernels.activation.act_and_mul) and the per-layer inputs (helios.kernels.ple_inputs for two
multiplies, a norm, an add and a multiply): float32 within rounding, bf16 bit for bit."""

from __future__ import annotations

import pytest
import torch

from helios.layers.activation import ACTIVATIONS, act_and_mul, softcap

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.usefixtures("interpreter")]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def check_softcap(device: str, dtype: torch.dtype, num_rows: int = 3, vocab: int = 5000, cap: float = 30.0,
                  max_flips: float = 0.0) -> None:
    """max_flips (CUDA): the share of bf16 values that may be one ulp off where the kernel's tanh and torch's differ
    in float32's last bits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=g) * 40.0  # past the cap on both sides
    logits[0, :5] = torch.tensor([0.0, -0.0, 1e-4, 300.0, -300.0])
    logits = logits.to(device=device, dtype=dtype)
    got, want = softcap(logits, cap, kernel=True), softcap(logits, cap)
    assert got.dtype == dtype and got.shape == logits.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-6)  # tanh's last float32 bits
    else:
        diff = got != want
        assert diff.float().mean().item() <= max_flips, f"{int(diff.sum())} of {diff.numel()} differ"
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
    assert got.abs().max().item() <= cap


def check_ple_gate(device: str, dtype: torch.dtype, act: str, num_tokens: int = 3, num_layers: int = 4,
                   ple_dim: int = 256) -> None:
    """act(gate) * ple[:, i]: ple a strided view of the [T, L, P] per-layer inputs, as gemma4's layers read it."""
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(num_tokens, ple_dim, generator=g) * 2.0).to(device=device, dtype=dtype)
    ple = torch.randn(num_tokens, num_layers, ple_dim, generator=g).to(device=device, dtype=dtype)[:, 2]
    got, want = act_and_mul(gate, ple, act, kernel=True), ACTIVATIONS[act](gate) * ple
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    elif act == "gelu_tanh":
        # gate within [-3, 3]: no cancellation in 1 + tanh (tests/kernels/test_gated_clamp.py says more)
        keep = gate.float().abs() < 3.0
        torch.testing.assert_close(got[keep], want[keep], atol=0, rtol=0)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=2 ** -8)
    else:
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def check_ple_inputs(device: str, dtype: torch.dtype, num_tokens: int = 3, num_layers: int = 5, ple_dim: int = 96,
                     hidden: int = 640, max_flips: float = 0.0) -> None:
    """helios.layers.gemma4_inputs.per_layer_inputs on its kernel = its torch ops; proj a row-strided view. max_flips (CUDA):
    the share of bf16 values one ulp off where the device's rsqrt or sum order moves float32's last bits."""
    from helios.layers.norm import RMSNorm
    from helios.layers.gemma4_inputs import per_layer_inputs

    g = torch.Generator().manual_seed(2)
    width = num_layers * ple_dim
    proj = (torch.randn(num_tokens, width + 8, generator=g) * 9.0).to(device=device, dtype=dtype)[:, :width]
    rows = torch.randn(num_tokens, width, generator=g).to(device=device, dtype=dtype)
    norm = RMSNorm(ple_dim, 1e-6, multiply_in_float32=True)
    norm.weight = torch.nn.Parameter((1.0 + 0.1 * torch.randn(ple_dim, generator=g)).to(device=device, dtype=dtype))
    args = (proj, rows, norm, num_layers, hidden**-0.5, ple_dim**0.5)
    got, want = per_layer_inputs(*args, kernel=True), per_layer_inputs(*args)
    assert got.shape == (num_tokens, num_layers, ple_dim) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        diff = got != want
        assert diff.float().mean().item() <= max_flips, f"{int(diff.sum())} of {diff.numel()} differ"
        torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)


@DTYPES
def test_ple_inputs_match_the_torch_path(dtype):
    check_ple_inputs("cpu", dtype)


@DTYPES
def test_softcap_matches_the_torch_path(dtype):
    check_softcap("cpu", dtype)


@DTYPES
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_ple_gate_matches_the_torch_path(dtype, act):
    check_ple_gate("cpu", dtype, act)
