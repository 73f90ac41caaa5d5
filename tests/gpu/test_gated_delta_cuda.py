"""helios.kernels.gated_delta compiled on CUDA: the interpreter's checks (tests/kernels/test_gated_delta.py) at small
and at Qwen3.5-27B shapes (16 key / 48 value heads, dk = dv = 128), fla's chunked prefill (GPU only: fla's kernels
do not run in Triton's interpreter), and the decode step inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from helios.kernels._triton import HAS_TRITON, interpret_mode
from tests.kernels.test_gated_delta import (
    _decode_inputs,
    check_causal_conv,
    check_causal_conv_norm_heads,
    check_decode,
    check_decode_padded_rows,
    check_prefill,
    check_recurrent_step,
    make_batch,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
CUDA = "cuda"
REAL = dict(num_k_heads=16, num_v_heads=48, dk=128, dv=128)  # Qwen3.5-27B's GDN heads


@DTYPES
def test_causal_conv(dtype):
    check_causal_conv(CUDA, dtype)
    check_causal_conv(CUDA, dtype, bias=True, activation=None)
    check_causal_conv(CUDA, dtype, query_lens=(300, 1, 64, 3), starts=(0, 9, 64, 2), channels=2 * 16 * 128 + 48 * 128)
    check_causal_conv(CUDA, dtype, query_lens=(1, 1, 1), starts=(0, 4, 1), width=3)


@DTYPES
def test_causal_conv_normalizes_q_and_k_heads(dtype):
    check_causal_conv_norm_heads(CUDA, dtype)
    check_causal_conv_norm_heads(CUDA, dtype, head=128, num_heads=16, dv=128, query_lens=(300, 1, 64),
                                 starts=(0, 9, 64))


@DTYPES
@pytest.mark.parametrize("num_splits, num_v_heads", [(None, 4), (1, 4), (2, 4), (4, 8)])
def test_decode(dtype, num_splits, num_v_heads):  # a key head's tiles: its value heads x dv / 64 columns
    check_decode(CUDA, dtype, num_v_heads=num_v_heads, num_splits=num_splits)


@DTYPES
@pytest.mark.parametrize("num_splits", [1, 3, 6])
def test_decode_real_shape(dtype, num_splits):
    check_decode(CUDA, dtype, num_splits=num_splits, starts=(0, 5, 1, 130, 0, 7, 2, 9), steps=3, **REAL)


def test_decode_odd_dims_and_bias():
    check_decode(CUDA, torch.bfloat16, conv_bias=True, num_splits=2)
    check_decode(CUDA, torch.float32, num_k_heads=1, num_v_heads=3, dk=24, dv=40, width=3, num_splits=3)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_padded_rows_share_the_scratch_slot(num_splits):
    check_decode_padded_rows(CUDA, num_splits=num_splits)


@DTYPES
@pytest.mark.parametrize("strided", [True, False])
def test_recurrent_step(dtype, strided):
    check_recurrent_step(CUDA, dtype, strided=strided)
    check_recurrent_step(CUDA, dtype, strided=strided, **REAL)


@DTYPES
def test_prefill_fla(dtype):
    pytest.importorskip("fla")
    check_prefill(CUDA, dtype)
    check_prefill(CUDA, dtype, query_lens=(200, 64, 1, 3), starts=(0, 128, 5, 64), **REAL)


def test_decode_in_a_cuda_graph_matches_eager():
    """Captured at a bucket of 8 rows (2 padded on the scratch slot), replayed over fresh inputs copied into the
    static buffers: outputs and real slots equal eager launches on the same inputs, bit for bit."""
    from helios.kernels.gated_delta import gated_delta_decode

    rows, scratch = 8, 9
    batch = make_batch([1] * rows, [5, 0, 3, 1, 9, 2, 0, 0], CUDA, num_slots=scratch)
    batch.slots[6:] = scratch  # padded rows
    batch.num_slots = scratch + 1
    inputs = _decode_inputs(CUDA, torch.bfloat16, 16, 48, 128, 128, 4, batch)
    inputs["state"] = inputs["state"].nan_to_num(0.0)  # the scratch slot starts clean here
    inputs["conv_state"] = inputs["conv_state"].nan_to_num(0.0)
    static = {k: v.clone() for k, v in inputs.items()}
    eager = {k: v.clone() for k, v in inputs.items()}
    call = dict(slots=batch.slots, starts=batch.starts, num_k_heads=16, num_splits=6)
    gated_delta_decode(**{k: v.clone() for k, v in inputs.items()}, **call)  # warm-up: compile, counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gated_delta_decode(**static, **call)
    real = torch.arange(scratch, device=CUDA)
    for step in range(3):
        fresh = _decode_inputs(CUDA, torch.bfloat16, 16, 48, 128, 128, 4, batch, seed=10 * (step + 1))
        for name in ("mixed_qkv", "a", "b"):
            static[name].copy_(fresh[name])
            eager[name].copy_(fresh[name])
        graph.replay()
        expected = gated_delta_decode(**eager, **call)
        torch.cuda.synchronize()
        assert torch.equal(out[:6], expected[:6])
        assert torch.equal(static["state"][real], eager["state"][real])
        assert torch.equal(static["conv_state"][real], eager["conv_state"][real])
