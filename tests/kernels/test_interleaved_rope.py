"""helios.kernels.interleaved_rope (deepseek_v4's decode rope: unit_rms and the interleaved rotation of a head's
trailing rope_dim values in one launch) against its torch reference and helios.layers.compressed_attention's own
unit_rms / rotate_tail, in Triton's CPU interpreter: cos/sin per token or a table's rows by position (the tabulated
RotaryEmbedding's first half), forwards and back, into a strided view of a wider tensor."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_decode import _randn

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

NUM_TOKENS, NUM_HEADS, HEAD_DIM, ROPE_DIM = 5, 20, 32, 8


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _rope(dtype, device="cpu"):
    """(the rope, its per-token (cos, sin) at the positions, the table's (cos, sin), the positions)."""
    from helios.layers.compressed_attention import InterleavedRope

    rope = InterleavedRope(ROPE_DIM, 10000.0, None, 512, device)
    rope.rotary.tabulate(64, dtype)
    positions = torch.tensor([0, 7, 63, 30, 1], device=device)
    return rope, rope.cos_sin(positions, dtype), rope.table(dtype), positions


NORMS = [(None, False), ("unit", False), ("weighted", False), (None, True)]  # (norm, inverse)


def check_rope(device, dtype, norm, inverse, block_h=None):
    """norm: unit_rms (the queries'), rms_norm with a weight multiplied in float32 (kv_norm's), or none; block_h: heads
    a program turns (8: three programs a token, the last partly masked)."""
    from helios.kernels.interleaved_rope import interleaved_rope, interleaved_rope_ref
    from helios.layers.compressed_attention import rotate_tail, unit_rms
    from helios.layers.norm import rms_norm

    rope, (cos, sin), (table_cos, table_sin), positions = _rope(dtype, device)
    torch.testing.assert_close(table_cos[positions], cos, atol=0, rtol=0)  # the table holds cos_sin's bits
    torch.testing.assert_close(table_sin[positions], sin, atol=0, rtol=0)
    x = _randn(NUM_TOKENS, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device, seed=1) * 3
    weight = _randn(HEAD_DIM, device=device, seed=9) if norm == "weighted" else None
    kwargs = dict(norm_eps=None if norm is None else 1e-6, norm_weight=weight, inverse=inverse)
    launch = dict(block_h=block_h)
    want = {None: x, "unit": unit_rms(x, 1e-6) if norm == "unit" else None,
            "weighted": rms_norm(x, weight, 1e-6, multiply_in_float32=True) if weight is not None else None}[norm]
    want = rotate_tail(want, cos, -sin if inverse else sin)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(interleaved_rope_ref(x, cos, sin, **kwargs), want, atol=0, rtol=0)
    per_token, tabulated = (interleaved_rope(x, cos, sin, **kwargs, **launch),
                            interleaved_rope(x, table_cos, table_sin, positions, **kwargs, **launch))
    for got in (per_token, tabulated):
        torch.testing.assert_close(got, want, **tol)
        if norm is None:  # the values before the rope part pass as they are
            assert torch.equal(got[..., : HEAD_DIM - ROPE_DIM], x[..., : HEAD_DIM - ROPE_DIM])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm, inverse", NORMS)
def test_rope_matches_the_layers_ops(interpreter, dtype, norm, inverse):
    check_rope("cpu", dtype, norm, inverse)


def test_rope_over_several_head_blocks(interpreter):
    check_rope("cpu", torch.float32, "unit", False, block_h=8)


def test_rope_writes_a_strided_view_and_nothing_else(interpreter):
    """out= a view of one head's columns in a wider row, over the input's own columns (the layer's kv, normed and
    turned in place in its projection): the rest unchanged."""
    from helios.kernels.interleaved_rope import interleaved_rope, interleaved_rope_ref

    _, (cos, sin), _, _ = _rope(torch.float32)
    wide = _randn(NUM_TOKENS, 3 * HEAD_DIM, device="cpu", seed=2)
    before = wide.clone()
    kv = wide[:, None, HEAD_DIM : 2 * HEAD_DIM]
    weight = _randn(HEAD_DIM, device="cpu", seed=9)
    want = interleaved_rope_ref(kv.clone(), cos, sin, norm_eps=1e-6, norm_weight=weight)[:, 0]
    interleaved_rope(kv, cos, sin, norm_eps=1e-6, norm_weight=weight, out=kv)
    torch.testing.assert_close(wide[:, HEAD_DIM : 2 * HEAD_DIM], want, atol=1e-6, rtol=1e-5)
    assert torch.equal(wide[:, :HEAD_DIM], before[:, :HEAD_DIM])
    assert torch.equal(wide[:, 2 * HEAD_DIM :], before[:, 2 * HEAD_DIM :])
