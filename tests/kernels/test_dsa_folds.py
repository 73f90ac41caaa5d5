"""The launches DsaAttention's decode step folds its torch tails into (helios.kernels.dsa_decode): write_index_rows =
the indexer's LayerNorm, cat and row write; pool_scores on the raw head weights with weight_scale = on the layer's
scaled float32 ones, bit for bit, and with write_index_rows' work in the same launch = the two launches;
sparse_mla_decode_absorbed = the layer's absorb_query, sparse_mla_decode and expand_output (and its latent write =
write_latent of the normed latent). In Triton's CPU interpreter, float32 and bfloat16 (the attention float32 only);
the check_* functions are shared with tests/gpu/test_dsa_folds_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_dsa_decode import DSA, NOPE, ROPE, SEQ_LENS, check_pool_selection
from tests.kernels.test_mla_decode import _randn, paged_tables

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp2(-inf) and friends

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _ulps(dtype: torch.dtype, n: int = 1) -> dict:
    """A tolerance of n of the dtype's ulps at values near 1 (a LayerNorm's statistics summed in another order)."""
    eps = torch.finfo(dtype).eps
    return dict(atol=n * eps, rtol=n * eps)


def check_write_index_rows(device, dtype, num_tokens=5, page_size=4, tol=None):
    """write_index_rows = write_index_rows_ref (DsaIndexer.project's rows written as the layer wrote them) from the
    in_proj output's strided key and gate columns; a padded row (slot -1) writes nothing; the other slots stay."""
    from helios.kernels.dsa_decode import write_index_rows, write_index_rows_ref

    di, ni = DSA.head_dim, DSA.num_heads
    proj = _randn(num_tokens, 2 * di + ni, device=device, dtype=dtype, seed=1) * 3 + 0.5
    weight = _randn(di, device=device, dtype=dtype, seed=2)
    bias = _randn(di, device=device, dtype=dtype, seed=3)
    slots = torch.tensor([9, 2, -1, 17, 4][:num_tokens], dtype=torch.int64, device=device)
    ours = _randn(1, 6, page_size, 2 * di, device=device, dtype=dtype, seed=4)
    ref = ours.clone()
    write_index_rows(ours, proj, weight, bias, DSA.key_norm_eps, slots)
    write_index_rows_ref(ref, proj, weight, bias, DSA.key_norm_eps, slots)
    torch.testing.assert_close(ours, ref, **(tol or _ulps(dtype, 2)))
    flat_ours, flat_ref = ours.view(-1, 2 * di), ref.view(-1, 2 * di)
    untouched = torch.ones(flat_ours.shape[0], dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat_ours[untouched], flat_ref[untouched])
    assert torch.equal(flat_ours[slots[slots >= 0], di:], flat_ref[slots[slots >= 0], di:])  # the gates: copies


def check_raw_weights(device, dtype, page_size=4):
    """pool_scores on the raw head weights (a strided slice of in_proj's rows, in the model's dtype) with
    weight_scale = pool_scores on DsaIndexer.project's weights.float() * Ni^-0.5, exactly."""
    from helios.kernels.dsa_decode import pool_scores

    tables, num_pages = paged_tables(list(SEQ_LENS), page_size, device)
    di, ni, b = DSA.head_dim, DSA.num_heads, len(SEQ_LENS)
    index_cache = _randn(1, num_pages, page_size, 2 * di, device=device, dtype=dtype, seed=1)
    pool_bias = _randn(DSA.pool_size, di, device=device, dtype=dtype, seed=2)
    q = _randn(b, ni, di, device=device, dtype=dtype, seed=3)
    proj = _randn(b, 2 * di + ni, device=device, dtype=dtype, seed=4)
    raw = proj[:, 2 * di :]
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    want = pool_scores(q, raw.float() * ni**-0.5, index_cache, pool_bias, tables, lens)
    got = pool_scores(q, raw, index_cache, pool_bias, tables, lens, weight_scale=ni**-0.5)
    assert torch.equal(got, want)


def check_scores_with_write(device, dtype, seq_lens=SEQ_LENS, page_size=4):
    """pool_scores with `write` (the decode token's index row computed and written in the launch) = write_index_rows
    then pool_scores, scores and cache exactly: a token that completes a pool (24) is scored from registers as from
    the cache, a padded row (length 0, slot -1) writes nothing; also a table narrower than a pool (no score column,
    the row still written)."""
    from helios.kernels.dsa_decode import IndexWrite, pool_scores, write_index_rows

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    di, ni, b = DSA.head_dim, DSA.num_heads, len(seq_lens)
    index_cache = _randn(1, num_pages, page_size, 2 * di, device=device, dtype=dtype, seed=1)
    pool_bias = _randn(DSA.pool_size, di, device=device, dtype=dtype, seed=2)
    q = _randn(b, ni, di, device=device, dtype=dtype, seed=3)
    proj = _randn(b, 2 * di + ni, device=device, dtype=dtype, seed=4) * 2
    norm_w = _randn(di, device=device, dtype=dtype, seed=5)
    norm_b = _randn(di, device=device, dtype=dtype, seed=6)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    slots = torch.tensor([int(tables[i, (n - 1) // page_size]) * page_size + (n - 1) % page_size if n else -1
                          for i, n in enumerate(seq_lens)], dtype=torch.int64, device=device)
    raw, eps = proj[:, 2 * di :], DSA.key_norm_eps
    for table in (tables, tables[:, :1]):  # the second: one page, narrower than a pool
        ref_cache, ours = index_cache.clone(), index_cache.clone()
        write_index_rows(ref_cache, proj, norm_w, norm_b, eps, slots)
        want = pool_scores(q, raw, ref_cache, pool_bias, table, lens, ni**-0.5)
        got = pool_scores(q, raw, ours, pool_bias, table, lens, ni**-0.5, IndexWrite(proj, norm_w, norm_b, eps, slots))
        assert torch.equal(got, want) and torch.equal(ours, ref_cache)
        assert not torch.equal(ours, index_cache)


def check_absorbed(device, dtype, config=NOPE, num_heads=20, num_splits=1, tol=None, page_size=4):
    """sparse_mla_decode_absorbed with the latent write (its norm folded) = the layer's former launches: write_latent
    of rms_norm(latent), absorb_query(...).to(cache dtype), sparse_mla_decode, expand_output(o.to(q dtype)); the
    cache within the norm's rounding, the output within tol; a padded row (length 0, slot -1) outputs zeros."""
    from helios.kernels.dsa_decode import sparse_mla_decode, sparse_mla_decode_absorbed
    from helios.kernels.mla_decode import LatentWrite, write_latent_ref
    from helios.layers.mla import absorb_query, expand_output
    from helios.layers.norm import rms_norm

    tables, num_pages = paged_tables(list(SEQ_LENS), page_size, device)
    pools = check_pool_selection(device, torch.float32, page_size=page_size)
    rank, dr, b = config.kv_lora_rank, config.qk_rope_head_dim, len(SEQ_LENS)
    cache = _randn(1, num_pages, page_size, config.cache_dim, device=device, dtype=dtype, seed=5)
    q = _randn(b, num_heads, config.qk_nope_head_dim + dr, device=device, dtype=dtype, seed=6)
    kv_b = _randn(num_heads * (config.qk_nope_head_dim + config.v_head_dim), rank, device=device, dtype=dtype,
                  seed=7, scale=rank**-0.5)
    latent = _randn(b, rank, device=device, dtype=dtype, seed=8)
    rope_key = _randn(b, dr, device=device, dtype=dtype, seed=9)
    norm_weight = _randn(rank, device=device, dtype=dtype, seed=10)
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    # each sequence's last position; the padded row (length 0) writes nothing
    slots = torch.tensor([int(tables[i, (n - 1) // page_size]) * page_size + (n - 1) % page_size if n else -1
                          for i, n in enumerate(SEQ_LENS)], dtype=torch.int64, device=device)
    ref_cache = cache.clone()
    write_latent_ref(ref_cache, rms_norm(latent, norm_weight, config.norm_eps, False), rope_key, slots)
    q_abs = absorb_query(q, kv_b, config).to(cache.dtype)
    o_lat = sparse_mla_decode(q_abs, ref_cache, tables, lens, pools, DSA.pool_size, rank, config.softmax_scale,
                              num_splits)
    want = expand_output(o_lat.to(q.dtype), kv_b, config)
    write = LatentWrite(latent, rope_key, slots, norm_weight, config.norm_eps, False)
    got = sparse_mla_decode_absorbed(q, kv_b, cache, tables, lens, pools, DSA.pool_size, config.v_head_dim,
                                     config.softmax_scale, num_splits, write)
    torch.testing.assert_close(cache, ref_cache, **(_ulps(dtype, 4) if tol is None else tol))
    torch.testing.assert_close(got, want, **(tol or dict(atol=1e-5, rtol=1e-5)))
    assert got.dtype == q.dtype and torch.count_nonzero(got[SEQ_LENS.index(0)]) == 0


@DTYPES
def test_write_index_rows_is_the_layers_write(interpreter, dtype):
    check_write_index_rows("cpu", dtype)


@DTYPES
def test_pool_scores_scale_the_raw_weights_as_project_does(interpreter, dtype):
    check_raw_weights("cpu", dtype)


@DTYPES
def test_pool_scores_write_the_rows_they_score(interpreter, dtype):
    check_scores_with_write("cpu", dtype)


# NOTE: float32 only here: the interpreter's bfloat16 tl.dot makes sparse_mla_decode's own bf16 check fail too
# (tests/kernels/test_dsa_decode.py runs it on CUDA only); tests/gpu/test_dsa_folds_cuda.py runs both dtypes
@pytest.mark.parametrize("config, num_splits", [(NOPE, 1), (ROPE, 2)], ids=["nope-1split", "rope-2splits"])
def test_absorbed_attention_is_the_layers_launches(interpreter, config, num_splits):
    check_absorbed("cpu", torch.float32, config, num_splits=num_splits)
