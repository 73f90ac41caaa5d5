"""helios.kernels.qsa_decode (qwen4_exp's QSA decode: block keys pooled, normed and turned from the paged raw index
keys, their scores, the top blocks and the tail, attention over them) against helios.layers.qsa's own Indexer and
masked SDPA, and IndexedAttention on the Triton backend (decode-only steps through the kernels) against its torch
path, in Triton's CPU interpreter.

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_qwen4_exp_cuda.py. Sequences
of different lengths share a batch (fewer blocks than kept, a length on a block edge: an empty tail, no block at
all), a padded graph row (length 0, slot -1) must write nothing and output zeros, and the pages hold random values
everywhere. Two index heads make relu's exact zero scores common: the tie rule (the earlier block) is exercised by
the random cases too, and by a case where every block ties.
"""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import IndexerConfig
from tests.kernels.test_mla_decode import _bind_random, _randn, paged_tables, step_meta

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp2(-inf) and friends

CONFIG = IndexerConfig(num_heads=2, head_dim=16, block_size=4, num_blocks=2)  # the tiny checkpoints' QSA
ROTARY_DIM = 8  # partial: the leading half of each index head turns
SEQ_LENS = (37, 5, 0, 24, 3, 22)  # 9 blocks + tail; 1 block (all kept); padded; 6, no tail; no block; 5 + tail


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _indexer(device, dtype, config=CONFIG, rotary_dim=ROTARY_DIM):  # -> helios.layers.qsa.Indexer
    """An Indexer with random weights (k_norm around 1) on device."""
    from helios.layers.qsa import Indexer
    from helios.layers.rotary import RotaryEmbedding

    indexer = Indexer(8, config, 1e-6, RotaryEmbedding(rotary_dim, 10000.0, device=device))
    _bind_random([indexer], device, dtype, seed=7)
    return indexer


def _scores(indexer, q, index_cache, tables, lens, block_size):
    """qsa_decode.block_scores with the layer's block positions and rotary rows."""
    from helios.kernels import qsa_decode
    from helios.layers.qsa import block_starts

    num_blocks = qsa_decode.block_count(tables.shape[1], index_cache.shape[2], block_size)
    cos, sin = indexer.rotary.cos_sin(block_starts(indexer.rotary, num_blocks, block_size, q.device),
                                      index_cache.dtype)
    return qsa_decode.block_scores(q, index_cache, indexer.k_norm.weight, indexer.k_norm.eps, cos, sin, tables,
                                   lens, block_size)


def blocks_mask(blocks_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:  # [K + 1] -> [S] bool
    owner = torch.arange(seq_len, device=blocks_row.device) // block_size
    return (owner[None, :] == blocks_row[:, None].long()).any(dim=0)


def check_selection(device, dtype, config=CONFIG, seq_lens=SEQ_LENS, page_size=4, tied=False,
                    rotary_dim=ROTARY_DIM):
    """block_scores = the layer's scores (Indexer.block_keys, relu-summed per head; -inf past the complete blocks)
    and, in float32, select_blocks' keys = Indexer.select's mask for the decode query of every sequence, exactly; a
    padded row lists nothing. tied: zero index queries, so every block scores 0: the earliest blocks must win, in
    both. In 16 bits the scores match within 2e-2 only (a block key's float32 mean may round to the other 16-bit
    neighbour), so a near tie could swap two blocks: the choice is held in float32."""
    from helios.kernels.qsa_decode import select_blocks

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    di, b, bs = config.head_dim, len(seq_lens), config.block_size
    exact = dtype == torch.float32
    indexer = _indexer(device, dtype, config, rotary_dim)
    index_cache = _randn(1, num_pages, page_size, di, device=device, dtype=dtype, seed=1)
    q = _randn(b, config.num_heads, di, device=device, dtype=dtype, seed=2) * (0 if tied else 1)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    with torch.inference_mode():
        scores = _scores(indexer, q, index_cache, tables, lens, bs)
    blocks = select_blocks(scores, lens, bs, config.num_blocks)
    assert blocks.shape == (b, config.num_blocks + 1) and blocks.dtype == torch.int32
    for i, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert bool((blocks[i] == -1).all()) and bool((scores[i] == float("-inf")).all()), blocks[i]
            continue
        keys = index_cache[0, tables[i, : -(-seq_len // page_size)].long()].flatten(0, 1)[:seq_len]
        nb = seq_len // bs
        with torch.inference_mode():
            if nb:
                block_keys = indexer.block_keys(keys[: nb * bs].view(nb, bs, di)).float()
                want = torch.relu(q[i].float() @ block_keys.t()).sum(dim=0) / di**0.5
                torch.testing.assert_close(scores[i, :nb], want, atol=1e-5 if exact else 2e-2,
                                           rtol=1e-5 if exact else 2e-2)
            mask = indexer.select(q[i : i + 1], keys, seq_len - 1)[0]
        assert bool((scores[i, nb:] == float("-inf")).all())
        if exact or tied:
            assert torch.equal(blocks_mask(blocks[i], seq_len, bs), mask), (i, blocks[i])
        if tied:  # the first num_blocks complete blocks, and the tail
            assert blocks[i, :-1].tolist() == [k if k < nb else -1 for k in range(config.num_blocks)], blocks[i]
    return indexer, scores, blocks


def check_qsa_decode(device, dtype, num_heads=4, num_kv_heads=2, tol=None, page_size=4, head_dim=16,
                     seq_lens=SEQ_LENS, config=CONFIG, rotary_dim=ROTARY_DIM):
    """The attention over the listed blocks = the layer's masked SDPA (attend_masked under Indexer.select's mask,
    every head alike); the padded row outputs zeros."""
    from helios.kernels.qsa_decode import qsa_decode
    from helios.layers.qsa import attend_masked

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    _, _, blocks = check_selection(device, torch.float32, config, seq_lens, page_size, rotary_dim=rotary_dim)
    kv_cache = _randn(2, num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, seed=3)
    q = _randn(len(seq_lens), num_heads, head_dim, device=device, dtype=dtype, seed=4)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    out = qsa_decode(q, kv_cache, tables, lens, blocks, config.block_size, scale)
    for i, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert torch.count_nonzero(out[i]) == 0
            continue
        pages = tables[i, : -(-seq_len // page_size)].long()
        keys, values = (kv_cache[j, pages].flatten(0, 1)[:seq_len] for j in (0, 1))
        mask = blocks_mask(blocks[i], seq_len, config.block_size)[None, :]
        torch.testing.assert_close(out[i], attend_masked(q[i : i + 1], keys, values, mask, scale)[0], **tol)


# prefill chunks (seq 3 shorter than the kept blocks), a mixed step (torch path), then decode-only steps with a
# padded graph row; lengths cross 4-token pages and blocks (seq 0 completes a block on its last decode step)
LENGTHS = (36, 11, 20, 4)
STEPS = [[(0, 0, 30), (1, 0, 9), (2, 0, 17), (3, 0, 2)], [(1, 9, 10), (0, 30, 32), (2, 17, 18)],
         [(0, 32, 33), (-1, 0, 0), (2, 18, 19), (3, 2, 3)], [(3, 3, 4), (1, 10, 11), (0, 33, 34), (2, 19, 20)],
         [(0, 34, 35)], [(0, 35, 36)]]


def check_layer_decode(device, dtype, num_heads=4, num_kv_heads=2, config=CONFIG, tol=None, page_size=4,
                       tied=False, rope_table=False):
    """IndexedAttention on the Triton backend (decode-only steps through helios.kernels.qsa_decode; every step's q/k
    norms with the rotary, the index queries' and the output gate one launch each) = on the torch backend, step by
    step: outputs and both caches (K/V within rounding, raw index keys exactly); the padded row outputs zeros (no gate
    survives a zero attention output), writes nothing. tied: the index queries' weight rows zero, so every block
    scores 0 and both paths must keep the earliest blocks. rope_table: the rotary tabulated, so the block rows are a
    view of the table (helios.layers.qsa.block_cos_sin)."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.attention import TorchAttentionBackend
    from helios.layers.qsa import IndexedAttention
    from helios.layers.rotary import RotaryEmbedding

    hidden, head_dim = 32, 16
    rotary = RotaryEmbedding(ROTARY_DIM, 10000.0, device=device)
    if rope_table:
        rotary.tabulate(64, dtype)
    layers = [IndexedAttention(hidden, num_heads, num_kv_heads, head_dim, config, 1e-6, rotary, backend=backend)
              for backend in (TorchAttentionBackend(), TritonAttentionBackend())]
    assert [layer.decode_graph_safe for layer in layers] == [False, True]
    _bind_random(layers, device, dtype)
    if tied:
        for layer in layers:
            layer.indexer.qk.weight[: config.num_heads * config.head_dim] = 0
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, hidden, generator=g).to(device, dtype) for n in LENGTHS]
    pages = torch.randperm(40, generator=g).tolist()
    tables = [[pages.pop() for _ in range(-(-n // page_size))] for n in LENGTHS]
    caches = [(_randn(2, 40, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, seed=4),
               _randn(1, 40, page_size, config.head_dim, device=device, dtype=dtype, seed=5)) for _ in layers]
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    for chunks in STEPS:
        real = [c for c in chunks if c[0] >= 0]
        x = torch.cat([xs[seq][a:b] if seq >= 0 else torch.zeros(1, hidden, device=device, dtype=dtype)
                       for seq, a, b in chunks])
        meta, real_meta = (step_meta(tables, c, page_size, device) for c in (chunks, real))
        keep = [seq >= 0 for seq, a, b in chunks for _ in range(max(b - a, 1))]
        rows = torch.tensor([r for r, k in enumerate(keep) if k])
        cos_sin = rotary.cos_sin(meta.positions, dtype)
        with torch.inference_mode():
            got = layers[1](x, cos_sin, caches[1], meta)
            want = layers[0](x[rows], tuple(t[rows] for t in cos_sin), caches[0], real_meta)
        torch.testing.assert_close(got[rows], want, **tol)
        # the raw index keys exactly; K (its norm's statistics summed in the kernel's order) within rounding
        assert torch.equal(caches[1][1], caches[0][1])
        torch.testing.assert_close(caches[1][0], caches[0][0], **tol)
        assert torch.count_nonzero(got[[r for r, k in enumerate(keep) if not k]]) == 0


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


def test_selection_is_the_layers(interpreter):
    check_selection("cpu", torch.float32)


def test_tied_blocks_go_to_the_earlier_one_in_both(interpreter):
    check_selection("cpu", torch.float32, tied=True)


def test_qsa_decode_is_the_layers_masked_attention(interpreter):
    check_qsa_decode("cpu", torch.float32)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
def test_layer_decode_on_the_triton_backend_equals_the_torch_path(interpreter, tied):
    check_layer_decode("cpu", torch.float32, tied=tied)


def test_layer_decode_reads_the_block_rotary_rows_from_the_rope_table(interpreter):
    check_layer_decode("cpu", torch.float32, rope_table=True)


def test_select_breaks_ties_by_the_earlier_block_whatever_the_chunk():
    """Indexer.select (the torch path): a query whose complete blocks all score 0 (zero index queries) keeps the
    first num_blocks of them, alone or inside a chunk with queries of other block counts."""
    indexer = _indexer("cpu", torch.float32)
    keys = _randn(29, CONFIG.head_dim, device="cpu", seed=3)
    q = torch.zeros(29, CONFIG.num_heads, CONFIG.head_dim)
    with torch.inference_mode():
        whole = indexer.select(q, keys, 0)
        alone = indexer.select(q[28:], keys, 28)[0]
    assert torch.equal(whole[28], alone)
    want = torch.zeros(29, dtype=torch.bool)
    want[: CONFIG.num_blocks * CONFIG.block_size] = True
    want[28:] = True  # the tail: position 28 starts block 7
    assert torch.equal(alone, want)


def test_graphs_refuse_ple_layers(interpreter, tmp_path):
    """unsupported_reason on the Triton backend: qwen4_exp without PLE is graphed (tests/kernels/test_sparse_decode
    holds it); the PLE variant is not: PleLayer's conv and n-gram ids read host-side slots and query starts."""
    from ignition.archs import convert
    from ignition.sources.hf import open_hf_dir

    from helios.kernels.backend import TritonAttentionBackend
    from helios.runner.cuda_graphs import unsupported_reason
    from tests.kernels.moe_cases import unbound_model
    from tests.models.qwen4_exp_tiny import build_qwen4_exp

    arch = convert(open_hf_dir(build_qwen4_exp("ple", tmp_path / "ple")), torch.float32)[0]
    reason = unsupported_reason(unbound_model(arch, TritonAttentionBackend()), arch, torch.device("cuda"))
    assert reason.startswith("PLE layers"), reason
