"""Kernel-vs-reference checks, shared by tests/kernels (Triton interpreter, CPU) and tests/gpu (CUDA).

Each check builds its inputs on `device` in `dtype`, runs the kernel and its `*_ref`, and asserts they agree
within the dtype's tolerance. Kernel modules are imported inside the checks: Triton decides interpreted vs
compiled when a kernel module is first imported, which must happen after tests/kernels/conftest.py ran.
"""

from __future__ import annotations

import math

import torch

from tests.kernels.cases import paged_case, tolerance


def _close(actual, expected, dtype, device="cpu"):
    tol = tolerance(dtype)
    if dtype == torch.float32 and device != "cpu":
        tol = dict(atol=1e-4, rtol=1e-4)  # different reduction orders / exp2 on the device
    torch.testing.assert_close(actual, expected, **tol)


def _randn(*shape, device, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


# --- norms --------------------------------------------------------------------------------------------


def check_rms_norm(device, dtype, multiply_in_float32=False, dim=96, num_tokens=7):
    from helios.kernels.rmsnorm import rms_norm, rms_norm_ref

    x = _randn(num_tokens, dim, device=device, dtype=dtype, scale=3.0)
    w = _randn(dim, device=device, dtype=dtype, seed=1)
    _close(rms_norm(x, w, 1e-6, multiply_in_float32), rms_norm_ref(x, w, 1e-6, multiply_in_float32), dtype, device)


def check_rms_norm_strided_heads(device, dtype):
    """Per-head q norm on a strided view of a fused qkv output (rows are (token, head) pairs)."""
    from helios.kernels.rmsnorm import rms_norm, rms_norm_ref

    qkv = _randn(5, (4 + 2 * 2) * 64, device=device, dtype=dtype)
    q = qkv[:, : 4 * 64].view(5, 4, 64)  # non-contiguous across tokens
    w = _randn(64, device=device, dtype=dtype, seed=1)
    assert not q.is_contiguous()
    _close(rms_norm(q, w, 1e-5, True), rms_norm_ref(q, w, 1e-5, True), dtype, device)


def check_fused_add_rms_norm(device, dtype, multiply_in_float32=False):
    from helios.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref

    x = _randn(6, 160, device=device, dtype=dtype)
    residual = _randn(6, 160, device=device, dtype=dtype, seed=2, scale=4.0)
    w = _randn(160, device=device, dtype=dtype, seed=1)
    x_before, r_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6, multiply_in_float32)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, w, 1e-6, multiply_in_float32)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)  # one rounding, same as torch's add
    _close(out, ref_out, dtype, device)
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # inputs untouched


# --- rotary, activation ---------------------------------------------------------------------------------


def check_rotary(device, dtype, num_heads=6, num_kv_heads=2, head_dim=64):
    from helios.kernels.rotary import rotary_embedding, rotary_embedding_ref

    max_positions, num_tokens = 64, 9
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    positions = torch.tensor([0, 3, 63, 17, 17, 5, 40, 1, 2], device=device)
    # q and k as strided views of one fused qkv buffer, the way the attention layer holds them
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype)
    ref = qkv.clone()
    split = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def views(t):
        q, k, _ = t.split(split, dim=-1)
        return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)

    rotary_embedding(*views(qkv), cos, sin, positions)
    rotary_embedding_ref(*views(ref), cos, sin, positions)
    _close(qkv, ref, dtype, device)  # v's columns must be untouched by both
    # per-token rows already gathered (what RotaryEmbedding.cos_sin hands the layer)
    rotary_embedding(*views(qkv), cos[positions], sin[positions])
    rotary_embedding_ref(*views(ref), cos[positions], sin[positions])
    _close(qkv, ref, dtype, device)


def check_gated(device, dtype, act):
    from helios.kernels import activation

    kernel = getattr(activation, f"{act}_and_mul")
    ref = getattr(activation, f"{act}_and_mul_ref")
    x = _randn(5, 2 * 1100, device=device, dtype=dtype, scale=3.0)  # F = 1100: two column blocks, masked tail
    x[0, :8] = torch.tensor([-30.0, -12.0, -1e-3, 0.0, 1e-3, 12.0, 30.0, -5.0], dtype=dtype)  # both tails
    _close(kernel(x), ref(x), dtype, device)


# --- KV cache write ------------------------------------------------------------------------------------


def check_reshape_and_cache(device, dtype, page_size, cache_dtype=None, v_dim=None):
    """v_dim: values narrower than the cache's head_dim (mimo_v2_flash), written zero-padded over a cache whose
    every value is nonzero (the padding columns must be written, not left)."""
    from helios.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    c = paged_case([3, 1, 9], [3, 21, 30], 2, 1, 64, page_size, dtype=dtype, device=device)
    cache = c.kv_cache.to(cache_dtype or dtype)
    if v_dim is not None:
        cache = _randn(*cache.shape, device=device, dtype=cache.dtype, seed=7).abs() + 1.0
    k = _randn(*c.k.shape, device=device, dtype=dtype, seed=5)
    v = _randn(*c.v.shape[:2], v_dim or c.v.shape[2], device=device, dtype=dtype, seed=6)
    slots = c.slot_mapping.clone()
    slots[1] = -1  # a padded row writes nothing
    actual, expected = cache.clone(), cache.clone()
    reshape_and_cache(k, v, actual, slots)
    reshape_and_cache_ref(k, v, expected, slots)
    assert torch.equal(actual, expected)
    assert not torch.equal(actual, cache)
    if v_dim is not None:  # the written slots' value columns past v_dim are zeros
        written = actual[1].view(-1, *actual.shape[3:])[slots[slots >= 0]]
        assert (written[..., v_dim:] == 0).all() and (written[..., :v_dim] != 0).any()


def _rope_rows(positions, head_dim, device, dtype):
    """Per-token cos and sin rows [T, head_dim] (base 10000, neox halves), as RotaryEmbedding.cos_sin hands them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.cat((positions[:, None] * inv_freq,) * 2, dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def check_rotary_and_cache(device, dtype, qk_norm=False, multiply_in_float32=False, num_heads=6, num_kv_heads=2,
                           head_dim=64, page_size=4):
    """The fused norm + rotary + cache write against the unfused reference: q, and the whole cache."""
    from helios.kernels.rotary_cache import rotary_and_cache, rotary_and_cache_ref

    num_tokens, num_pages = 9, 8
    cos, sin = _rope_rows(torch.tensor([0, 3, 31, 17, 17, 5, 30, 1, 2]), head_dim, device, dtype)
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype, scale=2.0)
    q_norm = _randn(head_dim, device=device, dtype=dtype, seed=3) if qk_norm else None
    k_norm = _randn(head_dim, device=device, dtype=dtype, seed=4) if qk_norm else None
    slots = torch.randperm(num_pages * page_size, generator=torch.Generator().manual_seed(1))[:num_tokens]
    slots[4] = -1  # a padded row writes no cache
    slots = slots.to(device)
    cache = _randn(2, num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, seed=7)
    actual, expected = cache.clone(), cache.clone()
    q = rotary_and_cache(qkv, cos, sin, actual, slots, num_heads, q_norm, k_norm, 1e-6, multiply_in_float32)
    q_ref = rotary_and_cache_ref(qkv, cos, sin, expected, slots, num_heads, q_norm, k_norm, 1e-6, multiply_in_float32)
    _close(q, q_ref, dtype, device)
    _close(actual, expected, dtype, device)
    assert not torch.equal(actual, cache)


# --- attention -----------------------------------------------------------------------------------------


def check_decode(
    device,
    dtype,
    group,
    page_size,
    seq_lens=(37, 5, 70),
    num_splits=1,
    sliding_window=None,
    softcap=None,
    block_n=None,
    num_kv_heads=2,
    head_dim=64,
    sinks=False,
    out_dim=None,
):
    """sinks: per-head sink logits (mimo_v2_flash), drawn around the scores' size. out_dim: narrow values (mimo's
    v heads: the cache's value columns past it zero, as reshape_and_cache pads them): the output's first out_dim
    columns, the bits of the full-width kernel's."""
    from helios.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

    seq_lens = list(seq_lens)
    c = paged_case([1] * len(seq_lens), seq_lens, num_kv_heads, group, head_dim, page_size, dtype, device)
    if out_dim is not None:
        c.kv_cache[1, ..., out_dim:] = 0
    scale = head_dim**-0.5
    args = (c.q, c.kv_cache, c.block_tables, c.seq_lens, scale, sliding_window, softcap)
    extra = {"sinks": _randn(num_kv_heads * group, device=device, dtype=dtype, seed=7, scale=2.0)} if sinks else {}
    out = paged_decode_attention(*args, num_splits=num_splits, block_n=block_n, **extra)
    _close(out, paged_decode_attention_ref(*args, **extra), dtype, device)
    if out_dim is not None:
        narrow = paged_decode_attention(*args, num_splits=num_splits, block_n=block_n, out_dim=out_dim, **extra)
        assert narrow.shape == (*out.shape[:2], out_dim) and narrow.is_contiguous()
        assert torch.equal(narrow, out[..., :out_dim])
    return out


def check_decode_qkv(
    device,
    dtype,
    group,
    page_size,
    seq_lens=(37, 1, 70, 0),
    num_splits=1,
    sliding_window=None,
    softcap=None,
    qk_norm=False,
    multiply_in_float32=False,
    block_n=None,
    num_kv_heads=2,
    head_dim=64,
    row_norm=None,
):
    """The one-launch decode (norms, rotary, cache write, attention from the qkv row) against rotary_and_cache_ref
    then decode attention's reference: the output and the whole cache. A seq_len of 0 is a padded graph row
    (slot -1: writes nothing, outputs zeros); 1 attends only the newest key."""
    from helios.kernels.decode_qkv import decode_attention_qkv, decode_attention_qkv_ref

    lens = list(seq_lens)
    c = paged_case([1] * len(lens), [max(n, 1) for n in lens], num_kv_heads, group, head_dim, page_size, dtype, device)
    num_heads = num_kv_heads * group
    seqs = torch.tensor(lens, dtype=torch.int32, device=device)
    slots = torch.where(seqs > 0, c.slot_mapping, torch.full_like(c.slot_mapping, -1))
    cos, sin = _rope_rows(torch.tensor([max(n - 1, 0) for n in lens]), head_dim, device, dtype)
    qkv = _randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim, device=device, dtype=dtype, scale=2.0, seed=5)
    norms = {}
    if qk_norm:
        norms = dict(q_norm=_randn(head_dim, device=device, dtype=dtype, seed=3),
                     k_norm=_randn(head_dim, device=device, dtype=dtype, seed=4),
                     multiply_in_float32=multiply_in_float32)
    actual, expected = c.kv_cache.clone(), c.kv_cache.clone()
    args = (cos, sin)
    tail = (c.block_tables, seqs, num_heads, head_dim**-0.5, sliding_window, softcap)
    out = decode_attention_qkv(qkv, *args, actual, slots, *tail, **norms, num_splits=num_splits, block_n=block_n,
                               row_norm=row_norm)
    ref = decode_attention_qkv_ref(qkv, *args, expected, slots, *tail, **norms, row_norm=row_norm)
    _close(actual, expected, dtype, device)
    _close(out, ref, dtype, device)
    assert not out[[i for i, n in enumerate(lens) if n == 0]].any()
    return out


def check_prefill(
    device,
    dtype,
    group,
    page_size,
    query_lens=(20, 1, 9),
    seq_lens=(20, 33, 30),
    sliding_window=None,
    softcap=None,
    block_m=None,
    block_n=None,
    num_kv_heads=2,
    head_dim=64,
    sinks=False,
):
    """sinks: per-head sink logits (mimo_v2_flash), drawn around the scores' size."""
    from helios.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    c = paged_case(list(query_lens), list(seq_lens), num_kv_heads, group, head_dim, page_size, dtype, device)
    scale = head_dim**-0.5
    args = (c.q, c.kv_cache, c.query_start_loc, c.seq_lens, c.block_tables, c.max_query_len, scale)
    extra = {"sinks": _randn(num_kv_heads * group, device=device, dtype=dtype, seed=7, scale=2.0)} if sinks else {}
    out = paged_prefill_attention(*args, sliding_window, softcap, block_m=block_m, block_n=block_n, **extra)
    _close(out, paged_prefill_attention_ref(*args, sliding_window, softcap, **extra), dtype, device)


# --- sampling ------------------------------------------------------------------------------------------


def _logits(device, rows=4, vocab=5000):
    x = _randn(rows, vocab, device=device, dtype=torch.float32, scale=4.0)
    x[1] = float("-inf")
    x[1, 1234] = 3.0  # one finite entry
    x[2] = float("-inf")  # nothing finite: lse -inf
    x[3, ::7] = x[3, 0]  # many exact ties at a large value
    x[3, 0] = x[3].max() + 1.0
    return x


def check_argmax_rows(device):
    from helios.kernels.sampling import argmax_rows

    x = _logits(device, vocab=9000)  # three chunks, the last one partial
    x[0, 8999] = x[0].max() + 2.0  # the maximum in the partial chunk
    x[3, 4096 + 7] = x[3, 0]  # a tie across chunks: the lower id wins
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[1:4].tolist() == [1234, 0, 0]  # one finite entry; all -inf gives 0, like torch
    assert torch.equal(argmax_rows(x[:, :5].contiguous()), x[:, :5].argmax(dim=-1))  # one chunk


def check_exponential_log_noise(device):
    from helios.kernels.sampling import exponential_log_noise

    # one seed at three positions (one past 2**32), a negative seed, a seed with only high bits, seed 0
    seeds = torch.tensor([7, 7, 7, -3, 2**62, 0], dtype=torch.int64, device=device)
    positions = torch.tensor([0, 1, 2**33 + 1, 0, 5, 5], dtype=torch.int64, device=device)
    vocab = 5000  # a partial block of 4 x 1024
    x = exponential_log_noise(seeds, positions, vocab)
    assert x.shape == (6, vocab) and x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    for r in range(6):  # a row's noise is (seed, position, token)'s alone: the same alone, bitwise
        assert torch.equal(exponential_log_noise(seeds[r : r + 1], positions[r : r + 1], vocab)[0], x[r])
    assert torch.equal(exponential_log_noise(seeds, positions, 1000), x[:, :1000])  # not the row's width
    assert len({tuple(row[:64].tolist()) for row in x}) == 6  # seeds (their high bits too) and positions count
    e = x.double().exp().flatten()  # 30000 draws of Exponential(1): mean 1, variance 1, P(E > t) = exp(-t)
    n = e.numel()
    assert abs(e.mean().item() - 1.0) < 5 / n**0.5 and abs(e.var().item() - 1.0) < 20 / n**0.5
    for t in (0.01, 0.5, 1.0, 3.0):
        p = math.exp(-t)
        assert abs((e > t).double().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5, t
    # the sampler's draw, argmax(logits - log E), is a sample of softmax(logits): 4000 draws of 4 tokens in one row
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5], device=device)
    y = (logits.repeat(4000) - exponential_log_noise(seeds[:1], positions[:1], 16000)[0]).view(4000, 4)
    freq = torch.bincount(y.argmax(-1), minlength=4).double().cpu() / 4000
    probs = torch.softmax(logits.double().cpu(), 0)
    assert bool((freq - probs).abs().le(5 * (probs * (1 - probs) / 4000).sqrt()).all()), (freq, probs)


def check_row_logsumexp(device):
    from helios.kernels.sampling import row_logsumexp, row_logsumexp_ref

    x = _logits(device)
    row_max, lse = row_logsumexp(x)
    ref_max, ref_lse = row_logsumexp_ref(x)
    assert torch.equal(row_max, ref_max)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # batch invariance: a row's result is bitwise the same alone as in the batch
    for i in range(x.shape[0]):
        alone_max, alone_lse = row_logsumexp(x[i : i + 1].clone())
        assert torch.equal(alone_lse, lse[i : i + 1]) and torch.equal(alone_max, row_max[i : i + 1])


def check_top_logprobs(device, num=20):
    from helios.kernels.sampling import row_logsumexp_ref, top_logprobs, top_logprobs_ref

    x = _logits(device)
    x[0, 100:140] = x[0].max() + 1.0  # a 40-way tie for the top across the cut: lowest ids must win
    lse = row_logsumexp_ref(x)[1]
    values, ids = top_logprobs(x, num, lse)
    ref_values, ref_ids = top_logprobs_ref(x, num, lse)
    assert torch.equal(ids, ref_ids) and torch.equal(values, ref_values)
    assert ids[0].tolist() == list(range(100, 100 + num))
    assert top_logprobs(x[:, :5], num, lse)[1].shape == (x.shape[0], 5)  # N clamped to the vocabulary


# --- the backend ---------------------------------------------------------------------------------------


def paged_metadata(c):
    """helios.layers.attention.AttentionMetadata of a PagedCase."""
    from helios.layers.attention import AttentionMetadata

    qsl, lens = c.query_start_loc.tolist(), c.seq_lens.tolist()
    positions = torch.cat([torch.arange(n - (b - a), n) for a, b, n in zip(qsl, qsl[1:], lens)])
    return AttentionMetadata(
        positions=positions.to(c.q.device),
        slot_mapping=c.slot_mapping,
        query_start_loc=c.query_start_loc,
        seq_lens=c.seq_lens,
        block_tables=c.block_tables,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )


def check_backend(device, dtype, query_lens, seq_lens, sliding_window=None, softcap=None, decode_num_splits=None):
    """TritonAttentionBackend writes the same cache and attends like TorchAttentionBackend."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.attention import TorchAttentionBackend

    c = paged_case(query_lens, seq_lens, num_kv_heads=2, group=3, head_dim=64, page_size=4, dtype=dtype, device=device)
    meta = paged_metadata(c)
    # both start from a cache whose target slots hold stale data, so both must write this step's K/V
    stale = c.kv_cache.clone()
    flat = stale.view(2, -1, 2, 64)
    flat[:, c.slot_mapping] = _randn(2, len(c.slot_mapping), 2, 64, device=device, dtype=dtype, seed=9)
    torch_cache, triton_cache = stale.clone(), stale.clone()
    args = (0.125, sliding_window, softcap)
    expected = TorchAttentionBackend().forward(c.q, c.k, c.v, torch_cache, meta, *args)
    backend = TritonAttentionBackend(decode_num_splits=decode_num_splits)
    actual = backend.forward(c.q, c.k, c.v, triton_cache, meta, *args)
    assert torch.equal(triton_cache, torch_cache)
    _close(actual, expected, dtype, device)
