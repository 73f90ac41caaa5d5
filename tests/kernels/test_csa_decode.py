"""helios.kernels.csa_decode (deepseek_v4's compressed-attention decode: CSA's index scores over the paged entries,
the top index_topk, the sink attention over the window and the chosen / all entries) against its torch references
and helios.layers.compressed_attention's own selection and attention, and CompressedAttention on the Triton backend
(decode-only steps through the kernels, entries written on the device where a token completes a window) against its
torch path, in Triton's CPU interpreter.

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_deepseek_v4_cuda.py.
Sequences of different lengths share a batch (before the first entry, fewer entries than kept, many), a padded graph
row (length 0, slot -1) writes nothing and outputs zeros, and the pages hold random values everywhere.
"""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import CompressedAttentionConfig
from tests.kernels.test_mla_decode import _bind_random, _randn, paged_tables, step_meta

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp2(-inf) and friends

CONFIG = CompressedAttentionConfig(
    layer_kinds=["sliding", "csa", "hca"], window=8, q_lora_rank=16, rope_dim=8, o_groups=2, o_lora_rank=8,
    csa_rate=4, hca_rate=8, index_num_heads=4, index_head_dim=16, index_topk=3, compress_rope_theta=160000.0)
HEAD_DIM, NUM_HEADS = 32, 20  # 20 heads: two head blocks of 16, the second partly masked
SEQ_LENS = (37, 3, 0, 24, 1, 22, 13)  # 9 CSA entries; none yet; padded; 6; none; 5; 3 (= index_topk)


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _entries(kind: str, page_size: int, num_pages: int, device, dtype, seed: int):
    """(entry pages [1, P, page, e], rate, entry rows) of a layer of this kind."""
    c = CONFIG
    e = c.entry_row_dim(kind, HEAD_DIM, page_size)
    rate = c.csa_rate if kind == "csa" else c.hca_rate
    pages = _randn(1, num_pages, page_size, e, device=device, dtype=dtype, seed=seed)
    return pages, rate, c.entry_rows(kind, page_size)


def check_selection(device, dtype, seq_lens=SEQ_LENS, page_size=4, tied=False):
    """index_scores = index_scores_ref (float32 tolerance, -inf past the complete windows) and select_entries' set =
    LightningIndexer.select's for the decode query of every sequence, exactly; a padded row lists nothing. tied: zero
    queries, so every entry scores +-0: the earliest entries win, in both."""
    from helios.kernels.csa_decode import entry_values, index_scores, index_scores_ref, select_entries
    from helios.layers.compressed_attention import LightningIndexer

    c, b = CONFIG, len(seq_lens)
    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    entries, rate, rows = _entries("csa", page_size, num_pages, device, dtype, seed=1)
    q = _randn(b, c.index_num_heads, c.index_head_dim, device=device, dtype=dtype, seed=3) * (0 if tied else 1)
    weights = _randn(b, c.index_num_heads, device=device, seed=4) * c.index_num_heads**-0.5  # some < 0
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scores = index_scores(q, weights, entries, tables, lens, rate, rows, HEAD_DIM)
    torch.testing.assert_close(scores, index_scores_ref(q, weights, entries, tables, lens, rate, rows, HEAD_DIM),
                               atol=1e-5, rtol=1e-5)
    chosen = select_entries(scores, lens, rate, c.index_topk)
    indexer = LightningIndexer(c, 1e-6)
    for i, seq_len in enumerate(seq_lens):
        n = seq_len // rate
        got = sorted(j for j in chosen[i].tolist() if j >= 0)
        if n == 0:
            assert got == [], (i, chosen[i])
            continue
        keys = entry_values(entries, tables, seq_len, i, rate, rows)[None, :, HEAD_DIM : HEAD_DIM + c.index_head_dim]
        visible = torch.ones(1, 1, n, dtype=torch.bool, device=device)
        want = indexer.select(q[i][None, None], weights[i][None, None], keys, visible)[0, 0]
        assert got == want.nonzero().flatten().tolist(), (i, got)
        if tied:
            assert got == list(range(min(n, c.index_topk)))
    return chosen


def check_attention(device, dtype, kind: str, num_splits=1, page_size=4, tol=None):
    """compressed_decode = compressed_decode_ref and = the layer's attend_with_sinks over the same keys (the window's,
    then the chosen / all complete entries); the padded row is zeros. The rows live in pages of their own (a window
    group's table), the entries in group 0's."""
    from helios.kernels.csa_decode import compressed_decode, compressed_decode_ref, entry_values
    from helios.layers.compressed_attention import attend_with_sinks

    c = CONFIG
    tables, num_pages = paged_tables(list(SEQ_LENS), page_size, device)
    window_tables, num_window_pages = paged_tables(list(SEQ_LENS), page_size, device, seed=7)
    rows = _randn(1, num_window_pages, page_size, c.raw_dim(kind, HEAD_DIM), device=device, dtype=dtype, seed=5)
    entries, rate, r = _entries(kind, page_size, num_pages, device, dtype, seed=1) if kind != "sliding" else (
        rows, 0, 0)
    chosen = check_selection(device, torch.float32, page_size=page_size) if kind == "csa" else None
    q = _randn(len(SEQ_LENS), NUM_HEADS, HEAD_DIM, device=device, dtype=dtype, seed=6)
    sinks = _randn(NUM_HEADS, device=device, seed=8)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    args = (q, rows, entries, window_tables, tables, lens, sinks, c.window, rate, r, chosen)
    out = compressed_decode(*args, num_splits=num_splits)
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, compressed_decode_ref(*args), **tol)
    for i, seq_len in enumerate(SEQ_LENS):
        if seq_len == 0:
            assert torch.count_nonzero(out[i]) == 0
            continue
        pos = torch.arange(max(0, seq_len - c.window), seq_len, device=device)
        keys = [rows[0, window_tables[i].long()[pos // page_size], pos % page_size, :HEAD_DIM]]
        if rate:
            compressed = entry_values(entries, tables, seq_len, i, rate, r)[:, :HEAD_DIM]
            keys.append(compressed if chosen is None else compressed[[j for j in chosen[i].tolist() if j >= 0]])
        keys = torch.cat(keys)
        mask = torch.ones(1, 1, keys.shape[0], dtype=torch.bool, device=device)
        want = attend_with_sinks(q[i][None, None], keys[None], mask, sinks)[0, 0]
        torch.testing.assert_close(out[i], want, **tol)


# sequence 0 prefills 12 then 2, sequence 1 1 then 1 (its decode starts before its first entry, completes CSA's
# window 0 with no leading half, then HCA's), sequence 2 6 then 1; then decode-only steps with a padded graph row
STEPS = [[(0, 0, 12), (1, 0, 1), (2, 0, 6)], [(0, 12, 14), (1, 1, 2), (2, 6, 7)]]
STEPS += [[(0, 14 + t, 15 + t), (-1, 0, 0), (1, 2 + t, 3 + t), (2, 7 + t, 8 + t)] for t in range(7)]
LENGTHS = (24, 12, 17)


def check_layer_decode(device, dtype, tol=None, page_size=4, hidden=32, num_heads=4):
    """A sliding, a CSA and an HCA CompressedAttention on the Triton backend (decode-only steps through
    helios.kernels.csa_decode) = on the torch path, step by step over windows that complete on decode steps: outputs
    and both caches (rows, entries); the padded row outputs zeros and writes nothing."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.compressed_attention import CompressedAttention, InterleavedRope

    c = CONFIG
    stacks = [[CompressedAttention(hidden, num_heads, HEAD_DIM, kind, c, 1e-6, backend=backend)
               for kind in c.layer_kinds] for backend in (None, TritonAttentionBackend())]
    assert [layer.decode_graph_safe for layer in stacks[0] + stacks[1]] == [False] * 3 + [True] * 3
    for pair in zip(*stacks):
        _bind_random(list(pair), device, dtype)
    rope = InterleavedRope(c.rope_dim, 10000.0, None, 512, device)
    compress_rope = InterleavedRope(c.rope_dim, c.compress_rope_theta, None, 512, device)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, hidden, generator=g).to(device, dtype) for n in LENGTHS]
    pages = torch.randperm(40, generator=g).tolist()
    tables = [[pages.pop() for _ in range(-(-n // page_size))] for n in LENGTHS]
    caches = [[(_randn(1, 40, page_size, c.raw_dim(kind, HEAD_DIM), device=device, dtype=dtype, seed=4 + j),
                _randn(1, 40, page_size, c.entry_row_dim(kind, HEAD_DIM, page_size), device=device, dtype=dtype,
                       seed=9 + j)) for j, kind in enumerate(c.layer_kinds)] for _ in stacks]
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    lengths = [0] * len(LENGTHS)
    for chunks in STEPS:
        is_real = [seq >= 0 for seq, a, b in chunks for _ in range(max(b - a, 1))]
        real = [r for r, keep in enumerate(is_real) if keep]
        x = torch.cat([xs[seq][a:b] if seq >= 0 else torch.zeros(1, hidden, device=device, dtype=dtype)
                       for seq, a, b in chunks])
        for seq, _, end in chunks:
            lengths[seq] = end if seq >= 0 else lengths[seq]
        # each table as long as its sequence needs now (as the runner's): nothing may read past it
        now = [t[: max(1, -(-n // page_size))] for t, n in zip(tables, lengths)]
        meta = step_meta(now, chunks, page_size, device)
        real_meta = step_meta(now, [ch for ch in chunks if ch[0] >= 0], page_size, device)
        with torch.inference_mode():
            for ref, ours, ref_cache, our_cache in zip(*stacks, *caches):
                want = ref(x[real], ref_cache, real_meta, rope, compress_rope)
                got = ours(x, our_cache, meta, rope, compress_rope)
                torch.testing.assert_close(got[real], want, **tol)
                assert torch.count_nonzero(got[[r for r, keep in enumerate(is_real) if not keep]]) == 0
                for a, b in zip(our_cache, ref_cache):
                    torch.testing.assert_close(a, b, **tol)


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


def test_selection_is_the_layers(interpreter):
    check_selection("cpu", torch.float32)
    check_selection("cpu", torch.float32, seq_lens=(150, 3, 70))  # several score tiles; tiles past a length skip


def test_tied_entries_go_to_the_earlier_one_in_both(interpreter):
    check_selection("cpu", torch.float32, tied=True)


@pytest.mark.parametrize("kind, num_splits", [("csa", 1), ("csa", 2), ("hca", 3), ("sliding", 1)])
def test_compressed_decode_matches_the_references(interpreter, kind, num_splits):
    check_attention("cpu", torch.float32, kind, num_splits)


def test_layer_decode_on_the_triton_backend_equals_the_torch_path(interpreter):
    check_layer_decode("cpu", torch.float32)


def test_splits_come_from_the_config_alone():
    from helios.kernels.csa_decode import compressed_num_splits

    assert compressed_num_splits(3, 8) == 1
    assert compressed_num_splits(512, 128) == 2  # V4-Flash's CSA: 640 keys
    assert compressed_num_splits(None, 128) == 4  # HCA: every entry, a count that grows
