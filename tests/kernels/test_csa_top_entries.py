"""helios.kernels.csa_decode's one-sort choice on the decode path (index_scores taking the projection's unscaled head
weights with weight_scale, and writing -0.0 as +0.0; top_entries: the sort) = select_entries' choice over the scaled
weights, in Triton's CPU interpreter: the same scores bit for bit, the same entries (select_entries' -1 slots are
top_entries' entries past the complete windows, which compressed_decode reads no key of), ties to the earlier entry,
and the same attention."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_csa_decode import CONFIG, HEAD_DIM, NUM_HEADS, SEQ_LENS, _entries
from tests.kernels.test_mla_decode import _randn, paged_tables

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


@pytest.mark.parametrize("tied", [False, True], ids=["random", "all-tied"])
def test_one_sort_chooses_what_select_entries_chooses(interpreter, tied):
    from helios.kernels.csa_decode import compressed_decode, index_scores, select_entries, top_entries

    c, b, page_size = CONFIG, len(SEQ_LENS), 4
    tables, num_pages = paged_tables(list(SEQ_LENS), page_size, "cpu")
    entries, rate, rows = _entries("csa", page_size, num_pages, "cpu", torch.float32, seed=1)
    q = _randn(b, c.index_num_heads, c.index_head_dim, device="cpu", seed=3) * (0 if tied else 1)
    raw_weights = _randn(b, 3 * c.index_num_heads, device="cpu", seed=4)[:, 1 : 1 + c.index_num_heads]  # strided
    scale = c.index_num_heads**-0.5
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    args = (entries, tables, lens, rate, rows, HEAD_DIM)
    scores = index_scores(q, raw_weights, *args, weight_scale=scale)
    assert torch.equal(scores, index_scores(q, raw_weights.float() * scale, *args))
    assert not torch.signbit(scores[scores == 0]).any()
    chosen, want = top_entries(scores, c.index_topk), select_entries(scores, lens, rate, c.index_topk)
    num_entries = lens.long()[:, None] // rate
    assert torch.equal(torch.where(chosen < num_entries, chosen, -1).to(torch.int32), want)
    window_tables, num_window_pages = paged_tables(list(SEQ_LENS), page_size, "cpu", seed=7)
    row_pages = _randn(1, num_window_pages, page_size, c.raw_dim("csa", HEAD_DIM), device="cpu", seed=5)
    attend = (_randn(b, NUM_HEADS, HEAD_DIM, device="cpu", seed=6), row_pages, entries, window_tables, tables, lens,
              _randn(NUM_HEADS, device="cpu", seed=8), c.window, rate, rows)
    torch.testing.assert_close(compressed_decode(*attend, chosen), compressed_decode(*attend, want), atol=0, rtol=0)
