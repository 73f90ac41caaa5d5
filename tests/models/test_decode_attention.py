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
    assert ("decode", PAGE, window, None) in meta.derived


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4])
def test_mixed_step_decode_rows_equal_decode_only(window, dtype):
    """In a mixed step (prompt chunks beside decode rows), each decode row gives the bits a decode-only step gives
    it, and the prompt chunks still equal the per-sequence reference (query i sees keys up to its position)."""
    g = torch.Generator().manual_seed(1)
    seq_lens, num_queries = [5, 9, 16, 3, 12], [1, 4, 1, 3, 1]  # rows 0, 2, 4 decode; 1 and 3 are prompt chunks
    pages = torch.randperm(NUM_PAGES, generator=g).tolist()
    tables = [[pages.pop() for _ in range(-(-n // PAGE))] for n in seq_lens]
    block_tables = torch.zeros(len(seq_lens), 16, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    kv_cache = torch.randn(2, NUM_PAGES, PAGE, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    positions = [p for n, m in zip(seq_lens, num_queries) for p in range(n - m, n)]
    slots = [t[p // PAGE] * PAGE + p % PAGE for t, n, m in zip(tables, seq_lens, num_queries) for p in range(n - m, n)]
    qsl = [0]
    for m in num_queries:
        qsl.append(qsl[-1] + m)
    total = qsl[-1]
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)

    def meta_of(rows, starts):
        pos = [positions[qsl[i] + j] for i in rows for j in range(starts[i])]
        sl = [slots[qsl[i] + j] for i in rows for j in range(starts[i])]
        loc = [0]
        for i in rows:
            loc.append(loc[-1] + starts[i])
        return AttentionMetadata(
            positions=torch.tensor(pos), slot_mapping=torch.tensor(sl),
            query_start_loc=torch.tensor(loc, dtype=torch.int32),
            seq_lens=torch.tensor([seq_lens[i] for i in rows], dtype=torch.int32),
            block_tables=block_tables[list(rows)], query_start_loc_cpu=loc,
            seq_lens_cpu=[seq_lens[i] for i in rows])

    scale = HEAD_DIM**-0.5
    mixed = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta_of(range(5), num_queries), scale,
                                            window, None)
    decode = [0, 2, 4]
    index = torch.tensor([qsl[i] for i in decode])
    alone = TorchAttentionBackend().forward(q[index], k[index], v[index], kv_cache.clone(),
                                            meta_of(decode, num_queries), scale, window, None)
    assert torch.equal(mixed[index], alone)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    for i in (1, 3):
        for j in range(num_queries[i]):
            n = seq_lens[i] - num_queries[i] + j + 1  # keys this query sees
            written = kv_cache.clone()
            flat = written.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
            flat[0, slots], flat[1, slots] = k, v
            want = reference(q[qsl[i] + j].float(), written.float(), tables[i], n, scale, window)
            torch.testing.assert_close(mixed[qsl[i] + j].float(), want, atol=atol, rtol=0)
