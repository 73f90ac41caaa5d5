"""The 16-bit CPU decode attention (helios.layers.attention._decode_attention_16bit, SDPA's flash kernel on the
gathered pages): a row's bits do not depend on what shares its step, how much padding its gather has (key counts
on both sides of the kernel's 512-key blocks, page sizes that are not a multiple of 16) or the thread count, and
its values stay within the bf16 rounding of a float64 reference."""

from __future__ import annotations

import pytest
import torch

from helios.layers.attention import AttentionMetadata, decode_attention, decode_layout

NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 3, 9, 64


def step_meta(seq_lens: list[int], tables: list[list[int]], width: int) -> AttentionMetadata:
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    return AttentionMetadata(
        positions=torch.tensor([n - 1 for n in seq_lens]), slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        query_start_loc_cpu=list(range(len(seq_lens) + 1)), seq_lens_cpu=seq_lens)


def attend(q, kv_cache, seq_lens, tables, width, window=None):  # [B, Nq, D]
    blocks, bias = decode_layout(step_meta(seq_lens, tables, width), kv_cache.shape[2], window)
    return decode_attention(q, kv_cache, blocks, bias, HEAD_DIM**-0.5)


def random_step(page_size: int, seq_lens: list[int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    pages = torch.randperm(num_pages, generator=g).tolist()
    tables = [[pages.pop() for _ in range(-(-n // page_size))] for n in seq_lens]
    kv_cache = torch.randn(2, num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    q = (2 * torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=g)).to(dtype)
    return q, kv_cache, tables


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [16, 4, 6])
def test_a_row_gives_the_same_bits_alone_batched_and_padded(page_size, dtype):
    """Row 0 alone (its own gather, under 512 keys, not a multiple of 16 for pages of 4 and 6), then beside rows
    whose gathers are longer (one block of 512 keys, two blocks, a wider table): the same bits each time."""
    seq_lens = [566, 301, 1290, 17, 700]
    q, kv_cache, tables = random_step(page_size, seq_lens, dtype, seed=page_size)
    width = max(len(t) for t in tables) + 5
    alone = attend(q[:1], kv_cache, seq_lens[:1], tables[:1], width)
    for rows in ([0, 3], [0, 1], [0, 4], [0, 2], [0, 1, 2, 3, 4]):
        batched = attend(q[rows], kv_cache, [seq_lens[i] for i in rows], [tables[i] for i in rows], width)
        assert torch.equal(batched[0], alone[0]), rows
    every = attend(q, kv_cache, seq_lens, tables, width)
    for i in range(1, len(seq_lens)):  # every row of the full step equals that row alone
        assert torch.equal(every[i], attend(q[i : i + 1], kv_cache, seq_lens[i : i + 1], tables[i : i + 1], width)[0])


def test_sliding_window_rows_are_batch_invariant():
    seq_lens = [200, 45, 900]
    q, kv_cache, tables = random_step(4, seq_lens, torch.bfloat16, seed=3)
    width = max(len(t) for t in tables)
    every = attend(q, kv_cache, seq_lens, tables, width, window=37)
    for i in range(len(seq_lens)):
        assert torch.equal(every[i], attend(q[i : i + 1], kv_cache, seq_lens[i : i + 1], tables[i : i + 1], width,
                                            window=37)[0])


def test_same_bits_at_one_and_two_threads():
    seq_lens = [140, 151, 9, 600, 133, 147, 1030, 142]
    q, kv_cache, tables = random_step(16, seq_lens, torch.bfloat16, seed=5)
    width = max(len(t) for t in tables)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(q, kv_cache, seq_lens, tables, width)
        torch.set_num_threads(2)
        two = attend(q, kv_cache, seq_lens, tables, width)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


@pytest.mark.parametrize("window", [None, 100])
def test_close_to_a_float64_reference(window):
    """Within bf16 rounding of exact attention (the probabilities meet V in bf16, the output is rounded once): the
    same bound the float32 computation met (max error 0.008 on |outputs| up to 3.6 at these sizes)."""
    seq_lens = [1, 37, 150, 511, 513, 1100]
    q, kv_cache, tables = random_step(16, seq_lens, torch.bfloat16, seed=7)
    out = attend(q, kv_cache, seq_lens, tables, max(len(t) for t in tables), window=window)
    group = NUM_HEADS // NUM_KV_HEADS
    for i, (t, n) in enumerate(zip(tables, seq_lens)):
        kv = kv_cache[:, t].flatten(1, 2)[:, :n].double()  # [2, S, Nkv, D]
        start = 0 if window is None else max(0, n - window)
        keys = kv[0, start:].repeat_interleave(group, dim=1)  # [S, Nq, D]
        values = kv[1, start:].repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,shd->hs", q[i].double(), keys) * HEAD_DIM**-0.5, dim=-1)
        want = torch.einsum("hs,shd->hd", probs, values)
        torch.testing.assert_close(out[i].double(), want, atol=2e-3, rtol=2**-7)
