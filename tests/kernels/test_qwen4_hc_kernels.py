"""helios.kernels.qwen4_hc (Triton interpreter): hc_mix = the torch path (helios.layers.hyper_connections'
HyperConnection, the previous sublayer's output added first) within float32 rounding, bfloat16 within its rounding
(the projections' sums in another order; every other rounding where torch takes it), the added streams bit for bit;
every token's values batched = computed alone, bit for bit. The check_* functions take a device:
tests/gpu/test_qwen4_hc_cuda.py runs them compiled."""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import HyperConnectionConfig

F32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2 ** -7)  # one bfloat16 rounding of the output apart


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def tolerance(dtype: torch.dtype, f32: dict = F32) -> dict:
    return f32 if dtype == torch.float32 else BF16


def hyper_connection(num_streams: int, hidden: int, rank: int, dtype: torch.dtype, device: str, inject: bool = True,
                     seed: int = 0):
    """A HyperConnection with random weights bound (checkpoint-like magnitudes: unit-ish gate logits)."""
    from helios.layers.hyper_connections import HyperConnection

    g = torch.Generator().manual_seed(seed)
    width = num_streams * hidden
    hc = HyperConnection(hidden, HyperConnectionConfig(num_streams=num_streams, rank=rank), 1e-6, inject=inject)

    def param(*shape, scale=1.0, offset=0.0):
        return torch.nn.Parameter((offset + scale * torch.randn(*shape, generator=g)).to(dtype), requires_grad=False)

    hc.norm.weight = param(width, scale=0.2, offset=1.0)
    hc.down.weight = param(rank, width, scale=2 / width ** 0.5)
    hc.up.weight = param(width, rank, scale=2 / rank ** 0.5)
    if inject:
        hc.inject.weight = param(num_streams, width, scale=2 / width ** 0.5)
    return hc.to(device)


def rows(num_tokens: int, width: int, dtype: torch.dtype, device: str, seed: int, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(num_tokens, width, generator=g)).to(dtype).to(device)


def inputs(num_tokens: int, num_streams: int, hidden: int, dtype: torch.dtype, device: str):
    """The streams, and a previous sublayer's (output, injection weights in (0, 2))."""
    x = rows(num_tokens, num_streams * hidden, dtype, device, seed=1)
    y = rows(num_tokens, hidden, dtype, device, seed=2)
    w = (2 * torch.sigmoid(rows(num_tokens, num_streams, torch.float32, "cpu", seed=3))).to(dtype).to(device)
    return x, (y, w)


def check_mix_matches_the_layer(device: str, dtype: torch.dtype, num_tokens: int, num_streams: int = 3,
                                hidden: int = 96, rank: int = 40, inject: bool = True, add: bool = True,
                                f32: dict = F32) -> None:
    hc = hyper_connection(num_streams, hidden, rank, dtype, device, inject)
    x, residual = inputs(num_tokens, num_streams, hidden, dtype, device)
    residual = residual if add else None
    want = hc(x, residual)
    hc.fused = True
    got = hc(x, residual)
    assert got[0].shape == (num_tokens, hidden) and got[0].dtype == dtype
    torch.testing.assert_close(got[0], want[0], **tolerance(dtype, f32))
    if dtype != torch.float32:  # rounded where torch rounds: only a projection's other sum order may flip a bit
        assert (got[0] != want[0]).float().mean() <= 0.02, "bfloat16 bits apart from the torch path's"
    if inject:
        assert got[1].shape == (num_tokens, num_streams) and got[1].dtype == dtype
        torch.testing.assert_close(got[1], want[1], **tolerance(dtype, f32))
    else:
        assert got[1] is None and want[1] is None
    assert got[2].dtype == dtype and torch.equal(got[2], want[2]), "the added streams: two roundings, as torch's"


def check_batched_equals_alone(device: str, dtype: torch.dtype, num_tokens: int = 18, num_streams: int = 3,
                               hidden: int = 96, rank: int = 40) -> None:
    """Each token's sublayer input, weights and streams batched = the same token run alone, bit for bit (tokens land
    at every row of a program's 16-token block, and in a second block)."""
    hc = hyper_connection(num_streams, hidden, rank, dtype, device)
    hc.fused = True
    x, (y, w) = inputs(num_tokens, num_streams, hidden, dtype, device)
    batched = hc(x, (y, w))
    for t in range(num_tokens):
        alone = hc(x[t : t + 1], (y[t : t + 1], w[t : t + 1]))
        for name, b, a in zip(("input", "weights", "streams"), batched, alone):
            assert torch.equal(b[t : t + 1], a), (name, t)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_mix_matches_the_layer(interpreter, dtype, num_tokens):
    check_mix_matches_the_layer("cpu", dtype, num_tokens)


@DTYPES
def test_the_head_and_the_first_mix(interpreter, dtype):
    """hc_head (no inject weights) after the last layer's add; the first layer's mix (nothing to add)."""
    check_mix_matches_the_layer("cpu", dtype, 2, inject=False)
    check_mix_matches_the_layer("cpu", dtype, 2, add=False)


def test_wide_streams_and_two_of_them(interpreter):
    """Hidden sizes past one step of columns (128) and one gate block (32), 2 and 4 streams, ranks past one step of
    the up projection (32) and projection rows over several norm-mix programs (16 each)."""
    check_mix_matches_the_layer("cpu", torch.float32, 2, num_streams=2, hidden=300, rank=8)
    check_mix_matches_the_layer("cpu", torch.float32, 1, num_streams=4, hidden=64, rank=70)


@DTYPES
def test_batched_tokens_equal_each_alone(interpreter, dtype):
    check_batched_equals_alone("cpu", dtype)


def test_no_tokens_launch_nothing(interpreter):
    hc = hyper_connection(2, 32, 8, torch.float32, "cpu")
    hc.fused = True
    x, (y, w) = inputs(0, 2, 32, torch.float32, "cpu")
    out, weights, streams = hc(x, (y, w))
    assert out.shape == (0, 32) and weights.shape == (0, 2) and streams.shape == (0, 64)
