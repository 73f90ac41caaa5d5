"""helios.kernels.sparse_decode's one-sort choice (block_scores with local_blocks: the local blocks boosted and -0.0
made +0.0 in the kernel; top_blocks: the sort) = select_blocks' choice, in Triton's CPU interpreter: the same blocks
of every sequence and index head (select_blocks' -1 slots are top_blocks' blocks past the end, which sparse_decode
reads no key of), ties to the earlier block, and the same attention."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_decode import _randn, paged_tables
from tests.kernels.test_sparse_decode import CONFIG, SEQ_LENS

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


@pytest.mark.parametrize("zero_queries", [False, True], ids=["random", "all-tied"])
def test_boosted_scores_and_one_sort_choose_what_select_blocks_chooses(interpreter, zero_queries):
    from helios.kernels.sparse_decode import block_scores, select_blocks, sparse_decode, top_blocks

    c, page_size = CONFIG, 4
    tables, num_pages = paged_tables(list(SEQ_LENS), page_size, "cpu")
    index_cache = _randn(1, num_pages, page_size, c.head_dim, device="cpu", seed=1)
    q = _randn(len(SEQ_LENS), c.num_heads, c.head_dim, device="cpu", seed=2) * (0 if zero_queries else 1)
    q[0, 0] = -q[0, 0]  # some negative products: -0.0 where a tied query meets them
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    plain = block_scores(q, index_cache, tables, lens, c.block_size)
    boosted = block_scores(q, index_cache, tables, lens, c.block_size, c.local_blocks)
    nb = (lens.long() + c.block_size - 1) // c.block_size
    blocks = torch.arange(plain.shape[-1])
    local = (blocks[None, :] < nb[:, None]) & (blocks[None, :] >= (nb - c.local_blocks)[:, None])
    want_scores = plain.masked_fill(local[:, None, :], float("inf")) + 0.0
    assert torch.equal(boosted, want_scores) and not torch.signbit(boosted[boosted == 0]).any()
    chosen, want = top_blocks(boosted, c.num_blocks), select_blocks(plain, lens, c.block_size, c.num_blocks,
                                                                   c.local_blocks)
    assert chosen.shape == want.shape
    assert torch.equal(torch.where(chosen < nb[:, None, None], chosen, -1).to(torch.int32), want)
    kv_cache = _randn(2, num_pages, page_size, 2, 16, device="cpu", seed=3)
    q_attn = _randn(len(SEQ_LENS), 4, 16, device="cpu", seed=4)
    args = (q_attn, kv_cache, tables, lens)
    torch.testing.assert_close(sparse_decode(*args, chosen, c.block_size, 0.25),
                               sparse_decode(*args, want, c.block_size, 0.25), atol=0, rtol=0)
