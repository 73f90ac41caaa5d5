"""Paged decode (split-K) and prefill attention and the KV cache write vs their torch references.

Block tables are random permutations of the pool (never contiguous), seq_lens are not page multiples,
and the cache holds random data everywhere, so any lane that reads past its mask shows up.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

# the interpreter (numpy) warns on exp overflow / log(0) where the GPU quietly gives inf / -inf
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tests.kernels import checks  # noqa: E402


@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("cache_dtype", [None, torch.float16], ids=["same", "to_fp16"])
def test_reshape_and_cache(page_size, cache_dtype):
    checks.check_reshape_and_cache("cpu", torch.float32, page_size, cache_dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_writes_only_the_narrow_values_columns(num_splits):
    checks.check_decode("cpu", torch.float32, 3, 4, num_splits=num_splits, block_n=16, head_dim=48, out_dim=32,
                        sinks=True)


def test_reshape_and_cache_zero_pads_narrow_values():
    checks.check_reshape_and_cache("cpu", torch.float32, 4, v_dim=40)


@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("group", [1, 3])
def test_decode(group, page_size):
    checks.check_decode("cpu", torch.float32, group, page_size, block_n=16)


@pytest.mark.parametrize("num_splits", [3, 8])
def test_decode_split_k(num_splits):
    # 8 splits of 16-key blocks over 5..70 keys: some splits are empty, the reduction must ignore them
    checks.check_decode("cpu", torch.float32, 3, 4, num_splits=num_splits, block_n=16)


def test_decode_split_k_default_blocks():
    checks.check_decode("cpu", torch.float32, 1, 16, seq_lens=(300, 129), num_splits=4)


def test_decode_sliding_window_split_k():
    checks.check_decode("cpu", torch.float32, 3, 4, sliding_window=20, num_splits=3, block_n=16)


def test_decode_softcap_fp16():
    checks.check_decode("cpu", torch.float16, 3, 16, softcap=5.0, sliding_window=33, num_splits=2, block_n=16)


def test_decode_padded_row_is_zero():
    out = checks.check_decode("cpu", torch.float32, 1, 4, seq_lens=(9, 0, 17), num_splits=2, block_n=16)
    assert torch.count_nonzero(out[1]) == 0


@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill(group, page_size):
    # one full prefill, one 17-token prompt scored from scratch, several query blocks per sequence
    checks.check_prefill("cpu", torch.float32, group, page_size, (20, 17), (20, 17), block_m=16, block_n=16)


@pytest.mark.parametrize("group", [1, 3])
def test_chunked_prefill_mixed_with_decode(group):
    # chunks starting at positions 0, 32 (a decode row) and 21, 7
    checks.check_prefill(
        "cpu", torch.float32, group, 4, (20, 1, 9, 12), (20, 33, 30, 19), block_m=16, block_n=16
    )


def test_chunked_prefill_sliding_window():
    checks.check_prefill("cpu", torch.float32, 3, 4, (20, 1, 9), (45, 33, 30), sliding_window=8, block_m=16, block_n=16)


def test_chunked_prefill_softcap_fp16():
    checks.check_prefill("cpu", torch.float16, 3, 16, (13, 1, 9), (40, 33, 30), softcap=5.0, block_n=16)


@pytest.mark.parametrize("group", [1, 3])
def test_prefill_and_decode_in_bfloat16(group):
    """bfloat16 pages through both kernels' tl.dot (the interpreter's, widened by tests/conftest.py: unpatched it
    multiplies bit patterns, triton-lang/triton#11584), within bfloat16's tolerance of the torch references."""
    checks.check_prefill("cpu", torch.bfloat16, group, 16, (20, 1, 9), (20, 33, 30), block_m=16, block_n=16)
    checks.check_decode("cpu", torch.bfloat16, group, 4)


def test_prefill_default_blocks():
    checks.check_prefill("cpu", torch.float32, 3, 16, (70, 1), (90, 140))


@pytest.mark.parametrize("group, page_size", [(1, 4), (4, 16)])
def test_decode_from_qkv(group, page_size):
    checks.check_decode_qkv("cpu", torch.float32, group, page_size, block_n=16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_from_qkv_norms_window_softcap_splits(num_splits):
    checks.check_decode_qkv("cpu", torch.float32, 3, 4, seq_lens=(40, 1, 0, 23), num_splits=num_splits,
                            sliding_window=20, softcap=5.0, qk_norm=True, block_n=16)


def test_decode_from_qkv_half_gemma_norm_order():
    checks.check_decode_qkv("cpu", torch.float16, 2, 16, qk_norm=True, multiply_in_float32=True, num_splits=2)


@pytest.mark.parametrize("dtype, num_splits, partials, qk_norm", [(torch.float32, 1, 1, False),
                                                                  (torch.float16, 2, 5, True)])
def test_decode_from_qkv_scales_an_un_normed_row_by_its_rstd(dtype, num_splits, partials, qk_norm):
    """row_norm (the norm-free decode layer): q, k and v times the stream's rstd, rounded, then as before; the
    cache gets the scaled key and value. (bfloat16 runs in tests/gpu.)"""
    from helios.kernels.gemv import RowNorm

    # rstd = rsqrt(250 / 1000) = 2 exactly: the scaled row is exact, so kernel and reference see the same values
    # whatever rounding their rsqrt has (and a missed scale shows)
    sums = torch.full((partials,), 250.0 / partials)
    out = checks.check_decode_qkv("cpu", dtype, 2, 16, seq_lens=(37,), num_splits=num_splits, qk_norm=qk_norm,
                                  row_norm=RowNorm(sums, 1000, 0.0))
    plain = checks.check_decode_qkv("cpu", dtype, 2, 16, seq_lens=(37,), num_splits=num_splits, qk_norm=qk_norm)
    assert not torch.allclose(out.float(), plain.float(), atol=1e-2)


@pytest.mark.parametrize("merge_in_kernel", [1, 0])
def test_decode_from_qkv_merges_splits_in_its_launch(monkeypatch, merge_in_kernel):
    """Splits merged by the last program of each (sequence, kv head) to arrive, or by the merge kernel: the same
    outputs; the arrival counters are zero again after the launch."""
    from helios.kernels import decode_qkv

    monkeypatch.setattr(decode_qkv, "MERGE_IN_KERNEL", merge_in_kernel)
    checks.check_decode_qkv("cpu", torch.float32, 4, 16, seq_lens=(37, 1, 70, 0, 130), num_splits=4, block_n=16)
    checks.check_decode_qkv("cpu", torch.float16, 2, 4, seq_lens=(5, 40), num_splits=3, qk_norm=True, block_n=16)
    if merge_in_kernel:
        from helios.kernels._triton import arrival_counters

        assert not arrival_counters(torch.device("cpu"), "decode_qkv").any()
