"""helios.kernels.mla_decode's folds against the unfused computations they replace, in Triton's CPU interpreter: the
absorbed decode in three launches (absorb_query, the attention, the split merge with W_uv) = helios.layers.mla's
absorb_query and expand_output around mla_decode, the cache write with the latent's RMSNorm = the norm kernel then
the write, and the decode's first launch with the write in it = write_latent then the decode (bit for bit); float32
within its rounding, and each row alone = the row in a batch bit for bit (bf16).

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_kimi_folds_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_decode import NOPE, ROPE, _randn, paged_tables

# the interpreter (numpy) warns on exp overflow / log(0) where the GPU quietly gives inf / -inf
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SEQ_LENS = (37, 5, 70, 0, 1)  # a padded row (length 0) among them


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _inputs(device, config, dtype, num_heads=20, seq_lens=SEQ_LENS, page_size=4):
    c = config
    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    width = c.kv_lora_rank + c.qk_rope_head_dim
    cache = _randn(1, num_pages, page_size, width, device=device, dtype=dtype, seed=1)
    q = _randn(len(seq_lens), num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, device=device, dtype=dtype, seed=2)
    kv_b = _randn(num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, device=device, dtype=dtype,
                  seed=3, scale=c.kv_lora_rank**-0.5)
    return q, kv_b, cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _unfused(q, kv_b, cache, tables, lens, config, num_splits):
    """The layer's former kernel path: torch's absorption and concat, mla_decode (its own merge), torch's W_uv."""
    from helios.kernels.mla_decode import mla_decode
    from helios.layers.mla import absorb_query, expand_output

    q_abs = absorb_query(q, kv_b, config).to(cache.dtype)
    o_lat = mla_decode(q_abs, cache, tables, lens, config.kv_lora_rank, config.softmax_scale, num_splits)
    return expand_output(o_lat.to(q.dtype), kv_b, config)


def check_absorb_query(device, config, dtype=torch.float32, tol=None, **shape):
    from helios.kernels.mla_decode import absorb_query
    from helios.layers.mla import absorb_query as absorb_query_torch

    q, kv_b, *_ = _inputs(device, config, dtype, **shape)
    got = absorb_query(q, kv_b, config.kv_lora_rank, config.v_head_dim, dtype)
    torch.testing.assert_close(got, absorb_query_torch(q, kv_b, config), **(tol or dict(atol=2e-6, rtol=2e-6)))


def check_absorbed_decode(device, config, dtype, num_splits, tol=None, rows_alone=False, **shape):
    """mla_decode_absorbed = the unfused path (float32: within its rounding); the padded row gives zeros; with
    rows_alone each sequence alone = its row in the batch, bit for bit."""
    from helios.kernels.mla_decode import mla_decode_absorbed

    c = config
    q, kv_b, cache, tables, lens = _inputs(device, c, dtype, **shape)
    got = mla_decode_absorbed(q, kv_b, cache, tables, lens, c.v_head_dim, c.softmax_scale, num_splits)
    want = _unfused(q, kv_b, cache, tables, lens, c, num_splits)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want.float(), **(tol or dict(atol=1e-5, rtol=1e-5)))
    padded = [i for i, n in enumerate(lens.tolist()) if n == 0]
    assert torch.count_nonzero(got[padded]) == 0
    for i in range(q.shape[0]) if rows_alone else ():
        alone = mla_decode_absorbed(q[i : i + 1], kv_b, cache, tables[i : i + 1], lens[i : i + 1], c.v_head_dim,
                                    c.softmax_scale, num_splits)
        assert torch.equal(alone, got[i : i + 1]), f"row {i}"


def check_write_latent_norm(device, dtype, multiply_in_float32=False, rank=48, rope_dim=16, page_size=4, tol=None):
    """write_latent(norm_weight=) = helios.kernels.rmsnorm.rms_norm then write_latent (float32: within rounding;
    bf16: a rounded value may differ by an ulp), a padded slot writes nothing, each token alone = in the batch."""
    from helios.kernels.mla_decode import write_latent
    from helios.kernels.rmsnorm import rms_norm

    width = rank + rope_dim
    cache = _randn(1, 6, page_size, width, device=device, dtype=dtype)
    fused = _randn(5, width + 8, device=device, dtype=dtype, seed=1, scale=3.0)
    latent, rope_key = fused[:, :rank], fused[:, rank:width]  # strided views, as the layer splits them
    weight = 1 + _randn(rank, device=device, seed=2, scale=0.1)
    weight = weight if multiply_in_float32 else weight.to(dtype)
    slots = torch.tensor([3, -1, 17, 0, 23], device=device)
    ours, ref = cache.clone(), cache.clone()
    write_latent(ours, latent, rope_key, slots, weight, 1e-6, multiply_in_float32)
    write_latent(ref, rms_norm(latent, weight, 1e-6, multiply_in_float32), rope_key, slots)
    close = tol or (dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=1.6e-2, rtol=1.6e-2))
    torch.testing.assert_close(ours.float(), ref.float(), **close)
    untouched = torch.ones(6 * page_size, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(ours.view(-1, width)[untouched], cache.view(-1, width)[untouched])
    for i in range(5):
        alone = cache.clone()
        write_latent(alone, latent[i : i + 1], rope_key[i : i + 1], slots[i : i + 1], weight, 1e-6,
                     multiply_in_float32)
        if slots[i] < 0:
            assert torch.equal(alone, cache), f"padded token {i} wrote"
        else:
            assert torch.equal(alone.view(-1, width)[slots[i]], ours.view(-1, width)[slots[i]]), f"token {i}"


def check_decode_writes_its_latents(device, config, dtype, num_splits, page_size=4, **shape):
    """mla_decode_absorbed(write=) = write_latent (the norm folded) then mla_decode_absorbed, bit for bit: the same
    cache after, the same outputs (each sequence's new row sits at its last position, so a write after the attention
    would show); the padded row (slot -1) writes nothing."""
    from helios.kernels.mla_decode import LatentWrite, mla_decode_absorbed, write_latent

    c = config
    q, kv_b, cache, tables, lens = _inputs(device, c, dtype, page_size=page_size, **shape)
    last = (lens - 1).clamp(min=0).long()
    slots = tables.long().gather(1, (last // page_size)[:, None])[:, 0] * page_size + last % page_size
    slots = torch.where(lens > 0, slots, -1)
    fused = _randn(len(lens), c.kv_lora_rank + c.qk_rope_head_dim + 8, device=device, dtype=dtype, seed=9, scale=3.0)
    weight = 1 + _randn(c.kv_lora_rank, device=device, dtype=dtype, seed=10, scale=0.1)
    write = LatentWrite(fused[:, : c.kv_lora_rank], fused[:, c.kv_lora_rank : -8], slots, weight, 1e-6)
    before, together = cache.clone(), cache.clone()
    write_latent(before, *write)
    want = mla_decode_absorbed(q, kv_b, before, tables, lens, c.v_head_dim, c.softmax_scale, num_splits)
    got = mla_decode_absorbed(q, kv_b, together, tables, lens, c.v_head_dim, c.softmax_scale, num_splits, write)
    assert torch.equal(together, before) and not torch.equal(together, cache)
    assert torch.equal(got, want)


@pytest.mark.parametrize("config", [ROPE, NOPE], ids=["rope", "nope"])
def test_absorb_query_kernel_is_the_torch_absorption(interpreter, config):
    check_absorb_query("cpu", config)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("config", [ROPE, NOPE], ids=["rope", "nope"])
def test_mla_decode_absorbed_is_the_unfused_path(interpreter, config, num_splits):
    check_absorbed_decode("cpu", config, torch.float32, num_splits)


def test_mla_decode_absorbed_bf16_rows_alone(interpreter):
    check_absorbed_decode("cpu", NOPE, torch.bfloat16, 2, tol=dict(atol=3e-2, rtol=3e-2), rows_alone=True)


@pytest.mark.parametrize("dtype, multiply_in_float32", [(torch.float32, False), (torch.bfloat16, False),
                                                        (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-f32mul"])
def test_write_latent_folds_the_latent_norm(interpreter, dtype, multiply_in_float32):
    check_write_latent_norm("cpu", dtype, multiply_in_float32)


@pytest.mark.parametrize("dtype, num_splits", [(torch.float32, 1), (torch.bfloat16, 3)], ids=["fp32", "bf16-split3"])
def test_mla_decode_writes_its_latents_in_its_first_launch(interpreter, dtype, num_splits):
    check_decode_writes_its_latents("cpu", NOPE, dtype, num_splits)
    check_decode_writes_its_latents("cpu", ROPE, dtype, num_splits)
