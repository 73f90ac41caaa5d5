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


def _rope(dtype):
    """(the rope, its per-token (cos, sin) at the positions, the table's (cos, sin), the positions)."""
    from helios.layers.compressed_attention import InterleavedRope

    rope = InterleavedRope(ROPE_DIM, 10000.0, None, 512)
    rope.rotary.tabulate(64, dtype)
    positions = torch.tensor([0, 7, 63, 30, 1])
    return rope, rope.cos_sin(positions, dtype), rope.table(dtype), positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_rms, inverse", [(False, False), (True, False), (False, True)])
def test_rope_matches_the_layers_ops(interpreter, dtype, unit_rms, inverse):
    from helios.kernels.interleaved_rope import interleaved_rope, interleaved_rope_ref
    from helios.layers.compressed_attention import rotate_tail, unit_rms as layer_unit_rms

    rope, (cos, sin), (table_cos, table_sin), positions = _rope(dtype)
    torch.testing.assert_close(table_cos[positions], cos, atol=0, rtol=0)  # the table holds cos_sin's bits
    torch.testing.assert_close(table_sin[positions], sin, atol=0, rtol=0)
    x = _randn(NUM_TOKENS, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cpu", seed=1) * 3
    eps = 1e-6 if unit_rms else None
    want = layer_unit_rms(x, 1e-6) if unit_rms else x
    want = rotate_tail(want, cos, -sin if inverse else sin)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(interleaved_rope_ref(x, cos, sin, unit_rms_eps=eps, inverse=inverse), want, atol=0,
                               rtol=0)
    for got in (interleaved_rope(x, cos, sin, unit_rms_eps=eps, inverse=inverse),
                interleaved_rope(x, table_cos, table_sin, positions, unit_rms_eps=eps, inverse=inverse)):
        torch.testing.assert_close(got, want, **tol)
        if not unit_rms:  # the values before the rope part pass as they are
            assert torch.equal(got[..., : HEAD_DIM - ROPE_DIM], x[..., : HEAD_DIM - ROPE_DIM])


def test_rope_writes_a_strided_view_and_nothing_else(interpreter):
    """out= a view of one head's columns in a wider row (the layer's kv into its projection): the rest unchanged."""
    from helios.kernels.interleaved_rope import interleaved_rope, interleaved_rope_ref

    _, (cos, sin), _, _ = _rope(torch.float32)
    wide = _randn(NUM_TOKENS, 3 * HEAD_DIM, device="cpu", seed=2)
    before = wide.clone()
    kv = _randn(NUM_TOKENS, 1, HEAD_DIM, device="cpu", seed=3)
    interleaved_rope(kv, cos, sin, out=wide[:, None, HEAD_DIM : 2 * HEAD_DIM])
    torch.testing.assert_close(wide[:, HEAD_DIM : 2 * HEAD_DIM], interleaved_rope_ref(kv, cos, sin)[:, 0],
                               atol=1e-6, rtol=1e-5)
    assert torch.equal(wide[:, :HEAD_DIM], before[:, :HEAD_DIM])
    assert torch.equal(wide[:, 2 * HEAD_DIM :], before[:, 2 * HEAD_DIM :])
