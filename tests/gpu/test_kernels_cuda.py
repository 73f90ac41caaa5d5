"""The kernel checks of tests/kernels, compiled and run on CUDA in bfloat16 and float32.

Same check functions as the interpreter tests (tests/kernels/checks.py), so a case that passes on the CPU
exercises the same code here; default block sizes are used where the CPU tests shrink them.
"""

from __future__ import annotations

import pytest
import torch

from helios.kernels._triton import HAS_TRITON, interpret_mode
from tests.kernels import checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
CUDA = "cuda"


@DTYPES
@pytest.mark.parametrize("multiply_in_float32", [False, True], ids=["llama", "gemma"])
def test_rms_norm(dtype, multiply_in_float32):
    checks.check_rms_norm(CUDA, dtype, multiply_in_float32)
    checks.check_rms_norm(CUDA, dtype, multiply_in_float32, dim=4096, num_tokens=33)


@DTYPES
def test_rms_norm_strided_heads(dtype):
    checks.check_rms_norm_strided_heads(CUDA, dtype)


@DTYPES
@pytest.mark.parametrize("multiply_in_float32", [False, True], ids=["llama", "gemma"])
def test_fused_add_rms_norm(dtype, multiply_in_float32):
    checks.check_fused_add_rms_norm(CUDA, dtype, multiply_in_float32)


@DTYPES
def test_rotary(dtype):
    checks.check_rotary(CUDA, dtype)
    checks.check_rotary(CUDA, dtype, num_heads=32, num_kv_heads=8, head_dim=128)


@DTYPES
@pytest.mark.parametrize("qk_norm, multiply_in_float32", [(False, False), (True, False), (True, True)])
def test_rotary_and_cache(dtype, qk_norm, multiply_in_float32):
    checks.check_rotary_and_cache(CUDA, dtype, qk_norm, multiply_in_float32)
    checks.check_rotary_and_cache(CUDA, dtype, qk_norm, multiply_in_float32, num_heads=32, num_kv_heads=8,
                                  head_dim=128, page_size=16)


@DTYPES
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation(dtype, act):
    checks.check_gated(CUDA, dtype, act)


@DTYPES
@pytest.mark.parametrize("page_size", [16, 4])
def test_reshape_and_cache(dtype, page_size):
    checks.check_reshape_and_cache(CUDA, dtype, page_size)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_writes_only_the_narrow_values_columns(num_splits):
    checks.check_decode(CUDA, torch.bfloat16, 4, 16, seq_lens=(700, 5, 300), num_splits=num_splits, head_dim=192,
                        out_dim=128, sinks=True)


def test_reshape_and_cache_zero_pads_narrow_values():
    checks.check_reshape_and_cache(CUDA, torch.bfloat16, 16, v_dim=40)


@DTYPES
@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("group", [1, 3])
def test_decode(dtype, group, page_size):
    checks.check_decode(CUDA, dtype, group, page_size)
    checks.check_decode(CUDA, dtype, group, page_size, block_n=16)


@DTYPES
@pytest.mark.parametrize("num_splits", [3, 8])
def test_decode_split_k(dtype, num_splits):
    checks.check_decode(CUDA, dtype, 3, 4, seq_lens=(37, 5, 700, 129), num_splits=num_splits)


@DTYPES
def test_decode_sliding_window_softcap(dtype):
    checks.check_decode(CUDA, dtype, 3, 4, sliding_window=20, num_splits=3)
    checks.check_decode(CUDA, dtype, 3, 16, seq_lens=(300, 40), softcap=5.0, sliding_window=33, num_splits=2)


@DTYPES
def test_decode_padded_row_is_zero(dtype):
    out = checks.check_decode(CUDA, dtype, 1, 4, seq_lens=(9, 0, 17), num_splits=2)
    assert torch.count_nonzero(out[1]) == 0


@DTYPES
def test_decode_real_head_shapes(dtype):
    checks.check_decode(CUDA, dtype, 4, 16, seq_lens=(1000, 77), num_splits=4, num_kv_heads=8, head_dim=128)


@DTYPES
@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill(dtype, group, page_size):
    checks.check_prefill(CUDA, dtype, group, page_size, (20, 17), (20, 17))
    checks.check_prefill(CUDA, dtype, group, page_size, (20, 1, 9, 12), (20, 33, 30, 19), block_m=16, block_n=16)


@DTYPES
def test_chunked_prefill_sliding_window_softcap(dtype):
    checks.check_prefill(CUDA, dtype, 3, 4, (20, 1, 9), (45, 33, 30), sliding_window=8)
    checks.check_prefill(CUDA, dtype, 3, 16, (130, 1, 9), (200, 33, 30), softcap=5.0)


@DTYPES
def test_prefill_real_head_shapes(dtype):
    checks.check_prefill(CUDA, dtype, 4, 16, (300, 1, 64), (300, 500, 100), num_kv_heads=8, head_dim=128)


@DTYPES
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_from_qkv(dtype, num_splits):
    checks.check_decode_qkv(CUDA, dtype, 4, 16, seq_lens=(37, 1, 300, 0), num_splits=num_splits, head_dim=128)
    checks.check_decode_qkv(CUDA, dtype, 2, 16, num_splits=num_splits, sliding_window=33, softcap=5.0, qk_norm=True)


@DTYPES
@pytest.mark.parametrize("num_splits, partials", [(1, 1), (4, 512)])
def test_decode_from_qkv_scaled_by_a_row_norm(dtype, num_splits, partials):
    """The norm-free layer's attention (rstd = 2 exactly: kernel and reference scale to the same values)."""
    from helios.kernels.gemv import RowNorm

    sums = torch.full((partials,), 32.0 / partials, device=CUDA)  # 32 / 128 = 1 / 4
    checks.check_decode_qkv(CUDA, dtype, 4, 16, seq_lens=(300,), num_splits=num_splits, head_dim=128,
                            row_norm=RowNorm(sums, 128, 0.0))
    checks.check_decode_qkv(CUDA, dtype, 2, 16, seq_lens=(37,), num_splits=num_splits, qk_norm=True,
                            row_norm=RowNorm(sums, 128, 0.0))


@DTYPES
@pytest.mark.parametrize("gated", [None, "silu"])
def test_gemv_add_at_llama_8b_shapes(dtype, gated):
    """gemv_add as the norm-free layer runs it: o (4096 x 4096) and down (4096 x 14336, gated, scaled by a
    RowNorm of 512 partials): the sum plus one float32 partial sum of squares per program."""
    from helios.kernels.gemv import RowNorm, gemv_add, gemv_add_ref

    g = torch.Generator().manual_seed(5)
    k = 14336 if gated else 4096
    x = (2 * torch.randn(1, 2 * k if gated else k, generator=g)).to(CUDA, dtype)
    weight = (torch.randn(4096, k, generator=g) / k**0.5).to(CUDA, dtype)
    add = torch.randn(1, 4096, generator=g).to(CUDA, dtype)
    row_norm = RowNorm(torch.rand(512, generator=g).to(CUDA) * 40, 2 * k, 1e-5) if gated else None
    out, partials = gemv_add(x, weight, add, gated=gated, row_norm=row_norm)
    expected, sum_squares = gemv_add_ref(x, weight, add, gated, row_norm)
    tol = 3.2e-2 if dtype == torch.bfloat16 else 1e-4
    scale = (expected.float() - add.float()).abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * max(1.0, scale))
    assert partials.shape == (512,)
    torch.testing.assert_close(partials.sum(), out.float().square().sum(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(partials.sum(), sum_squares[0], rtol=2e-2, atol=0)


def test_argmax_rows():
    checks.check_argmax_rows(CUDA)


def test_exponential_log_noise():
    checks.check_exponential_log_noise(CUDA)


def test_row_logsumexp():
    checks.check_row_logsumexp(CUDA)


def test_top_logprobs():
    checks.check_top_logprobs(CUDA)


@DTYPES
@pytest.mark.parametrize(
    "query_lens, seq_lens, window, softcap",
    [
        ([1, 1, 1], [37, 5, 70], None, None),
        ([1, 1, 1], [370, 5, 700], 160, 30.0),
        ([9, 1, 4], [30, 40, 23], 6, 20.0),
    ],
)
def test_backend_matches_torch_backend(dtype, query_lens, seq_lens, window, softcap):
    checks.check_backend(CUDA, dtype, query_lens, seq_lens, window, softcap)


# --- small-batch GEMV (helios.kernels.gemv) ------------------------------------------------------------


def _check_gemv(dtype, m, n, k, **config):
    from helios.kernels.gemv import gemv, gemv_ref

    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g).to(CUDA, dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(CUDA, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=CUDA)  # poison: every element must be written
    gemv(x, weight, out, **config)
    ref = gemv_ref(x.double(), weight.double()).to(dtype)
    assert not out.isnan().any(), "unwritten output elements"
    tol = 1.6e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(out, gemv(x, weight, **config)), "not reproducible run to run"


@DTYPES
@pytest.mark.parametrize("m", [1, 3, 5, 16])
def test_gemv(dtype, m):
    _check_gemv(dtype, m, 40, 300, block_n=8, block_k=64)  # N and K tails
    _check_gemv(dtype, m, 33, 200, block_n=8, block_k=32, split_k=3)
    _check_gemv(dtype, m, 6144, 4096)  # llama-8B qkv, default config
    _check_gemv(dtype, m, 4096, 14336, split_k=4)  # down, split-K


def test_linear_sends_one_row_16_bit_products_to_the_gemv():
    from helios.kernels.gemv import gemv_ref, gemv_serves
    from helios.layers.linear import linear
    from helios.switches import DEFAULT_SWITCHES, Switches

    g = torch.Generator(device=CUDA).manual_seed(0)
    w = torch.randn(6144, 4096, generator=g, device=CUDA, dtype=torch.bfloat16) / 64
    x = torch.randn(1, 4096, generator=g, device=CUDA, dtype=torch.bfloat16)
    assert DEFAULT_SWITCHES.gemv == "narrow"
    assert not gemv_serves(x, w, "narrow")  # narrow by default: a qkv-shaped weight stays on cuBLAS
    assert gemv_serves(x, w, "all") and not gemv_serves(torch.cat([x, x]), w, "all")
    assert not gemv_serves(x.float(), w.float(), "all")
    every = Switches(gemv="all")
    torch.testing.assert_close(linear(x, w, None, every).float(), gemv_ref(x, w).float(), rtol=1.6e-2, atol=1.6e-2)
    down = torch.randn(4096, 8192, generator=g, device=CUDA, dtype=torch.bfloat16)  # narrow: rows <= columns
    assert gemv_serves(torch.cat([x, x], 1), down, "narrow")
    assert not gemv_serves(x, w, "off")
    torch.testing.assert_close(linear(x, w, None, Switches(gemv="off")).float(), gemv_ref(x, w).float(),
                               rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("mode", ["bulk", "load"])
def test_l2_prefetch_branch_runs_beside_the_body_in_a_graph(mode):
    """The l2_prefetch switch (HELIOS_L2_PREFETCH): the side-stream prefetch is captured as a parallel branch
    joined before the consumer;
    the weight is untouched and the consumer's result is the same as without it."""
    from helios.kernels.prefetch import l2_prefetch

    weight = torch.randn(4096, 4096, device=CUDA, dtype=torch.bfloat16)
    kept = weight.clone()
    x = torch.randn(1, 4096, device=CUDA, dtype=torch.bfloat16)
    want = x @ weight.T

    def step():
        with l2_prefetch(weight, 1, mode):
            y = x * 2.0
        return (y / 2.0) @ weight.T

    torch.testing.assert_close(step(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want)
    assert torch.equal(weight, kept)


@DTYPES
def test_rope_table_rows_equal_the_computed_rows(dtype):
    """On CUDA the tabulated (cos, sin) rows are the very bits cos_sin computes per step (same elementwise
    kernels over the same inputs): the runner gathers them in place of ~9 launches a step."""
    from helios.core.manifest import RopeScaling
    from helios.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(128, 500000.0, RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=8192),
                           131072, CUDA)
    positions = torch.tensor([0, 1, 7, 4095, 65535, 65536, 131071, 33], device=CUDA)
    want = rope.cos_sin(positions, dtype)
    rope.tabulate(131072, dtype)
    got = rope.cos_sin(positions, dtype)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
