"""helios.kernels.activation with helios.layers.activation.gated's clamps (before / after the act) and SwiGLU-OAI's
alpha vs that torch path: float32 within rounding, bf16 bit for bit; and a clamped GatedMLP on the fused path
equals it unfused."""

from __future__ import annotations

import pytest
import torch

from helios.kernels import activation
from helios.layers.activation import GatedMLP, gated

# tests/gpu/test_mlp_folds_cuda.py runs the checks compiled; here they need the interpreter
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.usefixtures("interpreter")]


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()

# (limit, clamp_after_act, alpha): glm5_next / deepseek_v4, step3p7, minimax_m3, plain
VARIANTS = [(7.0, False, None), (0.4, True, None), (7.0, False, 1.702), (None, False, 1.702), (None, False, None)]


def _rows(dtype: torch.dtype, num_tokens: int = 5, width: int = 1100, device: str = "cpu") -> torch.Tensor:
    # F = 1100: two column blocks and a masked tail; scale 6 so a bound of 7 (and of 0.4) clamps many values
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(num_tokens, 2 * width, generator=g) * 6.0
    x[0, :8] = torch.tensor([-30.0, -12.0, -1e-3, 0.0, 1e-3, 12.0, 30.0, 7.0])
    x[0, width:width + 4] = torch.tensor([-30.0, -7.0, 7.0, 30.0])
    return x.to(device=device, dtype=dtype)


def check_gated_variant(device: str, dtype: torch.dtype, act: str, limit, clamp_after_act, alpha,
                        max_flips: float = 0.0) -> None:
    """max_flips: on CUDA the kernel's exp (and division) and torch's may differ in float32's last bits: that share of
    bf16 values may be one ulp off (as tests/kernels/test_layer_folds.py's sigmoid gate)."""
    x = _rows(dtype, device=device)
    actual = getattr(activation, f"{act}_and_mul")(x, limit, clamp_after_act, alpha)
    expected = gated(x, act, limit, clamp_after_act, alpha=alpha)
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    elif limit is None and alpha is None and device == "cpu":
        # NOTE: the plain product is gemv's fold, whose 16-bit conversions truncate in the interpreter (the GPU rounds)
        # (up to two bf16 ulps here: the act's and the product's)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=2**-6)
    elif act == "gelu_tanh":
        # NOTE: 1 + tanh(y) cancels where gate < -3: there the last bits follow the tanh (the kernel's exp-based one,
        # torch's Sleef or libdevice one), ~1e-7 absolute, not the bf16 roundings
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=2**-8)
        big = expected.float().abs() > 1e-2
        assert torch.equal(actual[big], expected[big])
    else:
        diff = actual != expected
        assert diff.float().mean().item() <= max_flips, f"{int(diff.sum())} of {diff.numel()} differ"
        torch.testing.assert_close(actual, expected, atol=0, rtol=2 ** -7)


def check_clamped_mlp(device: str, dtype: torch.dtype, limit, clamp_after_act, num_tokens: int,
                      exact: bool = True) -> None:
    """exact=False (CUDA): bf16 within the down projection's rounding of an activation one ulp off."""
    torch.manual_seed(1)
    mlp = GatedMLP(64, 96, "silu", limit=limit, clamp_after_act=clamp_after_act).to_empty(device=device)
    with torch.no_grad():
        for p in mlp.parameters():
            p.data = (torch.randn(p.shape) * 0.5).to(device=device, dtype=dtype)
    x = (torch.randn(num_tokens, 64) * 2.0).to(device=device, dtype=dtype)
    expected = mlp(x)
    mlp.fused = True
    actual = mlp(x)
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    elif exact:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2 ** -6)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("limit, clamp_after_act, alpha", VARIANTS)
def test_gated_variant_matches_the_torch_path(dtype, act, limit, clamp_after_act, alpha):
    check_gated_variant("cpu", dtype, act, limit, clamp_after_act, alpha)


@DTYPES
@pytest.mark.parametrize("limit, clamp_after_act", [(7.0, False), (0.4, True)])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_clamped_mlp_fused_equals_unfused(dtype, limit, clamp_after_act, num_tokens):
    check_clamped_mlp("cpu", dtype, limit, clamp_after_act, num_tokens)
