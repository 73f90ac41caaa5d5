"""helios.kernels.dsa_decode (glm5_next's DSA decode: pool scores over the paged index rows, the top pools and the
tail, absorbed MLA attention over them) against its torch references and helios.layers.dsa's own selection, and
DsaAttention on the Triton backend (decode-only steps through the kernels; a shared layer reusing the pool lists)
against its torch path, in Triton's CPU interpreter.

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_glm5_next_cuda.py.
Sequences of different lengths share a batch (fewer pools than kept, a length on a pool edge: an empty tail), a
padded graph row (length 0, slot -1) must write nothing and output zeros, and the pools hold random values everywhere.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from helios.core.manifest import DsaConfig, MlaConfig
from tests.kernels.test_mla_decode import _bind_random, _randn, paged_tables, step_meta

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp2(-inf) and friends

DSA = DsaConfig(num_heads=4, head_dim=16, pool_size=4, num_pools=3)
# glm5_next's NoPE MLA and a rope part (the kernel's other branch)
NOPE = MlaConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, q_lora_rank=24,
                 softmax_scale=16**-0.5)
ROPE = msgspec.structs.replace(NOPE, qk_rope_head_dim=8)
SEQ_LENS = (37, 5, 0, 24, 1, 22)  # 9 pools + tail; 1 (all kept); padded; 6, no tail; no pool; 5 + tail


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _indexer(config: DsaConfig, pool_bias: torch.Tensor):
    """A DsaIndexer with this pool bias (select reads no other weight)."""
    from helios.layers.dsa import DsaIndexer

    indexer = DsaIndexer(8, 8, config)
    indexer.pool_bias = torch.nn.Parameter(pool_bias, requires_grad=False)
    return indexer


def pools_mask(pools_row: torch.Tensor, seq_len: int, pool_size: int) -> torch.Tensor:  # [K + 1] -> [S] bool
    owner = torch.arange(seq_len, device=pools_row.device) // pool_size
    return (owner[None, :] == pools_row[:, None].long()).any(dim=0)


def check_pool_selection(device, dtype, config=DSA, seq_lens=SEQ_LENS, page_size=4, tied=False):
    """pool_scores = pool_scores_ref (float32 tolerance, -inf past the complete pools) and select_pools' keys = the
    layer's select for the decode query of every sequence, exactly; a padded row lists nothing. tied: zero queries,
    so every pool scores +-0 (relu's zeros, negative head weights): the earlier pools must win, in both."""
    from helios.kernels.dsa_decode import pool_scores, pool_scores_ref, select_pools

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    di, b = config.head_dim, len(seq_lens)
    index_cache = _randn(1, num_pages, page_size, 2 * di, device=device, dtype=dtype, seed=1)
    pool_bias = _randn(config.pool_size, di, device=device, dtype=dtype, seed=2)
    q = _randn(b, config.num_heads, di, device=device, dtype=dtype, seed=3) * (0 if tied else 1)
    weights = _randn(b, config.num_heads, device=device, seed=4) * config.num_heads**-0.5  # float32, some < 0
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scores = pool_scores(q, weights, index_cache, pool_bias, tables, lens)
    torch.testing.assert_close(scores, pool_scores_ref(q, weights, index_cache, pool_bias, tables, lens),
                               atol=1e-5, rtol=1e-5)
    pools = select_pools(scores, lens, config.pool_size, config.num_pools)
    indexer = _indexer(config, pool_bias)
    for i, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert bool((pools[i] == -1).all()), pools[i]
            continue
        rows = index_cache[0, tables[i, : -(-seq_len // page_size)].long()].flatten(0, 1)[:seq_len]
        want = indexer.select(q[i : i + 1], weights[i : i + 1], rows)[0]
        assert torch.equal(pools_mask(pools[i], seq_len, config.pool_size), want), (i, pools[i])
        if tied and seq_len // config.pool_size > config.num_pools:  # the earliest pools, then the tail
            assert pools[i].tolist() == [*range(config.num_pools), seq_len // config.pool_size]
    return pools


def check_sparse_mla_decode(device, dtype, config=NOPE, num_heads=20, num_splits=1, tol=None, page_size=4):
    """The absorbed attention over the listed pools = sparse_mla_decode_ref and = the layer's torch form (mla_absorbed
    under select's mask as its bias); 20 heads: two head blocks, the second partly masked; the padded row is zeros."""
    from helios.kernels.dsa_decode import sparse_mla_decode, sparse_mla_decode_ref
    from helios.layers.mla import absorb_query, expand_output, mla_absorbed

    tables, num_pages = paged_tables(list(SEQ_LENS), page_size, device)
    pools = check_pool_selection(device, torch.float32, page_size=page_size)  # 16-bit pool keys: rounding ties
    cache = _randn(1, num_pages, page_size, config.cache_dim, device=device, dtype=dtype, seed=5)
    q = _randn(len(SEQ_LENS), num_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, device=device,
               dtype=dtype, seed=6)
    kv_b = _randn(num_heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank, device=device,
                  dtype=dtype, seed=7, scale=config.kv_lora_rank**-0.5)
    q_abs = absorb_query(q, kv_b, config)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    rank, pool_size, scale = config.kv_lora_rank, DSA.pool_size, config.softmax_scale
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    out = sparse_mla_decode(q_abs, cache, tables, lens, pools, pool_size, rank, scale, num_splits)
    torch.testing.assert_close(out, sparse_mla_decode_ref(q_abs, cache, tables, lens, pools, pool_size, rank, scale),
                               **tol)
    for i, seq_len in enumerate(SEQ_LENS):
        if seq_len == 0:
            assert torch.count_nonzero(out[i]) == 0
            continue
        blocks = tables[i : i + 1, : -(-seq_len // page_size)].long()
        keep = torch.zeros(blocks.shape[1] * page_size, dtype=torch.bool, device=device)
        keep[:seq_len] = pools_mask(pools[i], seq_len, pool_size)
        bias = torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf"))[None, None]
        torch.testing.assert_close(expand_output(out[i : i + 1], kv_b, config),
                                   mla_absorbed(q[i : i + 1], cache, blocks, bias, kv_b, config), **tol)


# prefill chunks, a mixed step (torch path), then decode-only steps with a padded graph row; seq 3 stays within the
# kept pools, seq 0 ends on a pool edge (an empty tail)
LENGTHS = (32, 11, 20, 4)
STEPS = [[(0, 0, 28), (1, 0, 9), (2, 0, 17), (3, 0, 2)], [(1, 9, 10), (0, 28, 30), (2, 17, 18)],
         [(0, 30, 31), (-1, 0, 0), (2, 18, 19), (3, 2, 3)], [(3, 3, 4), (1, 10, 11), (0, 31, 32), (2, 19, 20)]]


def check_layer_decode(device, dtype, config=NOPE, tol=None, page_size=4, num_heads=4):
    """A full DsaAttention then a shared one (the pool lists passed on), on the Triton backend (decode-only steps
    through helios.kernels.dsa_decode) = on the torch path, step by step: outputs and every cache (latents and index
    rows, within their norms' rounding); the padded row outputs zeros and writes nothing."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.dsa import DsaAttention

    hidden = 32
    stacks = [[DsaAttention(hidden, num_heads, config, DSA, shared, backend=backend) for shared in (False, True)]
              for backend in (None, TritonAttentionBackend())]
    assert [layer.decode_graph_safe for layer in stacks[0] + stacks[1]] == [False, False, True, True]
    for pair in zip(*stacks):
        _bind_random(list(pair), device, dtype)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, hidden, generator=g).to(device, dtype) for n in LENGTHS]
    pages = torch.randperm(40, generator=g).tolist()
    tables = [[pages.pop() for _ in range(-(-n // page_size))] for n in LENGTHS]
    caches = [[(_randn(1, 40, page_size, config.cache_dim, device=device, dtype=dtype, seed=4 + 2 * j),
                _randn(1, 40, page_size, DSA.cache_dim, device=device, dtype=dtype, seed=5 + 2 * j)) for j in (0, 1)]
              for _ in stacks]
    # the latent's RMSNorm and the index key's LayerNorm run in the Triton path's cache writes: their float32
    # statistics sum in another order than torch's, so the rows agree within a few of the dtype's ulps (or `tol`)
    eps = torch.finfo(dtype).eps
    cache_tol = tol or dict(atol=4 * eps, rtol=4 * eps)
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    for chunks in STEPS:
        is_real = [seq >= 0 for seq, a, b in chunks for _ in range(max(b - a, 1))]
        x = torch.cat([xs[seq][a:b] if seq >= 0 else torch.zeros(1, hidden, device=device, dtype=dtype)
                       for seq, a, b in chunks])
        meta = step_meta(tables, chunks, page_size, device)
        real_meta = step_meta(tables, [c for c in chunks if c[0] >= 0], page_size, device)
        rows = torch.tensor([r for r, keep in enumerate(is_real) if keep], device=device)
        with torch.inference_mode():
            outs = []
            for stack, pair, m, h in ((stacks[0], caches[0], real_meta, x[rows]), (stacks[1], caches[1], meta, x)):
                y, selection = stack[0](h, pair[0], m)
                outs.append((y, stack[1](h, pair[1], m, selection)[0]))
        for want, got in zip(outs[0], outs[1]):
            torch.testing.assert_close(got[rows], want, **tol)
            assert torch.count_nonzero(got[[r for r, keep in enumerate(is_real) if not keep]]) == 0
        for ours, ref in zip(caches[1], caches[0]):
            for a, b in zip(ours, ref):
                torch.testing.assert_close(a, b, **cache_tol)


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


def test_selection_is_the_layers(interpreter):
    check_pool_selection("cpu", torch.float32)


def test_tied_pools_go_to_the_earlier_one_in_both(interpreter):
    check_pool_selection("cpu", torch.float32, tied=True)


@pytest.mark.parametrize("config, num_splits", [(NOPE, 1), (ROPE, 2)],
                         ids=["nope-1split", "rope-2splits"])
def test_sparse_mla_decode_matches_the_reference(interpreter, config, num_splits):
    check_sparse_mla_decode("cpu", torch.float32, config, num_splits=num_splits)


def test_layer_decode_on_the_triton_backend_equals_the_torch_path(interpreter):
    check_layer_decode("cpu", torch.float32)
