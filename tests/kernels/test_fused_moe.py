"""helios.kernels.fused_moe in Triton's CPU interpreter against the torch path of helios.layers.moe: routing
(softmax top-k; sigmoid and sqrtsoftplus with score bias, groups and scaling; given ids), the block-aligned sort
against its torch reference, and whole MoE blocks (SparseMoe, SigmoidMoe with a shared expert, clamped / SwiGLU-OAI
and relu2 latent variants) with fused=True = fused=False at 1, 3 and 64 tokens in float32 and bfloat16; buffers
sized by shapes alone, and a token's output the same alone and padded into a larger batch. Each family's own block:
test_fused_moe_families.py."""

from __future__ import annotations

import pytest
import torch

from helios.layers.moe import SigmoidMoe, SparseMoe, route, route_sigmoid, router_scores
from tests.kernels import moe_cases
from tests.kernels.interpreter import require_interpreter
from tests.kernels.moe_cases import sigmoid_config, torch_and_fused

require_interpreter()

from helios.kernels import fused_moe  # noqa: E402  (after the interpreter check: kernels decorate on import)

HIDDEN, INTER = 32, 16
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def inputs(num_tokens: int, dtype: torch.dtype, seed: int = 1, width: int = HIDDEN) -> torch.Tensor:
    return moe_cases.inputs(num_tokens, width, dtype, seed)


def same_choice(ids: torch.Tensor, weights: torch.Tensor, want_ids: torch.Tensor, want_weights: torch.Tensor):
    """The same experts per token with the same weights, in any slot order."""
    got_order, want_order = ids.long().sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(got_order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, got_order.indices), want_weights.gather(1, want_order.indices),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_routing_matches_route(renorm):
    logits = inputs(9, torch.float32, width=24)
    weights, ids = fused_moe.moe_route(logits, 5, renorm=renorm)
    same_choice(ids, weights, *reversed(route(logits, 5, renorm)))


@pytest.mark.parametrize("scoring, groups, bias", [("sigmoid", (4, 2), True), ("sigmoid", (1, 1), False),
                                                   ("sqrtsoftplus", (1, 1), False)])
def test_sigmoid_routing_matches_route_sigmoid(scoring, groups, bias):
    logits = inputs(9, torch.float32, width=32) * 4.0  # sqrtsoftplus: past 20 and far below 0 too
    score_bias = 0.1 * inputs(1, torch.float32, seed=2, width=32)[0] if bias else None
    weights, ids = fused_moe.moe_route(logits, 4, scoring, score_bias, *groups, renorm=True, scaling=2.5)
    want_weights, want_ids = route_sigmoid(logits, 4, score_bias, *groups, True, 2.5, scoring)
    same_choice(ids, weights, want_ids, want_weights)


def test_given_ids_routing_weighs_the_given_experts():
    """deepseek_v4's hash layers: the experts come from a table (float ids here, as the core stores it); the weights
    are their sqrtsoftplus scores, renormalised and scaled, as DeepseekV4Moe's torch path computes them."""
    logits = inputs(5, torch.float32, width=16) * 4.0
    given = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:3] for i in range(5)])
    weights, ids = fused_moe.moe_route(logits, 3, "sqrtsoftplus", renorm=True, scaling=1.5, given_ids=given.float())
    scores = router_scores(logits, "sqrtsoftplus").gather(1, given)
    assert torch.equal(ids.long(), given)
    torch.testing.assert_close(weights, scores / (scores.sum(-1, keepdim=True) + 1e-20) * 1.5, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens, num_experts", [(1, 8), (3, 32), (64, 8), (64, 64), (1100, 7), (1100, 256),
                                                     (2100, 512)])
def test_align_matches_its_reference_with_buffers_sized_by_shape(num_tokens, num_experts):
    """Up to ALIGN_KERNEL_MAX_ENTRIES entries one program; beyond (the last three: 4400 and 8400 entries) the spans'
    three launches (the last: 17 spans, scanned in two tiles of 16): both give moe_align_ref's tensors, bit for
    bit."""
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, 4), generator=g)
    got = fused_moe.moe_align(ids, num_experts, 16)
    for a, b in zip(got, fused_moe.moe_align_ref(ids, num_experts, 16)):
        assert torch.equal(a, b)
    sorted_ids, block_experts, num_rows = got
    rows = fused_moe.max_sorted_rows(ids.numel(), num_experts, 16)
    assert sorted_ids.shape == (rows,) and block_experts.shape == (-(-rows // 16),)
    assert sorted(sorted_ids[sorted_ids < ids.numel()].tolist()) == list(range(ids.numel()))
    used = block_experts[: int(num_rows) // 16].long()
    entries = sorted_ids[: int(num_rows)].view(-1, 16).long()
    assert ((entries == ids.numel()) | (ids.flatten()[entries.clamp(max=ids.numel() - 1)] == used[:, None])).all()
    assert (block_experts[int(num_rows) // 16:] == -1).all()
    one_expert = fused_moe.moe_align(torch.zeros_like(ids), num_experts, 16)  # the other extreme: same sizes
    assert [t.shape for t in one_expert] == [t.shape for t in got]


@pytest.mark.parametrize("num_tokens, num_experts, dtype, act", [
    (1, 8, torch.float32, "silu"), (3, 16, torch.float32, "gelu_tanh"), (64, 8, torch.bfloat16, "silu"),
])
def test_sparse_moe_fused_matches_the_torch_path(num_tokens, num_experts, dtype, act):
    layers = torch_and_fused(lambda fused: SparseMoe(HIDDEN, num_experts, INTER, 2, True, act, fused=fused),
                             dtype=dtype)
    x = inputs(num_tokens, dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layers[1](x), layers[0](x), **TOL[dtype])


@pytest.mark.parametrize("num_tokens, dtype, variant", [
    (1, torch.float32, "base"), (64, torch.float32, "base"), (3, torch.bfloat16, "base"),
    (3, torch.float32, "clamped"), (3, torch.float32, "oai"), (3, torch.float32, "relu2_latent"),
])
def test_sigmoid_moe_fused_matches_the_torch_path(num_tokens, dtype, variant):
    kw, moe = {}, sigmoid_config()
    act = "silu"
    if variant == "clamped":
        kw = dict(limit=0.3, clamp_after_act=True)
    elif variant == "oai":
        kw = dict(limit=0.7, alpha=1.702)
    elif variant == "relu2_latent":  # nemotron_h's relu2 experts behind latent projections, muse_spark's norms
        act, moe = "relu2", sigmoid_config(latent_size=24, latent_norms=True, num_groups=1, num_topk_groups=1)
    layers = torch_and_fused(lambda fused: SigmoidMoe(HIDDEN, moe, act, fused=fused, **kw), dtype=dtype)
    x = inputs(num_tokens, dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layers[1](x), layers[0](x), **TOL[dtype])


def test_a_token_gives_the_same_output_alone_and_padded():
    """A graph replays a bucket's fixed-size buffers with padding rows: the real rows must not see them."""
    layers = torch_and_fused(lambda fused: SparseMoe(HIDDEN, 8, INTER, 2, True, "silu", fused=fused))
    x = inputs(3, torch.float32)
    padded = torch.cat([x, torch.zeros(5, HIDDEN)])
    with torch.inference_mode():
        assert torch.equal(layers[1](padded)[:3], layers[1](x))


def test_graphs_admit_moe_only_on_the_fused_path():
    from types import SimpleNamespace

    from helios.runner.cuda_graphs import unsupported_reason

    arch = SimpleNamespace(moe=sigmoid_config(), recurrent=None, index_dim=0, mla=None)
    cuda = torch.device("cuda")  # a device object only: nothing runs
    torch_path, fused = (torch.nn.Sequential(SigmoidMoe(HIDDEN, arch.moe, "silu", fused=f)) for f in (False, True))
    assert unsupported_reason(torch_path, arch, cuda).startswith("MoE routing syncs with the host")
    assert "attention backend" in unsupported_reason(fused, arch, cuda)  # past the MoE check


def test_every_tile_config_sums_k_in_the_same_chunks():
    """Decode, small and large prefill batches take other tiles (gemm_config) but one BLOCK_K, so an entry's products
    sum their K chunks in one order at every batch size (its outputs batched = alone); large prefills 128-row blocks."""
    configs = [fused_moe.gemm_config(n) for n in (8, 1024, 1025, 16383, 16384, 65536)]
    assert {c["BLOCK_K"] for c in configs} == {128}
    assert [c["BLOCK_M"] for c in configs] == [16, 16, 64, 64, 128, 128]


def test_the_down_gemm_of_a_long_prompt_takes_128_columns_where_they_fit_with_the_same_bits():
    """fused_moe.down_config: the prompt-sized row's down GEMM at 128 columns (its 3 stages of 128-row blocks: 192 KB
    in 16 bits), on an H100 / H200's 227 KB of shared memory a block, not an A100's 163 KB nor in float32; the other
    rows keep gate_up's tile. The wider tile sums K in the same chunks: the same bits."""
    big, small = fused_moe.gemm_config(16384), fused_moe.gemm_config(2048)
    assert fused_moe.down_config(big, 2, 232448) == {**big, "BLOCK_N": 128}
    assert fused_moe.down_config(big, 2, None)["BLOCK_N"] == 128  # the interpreter: no limit
    assert fused_moe.down_config(big, 2, 166912) == big and fused_moe.down_config(big, 4, 232448) == big
    assert fused_moe.down_config(small, 2, 232448) == small
    assert fused_moe.shared_bytes_of("cpu") is None
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 8, (150, 2), generator=g)
    h = inputs(300, torch.bfloat16, width=256)  # two K chunks of 128
    w_down = (torch.randn(8, 3 * 64, 256, generator=g) / 16).to(torch.bfloat16)
    align = fused_moe.moe_align(ids, 8, big["BLOCK_M"])
    narrow = fused_moe.expert_gemm(h, w_down, align, ids.numel(), 1, config=big)
    wide = fused_moe.expert_gemm(h, w_down, align, ids.numel(), 1, config=fused_moe.down_config(big, 2, None))
    assert torch.equal(narrow, wide)


def test_the_program_order_changes_no_bits():
    """GROUP_M (blocks sweeping the column tiles together, for L2 reuse of their rows) computes each tile as the
    blocks-fastest order does: the same bits, with a block count that does not divide by the group."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 8, (70, 2), generator=g)
    x = inputs(70, torch.bfloat16)
    w_in = (torch.randn(8, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}
    align = fused_moe.moe_align(ids, 8, 16)
    outs = [fused_moe.expert_gemm(x, w_in, align, ids.numel(), 2, "silu", config={**cfg, "GROUP_M": group})
            for group in (0, 1, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("act, limit, clamp_after_act, alpha", [
    ("silu", None, False, None), ("gelu_tanh", None, False, None), ("gelu_tanh", 0.5, True, None),
    ("silu", 0.5, False, None), ("silu", 0.7, False, 1.702)])
def test_the_gemm_epilogue_is_the_torch_activation_of_the_rounded_products(act, limit, clamp_after_act, alpha):
    """The gate_up GEMM's fused activation = helios.layers.activation.gated (the torch path, as helios.kernels.
    activation computes it too) applied to the bf16 [gate | up] products of the same GEMM without it, bit for bit:
    clamps and SwiGLU-OAI (gate * alpha held in bf16 before the exp) included."""
    from helios.layers.activation import gated

    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 8, (6, 2), generator=g)
    x = inputs(6, torch.bfloat16)
    w_in = (torch.randn(8, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5 * 3).to(torch.bfloat16)
    cfg = fused_moe.gemm_config(ids.numel())
    align = fused_moe.moe_align(ids, 8, cfg["BLOCK_M"])
    fused = fused_moe.expert_gemm(x, w_in, align, ids.numel(), 2, act, limit, clamp_after_act, alpha, cfg)
    products = fused_moe.expert_gemm(x, w_in, align, ids.numel(), 2, config=cfg)
    want = gated(products, act, limit, clamp_after_act, alpha=alpha)
    if act == "gelu_tanh":  # 1 + tanh(y) cancels for gate < -3: there the last bits follow the tanh (test_gated_clamp)
        torch.testing.assert_close(fused, want, atol=1e-4, rtol=2**-8)
        big = want.float().abs() > 1e-2
        assert big.float().mean() > 0.5 and torch.equal(fused[big], want[big])
    else:
        assert torch.equal(fused, want)


def test_a_prefill_batch_takes_the_wide_blocks():
    """Past 1024 entries the GEMMs take 64-row blocks (gemm_config): the same products as the reference."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 8, (520, 2), generator=g)
    assert fused_moe.gemm_config(ids.numel())["BLOCK_M"] == 64
    x = inputs(520, torch.float32)
    w_in = torch.randn(8, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w_down = torch.randn(8, HIDDEN, INTER, generator=g) / INTER**0.5
    got = fused_moe.expert_outputs(x, ids, w_in, w_down, "silu")
    torch.testing.assert_close(got, fused_moe.expert_outputs_ref(x, ids, w_in, w_down, "silu"), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_the_combine_adds_a_shared_expert_as_torch_does(dtype, gated):
    """moe_combine's shared term (SigmoidMoe's `routed + shared`, qwen3_5_moe's `routed + sigmoid(gate) * shared`)
    in the combine launch: torch's result with each op rounded as torch rounds it (bf16: the same bits)."""
    num_tokens, top_k = 5, 3
    gen = torch.Generator().manual_seed(7)
    y = torch.randn(num_tokens * top_k, HIDDEN, generator=gen).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    shared = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    gate = torch.randn(num_tokens, 1, generator=gen).to(dtype) if gated else None
    got = fused_moe.moe_combine(y, weights, ids, shared, gate)
    want = fused_moe.moe_combine_ref(y, weights, ids, shared, gate)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    without = fused_moe.moe_combine(y, weights, ids)
    assert not torch.allclose(got, without)  # the shared term is there


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_takes_no_sort_and_the_sorted_path_values(dtype):
    """Batch-1 decode skips moe_align (one_token_align: each entry its own block, constants and a view of the ids):
    the experts' outputs are the sorted layout's, bit for bit, and the constants are made once."""
    num_experts, top_k = 8, 3
    gen = torch.Generator().manual_seed(3)
    x = inputs(1, dtype)
    w_in = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype)
    w_down = (torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to(dtype)
    ids = torch.tensor([[6, 1, 4]], dtype=torch.int32)
    cfg = fused_moe.gemm_config(top_k)
    sorted_layout = fused_moe.moe_align(ids, num_experts, cfg["BLOCK_M"])
    h = fused_moe.expert_gemm(x, w_in, sorted_layout, top_k, top_k, "silu", config=cfg)
    want = fused_moe.expert_gemm(h, w_down, sorted_layout, top_k, 1, config=cfg)
    assert torch.equal(fused_moe.expert_outputs(x, ids, w_in, w_down, "silu"), want)
    first = fused_moe.one_token_align(ids, cfg["BLOCK_M"])
    again = fused_moe.one_token_align(torch.tensor([[2, 0, 7]], dtype=torch.int32), cfg["BLOCK_M"])
    assert first[0] is again[0] and first[2] is again[2] and again[1].tolist() == [2, 0, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_a_shared_expert_rides_in_the_expert_launches_as_one_more_expert(dtype, num_tokens):
    """expert_outputs' shared weights: rows T*k + t are the shared expert's products of token t, the bits of the
    same kernel given it as a ninth stacked expert every token routes to; the routed rows are unchanged."""
    num_experts, top_k = 8, 3
    gen = torch.Generator().manual_seed(11)
    x = inputs(num_tokens, dtype)
    w_in = (torch.randn(num_experts + 1, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype)
    w_down = (torch.randn(num_experts + 1, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    shared = (w_in[num_experts].clone(), w_down[num_experts].clone())
    got = fused_moe.expert_outputs(x, ids, w_in[:num_experts], w_down[:num_experts], "silu", shared=shared)
    n = ids.numel()
    assert got.shape == (n + num_tokens, HIDDEN)
    assert torch.equal(got[:n], fused_moe.expert_outputs(x, ids, w_in[:num_experts], w_down[:num_experts], "silu"))
    nine = torch.cat([ids, torch.full((num_tokens, 1), num_experts, dtype=torch.int32)], dim=1)
    as_expert = fused_moe.expert_outputs(x, nine, w_in, w_down, "silu").view(num_tokens, top_k + 1, HIDDEN)
    assert torch.equal(got[n:], as_expert[:, top_k])


def test_the_shared_slot_takes_decode_batches_of_matching_experts_only():
    """SigmoidMoe's shared expert rides in the experts' launches when its shapes are an expert's and the batch is
    decode-sized (the fused block still = the torch block); a prompt-sized batch, another width or the one-token
    GEMVs keep it apart."""
    moe = sigmoid_config(shared_expert_intermediate_size=16)  # = moe_intermediate_size
    layers = torch_and_fused(lambda fused: SigmoidMoe(HIDDEN, moe, "silu", fused=fused))
    block = layers[1]
    w_in, w_down = block.gate_up.weight, block.down.weight
    for num_tokens, want in ((1, True), (3, True), (fused_moe.DECODE_ENTRIES // 4 + 1, False)):
        x = inputs(num_tokens, torch.float32)
        experts = torch.zeros(num_tokens, 4, dtype=torch.int32)
        assert (block.shared_slot(block.shared, x, experts, w_in, w_down) is not None) == want, num_tokens
        if num_tokens < 8:
            with torch.inference_mode():
                torch.testing.assert_close(block(x), layers[0](x), **TOL[torch.float32])
    one = inputs(1, torch.float32)
    block.one_token = "gemv"
    assert block.shared_slot(block.shared, one, torch.zeros(1, 4, dtype=torch.int32), w_in, w_down) is None
    block.one_token = "dot"
    wider = torch_and_fused(lambda fused: SigmoidMoe(HIDDEN, sigmoid_config(), "silu", fused=fused))[1]
    assert wider.shared_slot(wider.shared, one, torch.zeros(1, 4, dtype=torch.int32), wider.gate_up.weight,
                             wider.down.weight) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("multiply_in_float32", [False, True])
def test_the_combine_takes_the_next_add_and_norm_with_their_bits(dtype, multiply_in_float32):
    """moe_combine's then_norm: (norm(residual + out), residual + out) = moe_combine, then rmsnorm's fused add and
    norm (RMSNorm.forward_add on the GPU path), bit for bit; with a gated shared expert, over a row wider than one
    of the plain combine's programs."""
    from helios.kernels.rmsnorm import fused_add_rms_norm

    num_tokens, top_k, width = 3, 2, 1500
    gen = torch.Generator().manual_seed(9)
    y = torch.randn(num_tokens * top_k, width, generator=gen).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=gen)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    shared = torch.randn(num_tokens, width, generator=gen).to(dtype)
    gate = torch.randn(num_tokens, 1, generator=gen).to(dtype)
    residual = torch.randn(num_tokens, width, generator=gen).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    then = fused_moe.ThenNorm(residual, weight, 1e-6, multiply_in_float32)
    normed, stream = fused_moe.moe_combine(y, weights, ids, shared, gate, then_norm=then)
    out = fused_moe.moe_combine(y, weights, ids, shared, gate)
    want_normed, want_stream = fused_add_rms_norm(out, residual, weight, 1e-6, multiply_in_float32)
    assert torch.equal(stream, want_stream) and torch.equal(normed, want_normed)
