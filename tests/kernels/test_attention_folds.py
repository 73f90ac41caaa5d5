"""The attention folds of a batch-1 decode step against the torch path they replace (Triton interpreter): the q/k
norms with partial rotary in one launch (helios.kernels.norm_fused.rms_norm_rope: qwen3_5's full layers, qwen4_exp's
and minimax_m3's attention and indexers), the block choice in one launch (helios.kernels.qsa_decode.select_blocks and
top_blocks, where torch sorts and masks in ten or one), an indexed layer's K/V and index-key writes in one launch
(qsa_decode.write_caches), the index queries' norm and rotary inside the block scores (qsa_decode.block_scores'
q_norm_weight), and the per-step block rotary rows (helios.layers.qsa.block_cos_sin: a view of the rope
table, no launch). The check_* functions take a device; tests/gpu/test_attention_folds_cuda.py runs them compiled.
"""

from __future__ import annotations

import pytest
import torch

from helios.layers.norm import RMSNorm
from helios.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp2(-inf) and friends

F32 = dict(atol=1e-6, rtol=1e-6)  # the norm's squares summed in the kernel's order


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _norm(dim: int, dtype: torch.dtype, multiply_in_float32: bool, seed: int, device) -> RMSNorm:
    module = RMSNorm(dim, 1e-6, multiply_in_float32)
    gen = torch.Generator().manual_seed(seed)
    module.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(dim, generator=gen)).to(device, dtype),
                                       requires_grad=False)
    return module


def _rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary over each head's leading cos.shape[-1] dims, the rest passed (helios.layers.qsa.rotate_leading)."""
    r = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def _rotate_once(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation in float32, rounded once (helios.kernels.rotary's)."""
    r = cos.shape[-1]
    turned = apply_rotary(x[..., :r].float(), cos.float(), sin.float()).to(x.dtype)
    return torch.cat([turned, x[..., r:]], dim=-1)


def check_norm_rope(device, dtype, head_dim=48, rotary_dim=24, multiply_in_float32=True, round_products=True,
                    num_tokens=3, f32=F32, exact16=True):
    """rms_norm_rope over a strided projection row of q heads then k heads (two weights), with table rows (strided)
    of rotary_dim < head_dim: q_norm / k_norm (torch), then apply_rotary's ops over the leading dims (round_products:
    16-bit bit for bit) or the rotation rounded once; the trailing dims pass normed. exact16 False (compiled: the
    device's rsqrt and FMA contraction may move a float32 bit under a 16-bit rounding): within one 16-bit step."""
    from helios.kernels.norm_fused import rms_norm_rope

    num_q, num_k = 4, 2
    q_norm = _norm(head_dim, dtype, multiply_in_float32, 1, device)
    k_norm = _norm(head_dim, dtype, multiply_in_float32, 2, device)
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(num_tokens, (num_q + num_k + 3) * head_dim, generator=gen).to(device, dtype)
    x = row[:, : (num_q + num_k) * head_dim].view(num_tokens, num_q + num_k, head_dim)
    rope = RotaryEmbedding(rotary_dim, 10000.0, device=device)
    rope.tabulate(4096, dtype)
    cos, sin = rope.cos_sin(torch.tensor([5, 700, 4000, 1, 2, 3, 4][:num_tokens], device=device), dtype)
    assert cos.stride(0) == 2 * rotary_dim  # rows of the table
    got = rms_norm_rope(x, q_norm.weight, q_norm.eps, multiply_in_float32, weight2=k_norm.weight, num_first=num_q,
                        cos=cos, sin=sin, round_products=round_products)
    normed = torch.cat([q_norm(x[:, :num_q]), k_norm(x[:, num_q:])], dim=1)
    want = (_rotate_leading if round_products else _rotate_once)(normed, cos, sin)
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **f32)
    elif exact16:  # every rounding the torch path makes, made alike (the statistics' order moves none at these values)
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        assert torch.equal(got[..., rotary_dim:], normed[..., rotary_dim:])
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=2**-7)


def check_select_blocks(device, num_seqs=7, num_blocks=45, block_size=4, num_kept=6):
    """select_blocks = dsa_decode.select_pools (the stable sort, -1 past the complete blocks, the tail) on scores full
    of ties: relu's zeros (both signs) and repeated values; lengths on and off block edges, a padded row."""
    from helios.kernels.dsa_decode import select_pools
    from helios.kernels.qsa_decode import select_blocks

    gen = torch.Generator().manual_seed(4)
    scores = torch.randint(0, 4, (num_seqs, num_blocks), generator=gen).float() / 2
    scores[scores == 0.5] = -0.0
    lens = torch.tensor([37, 5, 0, 24, 3, num_blocks * block_size, 181][:num_seqs], dtype=torch.int32)
    scores = torch.where(torch.arange(num_blocks)[None, :] < (lens.long() // block_size)[:, None], scores,
                         float("-inf"))
    scores, lens = scores.to(device), lens.to(device)
    for kept in (num_kept, num_blocks, num_blocks + 3, 1):
        got = select_blocks(scores, lens, block_size, kept)
        assert got.dtype == torch.int32 and torch.equal(got, select_pools(scores, lens, block_size, kept)), kept


def check_top_blocks(device, num_seqs=3, num_heads=2, num_blocks=20, num_kept=5):
    """qsa_decode.top_blocks = sparse_decode.top_blocks (one stable sort, cut) with ties, -inf and boosted +inf."""
    from helios.kernels import sparse_decode
    from helios.kernels.qsa_decode import top_blocks

    gen = torch.Generator().manual_seed(5)
    scores = torch.randint(-2, 3, (num_seqs, num_heads, num_blocks), generator=gen).float()
    scores[..., -4:] = float("-inf")
    scores[:, :, 3] = float("inf")
    scores = scores.to(device)
    for kept in (num_kept, num_blocks, 1):
        got = top_blocks(scores, kept)
        assert got.dtype == torch.int64 and torch.equal(got, sparse_decode.top_blocks(scores, kept)), kept


def check_write_caches(device, dtype, num_kv_heads=2, head_dim=48, index_dim=24, page_size=4):
    """write_caches = reshape_and_cache then write_latent (K/V and the index key of every token into its slot, in the
    caches' dtypes) from strided projection rows, bit for bit; a padded row (slot -1) writes nothing."""
    from helios.kernels.mla_decode import write_latent
    from helios.kernels.qsa_decode import write_caches
    from helios.kernels.reshape_and_cache import reshape_and_cache

    gen = torch.Generator().manual_seed(9)
    width = 2 * num_kv_heads * head_dim + index_dim + 5
    rows = torch.randn(4, width, generator=gen).to(device, dtype)
    k = rows[:, : num_kv_heads * head_dim].view(4, num_kv_heads, head_dim)
    v = rows[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(4, num_kv_heads, head_dim)
    index_k = rows[:, 2 * num_kv_heads * head_dim : 2 * num_kv_heads * head_dim + index_dim]
    slots = torch.tensor([5, -1, 17, 2], device=device)
    caches = [(torch.randn(2, 6, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype),
               torch.randn(1, 6, page_size, index_dim, generator=gen).to(device, dtype))]
    caches.append(tuple(c.clone() for c in caches[0]))
    write_caches(k, v, index_k, *caches[0], slots)
    reshape_and_cache(k, v, caches[1][0], slots)
    write_latent(caches[1][1], index_k, index_k[:, :0], slots)
    assert all(torch.equal(a, b) for a, b in zip(*caches))
    flat_kv, flat_index = caches[0][0].flatten(1, 2), caches[0][1].flatten(1, 2)
    assert torch.equal(flat_kv[0, 17], k[2]) and torch.equal(flat_kv[1, 5], v[0])
    assert torch.equal(flat_index[0, 2], index_k[3])


def check_scores_norm_the_queries(device, dtype, seq_lens=(37, 5, 0, 24, 64), page_size=4, tol=None):
    """qsa_decode.block_scores from raw index queries (their q_norm and rotary folded into every program) = from the
    queries the torch path norms and turns (Indexer.q_norm, then rotate_leading at each query's position): the
    normed, turned queries agree to their rounding, so the float32 scores within the sum's order."""
    from helios.kernels import qsa_decode
    from helios.layers.qsa import block_starts, rotate_leading
    from tests.kernels.test_mla_decode import _randn, paged_tables
    from tests.kernels.test_qsa_decode import CONFIG, _indexer

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    indexer, c, b = _indexer(device, dtype), CONFIG, len(seq_lens)
    index_cache = _randn(1, num_pages, page_size, c.head_dim, device=device, dtype=dtype, seed=1)
    raw = _randn(b, c.num_heads + 1, c.head_dim, device=device, dtype=dtype, seed=2)[:, : c.num_heads]  # strided
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q_cos, q_sin = indexer.rotary.cos_sin((lens.long() - 1).clamp(min=0), dtype)
    num_blocks = qsa_decode.block_count(tables.shape[1], page_size, c.block_size)
    cos, sin = indexer.rotary.cos_sin(block_starts(indexer.rotary, num_blocks, c.block_size, device), dtype)
    args = (index_cache, indexer.k_norm.weight, indexer.k_norm.eps, cos, sin, tables, lens, c.block_size)
    with torch.inference_mode():
        want = qsa_decode.block_scores(rotate_leading(indexer.q_norm(raw), q_cos, q_sin), *args)
        got = qsa_decode.block_scores(raw, *args, q_norm_weight=indexer.q_norm.weight, q_eps=indexer.q_norm.eps,
                                      q_cos=q_cos, q_sin=q_sin)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, **(tol or dict(atol=1e-5, rtol=1e-5)))


def check_block_cos_sin(device, dtype):
    """block_cos_sin: the table's every block_size-th row (a view) where the table holds every block start, else
    cos_sin(block_starts) (clamped past the table); once per step (the metadata's derived), the same tensors after."""
    from helios.layers.attention import AttentionMetadata
    from helios.layers.qsa import block_cos_sin, block_starts

    rope = RotaryEmbedding(8, 10000.0, device=device)
    meta = AttentionMetadata(positions=torch.zeros(1, dtype=torch.int64, device=device),
                             slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
                             query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
                             seq_lens=torch.ones(1, dtype=torch.int32, device=device),
                             block_tables=torch.zeros(1, 10, dtype=torch.int32, device=device),
                             query_start_loc_cpu=[0, 1], seq_lens_cpu=[1])
    for table_rows in (None, 4096, 30):  # none, every block start, too few (the clamped fallback)
        if table_rows is not None:
            rope.tabulate(table_rows, dtype)
        meta.derived.clear()
        cos, sin = block_cos_sin(meta, rope, 10, 4, dtype)
        want = rope.cos_sin(block_starts(rope, 10, 4, device), dtype)
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1]) and cos.stride(-1) == 1
        assert block_cos_sin(meta, rope, 10, 4, dtype)[0] is cos
        if table_rows == 4096:
            assert cos.untyped_storage().data_ptr() == rope.table.untyped_storage().data_ptr()  # a view


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("round_products", [True, False], ids=["apply_rotary", "rounded_once"])
@pytest.mark.parametrize("multiply_in_float32", [True, False], ids=["gemma", "llama"])
def test_norm_rope_with_partial_rotary(interpreter, dtype, round_products, multiply_in_float32):
    check_norm_rope("cpu", dtype, multiply_in_float32=multiply_in_float32, round_products=round_products)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_rope_with_full_rotary_and_odd_pass_width(interpreter, dtype):
    check_norm_rope("cpu", dtype, head_dim=32, rotary_dim=32)
    check_norm_rope("cpu", dtype, head_dim=40, rotary_dim=16)  # 24 passed dims: a padded pass tile


def test_select_blocks_is_select_pools(interpreter):
    check_select_blocks("cpu")


def test_top_blocks_is_the_stable_sort(interpreter):
    check_top_blocks("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_launch_writes_kv_and_index_keys_as_two_do(interpreter, dtype):
    check_write_caches("cpu", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_scores_norm_and_turn_raw_queries_as_the_torch_path(interpreter, dtype):
    check_scores_norm_the_queries("cpu", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_rotary_rows_are_the_gathered_ones(dtype):
    check_block_cos_sin("cpu", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qwen3_5_attention_norms_and_partial_rotary_in_one_launch(interpreter, dtype, monkeypatch):
    """qwen3_5's gated attention with partial rotary on the Triton backend: q's and k's norms and rotary are one
    rms_norm_rope launch (no rmsnorm or rotary launch), its output = the torch path's rounded-once rotation."""
    from helios.kernels import norm_fused, rmsnorm, rotary
    from helios.layers.norm import norm_rotate_heads

    calls = []
    for module, name in ((norm_fused, "rms_norm_rope"), (rotary, "rotary_embedding"), (rmsnorm, "rms_norm")):
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    q_norm, k_norm = (_norm(32, dtype, True, seed, "cpu") for seed in (6, 7))
    x = torch.randn(2, 7 * 32, generator=torch.Generator().manual_seed(8)).to(dtype)[:, : 6 * 32].view(2, 6, 32)
    rope = RotaryEmbedding(8, 10000.0)
    cos_sin = rope.cos_sin(torch.tensor([3, 90]), dtype)
    got = norm_rotate_heads(x, 4, q_norm, k_norm, cos_sin, fused=True)
    assert calls == ["rms_norm_rope"]
    normed = torch.cat([q_norm(x[:, :4]), k_norm(x[:, 4:])], dim=1)
    want = _rotate_once(normed, *cos_sin)
    for g, w in zip(got, (want[:, :4], want[:, 4:])):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, **F32)
        else:
            assert torch.equal(g, w)
