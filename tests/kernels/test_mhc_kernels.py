"""helios.kernels.mhc (Triton interpreter): mhc_pre, hyper_head and mhc_expand = the torch path (helios.layers.mhc's
ManifoldHyperConnection, deepseek_v4's head) within float32 rounding, bfloat16 within its rounding; every token's
values batched = computed alone, bit for bit. The check_* functions take a device: tests/gpu/test_mhc_cuda.py runs
them compiled."""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import MhcConfig

F32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2 ** -7)  # one bfloat16 rounding of the output apart


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def tolerance(dtype: torch.dtype, f32: dict = F32) -> dict:
    return f32 if dtype == torch.float32 else BF16


def hyper_connection(num_streams: int, hidden: int, dtype: torch.dtype, device: str, iterations: int = 20,
                     seed: int = 0):
    """A ManifoldHyperConnection with random weights bound (checkpoint-like magnitudes: logits of a few units)."""
    from helios.layers.mhc import ManifoldHyperConnection

    g = torch.Generator().manual_seed(seed)
    s, n = num_streams, (2 + num_streams) * num_streams
    hc = ManifoldHyperConnection(hidden, MhcConfig(num_streams=s, sinkhorn_iterations=iterations, eps=1e-6), 1e-6)
    hc.proj.weight = torch.nn.Parameter((torch.randn(n, s * hidden, generator=g) / (s * hidden) ** 0.5).to(dtype),
                                        requires_grad=False)
    hc.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype), requires_grad=False)
    hc.scale = torch.nn.Parameter(torch.tensor([0.7, 1.3, 2.0]).to(dtype), requires_grad=False)
    return hc.to(device)


def streams(num_tokens: int, num_streams: int, hidden: int, dtype: torch.dtype, device: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(num_tokens, num_streams, hidden, generator=g)).to(dtype).to(device)


def check_pre_matches_the_layer(device: str, dtype: torch.dtype, num_tokens: int, num_streams: int = 4,
                                hidden: int = 300, iterations: int = 20, f32: dict = F32) -> None:
    hc = hyper_connection(num_streams, hidden, dtype, device, iterations)
    x = streams(num_tokens, num_streams, hidden, dtype, device)
    want = hc(x)
    hc.fused = True
    got = hc(x)
    names = ("post", "comb", "collapsed")
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
    torch.testing.assert_close(got[0], want[0], **f32)  # post and comb are float32 from float32 sums
    torch.testing.assert_close(got[1], want[1], **f32)
    torch.testing.assert_close(got[2], want[2], **tolerance(dtype, f32))
    columns = got[1].double().sum(-2)  # Sinkhorn ends on the columns: each sums to 1 (to its eps)
    torch.testing.assert_close(columns, torch.ones_like(columns), atol=1e-4, rtol=0)


def check_expand_matches_the_layer(device: str, dtype: torch.dtype, num_tokens: int, num_streams: int = 4,
                                   hidden: int = 300, f32: dict = F32) -> None:
    from helios.kernels.mhc import mhc_expand_ref

    hc = hyper_connection(num_streams, hidden, dtype, device)
    x = streams(num_tokens, num_streams, hidden, dtype, device)
    post, comb, _ = hc(x)
    y = streams(num_tokens, 1, hidden, dtype, device, seed=2)[:, 0]
    want = mhc_expand_ref(x, y, post, comb)
    hc.fused = True
    got = hc.expand(x, y, post, comb)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, **tolerance(dtype, f32))


def head_weights(num_streams: int, hidden: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(num_streams, num_streams * hidden, generator=g) / (num_streams * hidden) ** 0.5).to(dtype)
    return weight.to(device), torch.randn(num_streams, generator=g).to(dtype).to(device), \
        torch.tensor([1.5]).to(dtype).to(device)


def check_head_matches_the_reference(device: str, dtype: torch.dtype, num_tokens: int, num_streams: int = 4,
                                     hidden: int = 300, f32: dict = F32) -> None:
    from helios.kernels.mhc import hyper_head, hyper_head_ref

    x = streams(num_tokens, num_streams, hidden, dtype, device)
    args = (x, *head_weights(num_streams, hidden, dtype, device), 1e-6, 1e-6)
    got = hyper_head(*args)
    assert got.shape == (num_tokens, hidden) and got.dtype == dtype
    torch.testing.assert_close(got, hyper_head_ref(*args), **tolerance(dtype, f32))


def check_batched_equals_alone(device: str, dtype: torch.dtype, num_tokens: int = 6, num_streams: int = 4,
                               hidden: int = 300) -> None:
    """Each token's post, comb, collapse, expansion and head output batched = the same token run alone, bit for bit
    (tokens land at every position of a mix program's block)."""
    from helios.kernels.mhc import hyper_head, mhc_expand

    hc = hyper_connection(num_streams, hidden, dtype, device)
    hc.fused = True
    x = streams(num_tokens, num_streams, hidden, dtype, device)
    y = streams(num_tokens, 1, hidden, dtype, device, seed=2)[:, 0]
    head = head_weights(num_streams, hidden, dtype, device)
    post, comb, collapsed = hc(x)
    expanded = mhc_expand(x, y, post, comb)
    headed = hyper_head(x, *head, 1e-6, 1e-6)
    for t in range(num_tokens):
        alone = hc(x[t : t + 1])
        for name, batched, one in zip(("post", "comb", "collapsed"), (post, comb, collapsed), alone):
            assert torch.equal(batched[t : t + 1], one), (name, t)
        assert torch.equal(expanded[t : t + 1], mhc_expand(x[t : t + 1], y[t : t + 1], post[t : t + 1],
                                                           comb[t : t + 1])), ("expand", t)
        assert torch.equal(headed[t : t + 1], hyper_head(x[t : t + 1], *head, 1e-6, 1e-6)), ("head", t)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 3, 9])
def test_pre_matches_the_layer(interpreter, dtype, num_tokens):
    check_pre_matches_the_layer("cpu", dtype, num_tokens)


def test_pre_serves_two_streams_and_wide_rows(interpreter):
    """deepseek_v4's tiny S = 2; a hidden size past one collapse block (1024) and 18 splits of the mix."""
    check_pre_matches_the_layer("cpu", torch.float32, 2, num_streams=2, hidden=96, iterations=5)
    check_pre_matches_the_layer("cpu", torch.float32, 2, num_streams=4, hidden=1100, iterations=1)


@DTYPES
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_expand_matches_the_layer(interpreter, dtype, num_tokens):
    check_expand_matches_the_layer("cpu", dtype, num_tokens)


@DTYPES
def test_head_matches_the_reference(interpreter, dtype):
    check_head_matches_the_reference("cpu", dtype, 5)


@DTYPES
def test_batched_tokens_equal_each_alone(interpreter, dtype):
    check_batched_equals_alone("cpu", dtype)


def test_no_tokens_launch_nothing(interpreter):
    hc = hyper_connection(4, 64, torch.float32, "cpu")
    hc.fused = True
    post, comb, collapsed = hc(torch.zeros(0, 4, 64))
    assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and collapsed.shape == (0, 64)
    assert hc.expand(torch.zeros(0, 4, 64), collapsed, post, comb).shape == (0, 4, 64)
