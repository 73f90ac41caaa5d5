"""The CPU batched decode attention (helios.layers.attention.decode_attention) against a per-sequence eager
reference: ragged lengths, scattered pages, sliding windows shorter and longer than a page, GQA groups; float32,
and bfloat16 (the CPU's bf16 cores: computed in float32, the output rounded once)."""

from __future__ import annotations

import pytest
import torch

from helios.layers.attention import AttentionMetadata, TorchAttentionBackend

PAGE, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, NUM_PAGES = 4, 2, 6, 8, 48


def reference(q, kv_cache, block_ids, seq_len, scale, window):  # q [Nq, D] -> [Nq, D], one sequence
    keys = kv_cache[0, block_ids].flatten(0, 1)[:seq_len]  # [S, Nkv, D]
    values = kv_cache[1, block_ids].flatten(0, 1)[:seq_len]
    group = NUM_HEADS // NUM_KV_HEADS
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # [S, Nq, D]
    scores = torch.einsum("hd,shd->hs", q, keys) * scale
    if window is not None:
        scores[:, : max(0, seq_len - window)] = float("-inf")
    return torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 2, 4, 7])
def test_decode_matches_per_sequence_reference(window, dtype):
    g = torch.Generator().manual_seed(0)
    seq_lens = [1, 5, 9, 16, 3, 12]
    pages = torch.randperm(NUM_PAGES, generator=g).tolist()
    tables, width = [], 16
    for n in seq_lens:
        tables.append([pages.pop() for _ in range(-(-n // PAGE))])
    kv_cache = torch.randn(2, NUM_PAGES, PAGE, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(len(seq_lens), NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(len(seq_lens), NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    slots = [t[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for t, n in zip(tables, seq_lens)]
    meta = AttentionMetadata(
        positions=torch.tensor([n - 1 for n in seq_lens]),
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_start_loc_cpu=list(range(len(seq_lens) + 1)),
        seq_lens_cpu=seq_lens,
    )
    scale = HEAD_DIM**-0.5
    out = TorchAttentionBackend().forward(q, k, v, kv_cache, meta, scale, window, None)
    flat = kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat[0, slots], k, atol=0, rtol=0)  # this step's K/V were written first
    torch.testing.assert_close(flat[1, slots], v, atol=0, rtol=0)
    assert out.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of outputs below 2 in magnitude
    for i, (t, n) in enumerate(zip(tables, seq_lens)):
        want = reference(q[i].float(), kv_cache.float(), t, n, scale, window)
        torch.testing.assert_close(out[i].float(), want, atol=atol, rtol=0)
    # a second layer of the same step reuses the derived gather and mask
    assert ("decode", PAGE, window) in meta.derived
