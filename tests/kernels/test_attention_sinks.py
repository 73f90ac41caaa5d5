"""Attention sinks (mimo_v2_flash's sliding layers: a learned logit per head in the softmax denominator) in the
paged decode (split-K: the sink belongs to split 0 alone) and prefill kernels vs their torch reference, at qk
head_dim 192 (not a power of two), in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tests.kernels import checks  # noqa: E402


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_sinks(num_splits):
    # 3 splits over 5..70 keys: empty splits of the short sequence; the sink must count once, in split 0
    checks.check_decode("cpu", torch.float32, 4, 4, num_splits=num_splits, sliding_window=20, block_n=16,
                        head_dim=192, sinks=True)


def test_chunked_prefill_with_sinks():
    # a window of 8: late queries of a block see no key of some tiles, the sink keeps their max finite
    checks.check_prefill("cpu", torch.float32, 4, 4, (20, 1, 9), (45, 33, 30), sliding_window=8, block_m=16,
                         block_n=16, head_dim=192, sinks=True)


def test_sinks_change_the_result():
    """A check that cannot pass without sinks: the reference with sinks differs from the one without."""
    from helios.kernels.paged_attention import paged_decode_attention_ref

    c = checks.paged_case([1, 1], [9, 30], 2, 2, 64, 4)
    args = (c.q, c.kv_cache, c.block_tables, c.seq_lens, 0.125)
    plain = paged_decode_attention_ref(*args)
    sunk = paged_decode_attention_ref(*args, sinks=torch.full((4,), 3.0))
    assert (plain - sunk).abs().max() > 0.1
