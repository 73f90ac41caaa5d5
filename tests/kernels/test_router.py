"""helios.kernels.router in Triton's CPU interpreter: the logits (and a shared expert gate's) within float32 rounding
of the exact products and of the torch path, a row's logits alone = batched bit for bit, and the MoE layers' fused
path taking it for decode rows only."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

from helios.core.manifest import MoeConfig  # noqa: E402
from helios.kernels import router  # noqa: E402  (after the interpreter check: kernels decorate on import)
from helios.layers.linear import Linear, linear  # noqa: E402
from helios.layers.moe import SigmoidMoe, SparseMoe  # noqa: E402
from tests.kernels import router_cases  # noqa: E402
from tests.kernels.moe_cases import bind_random, inputs, sigmoid_config  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


# E and H cross the tiles' edges: 8 experts one a program, 300 four a program (the gate's program after the last,
# partial, tile); H below one chunk, and three 16-bit chunks with a tail
@pytest.mark.parametrize("num_experts, hidden, x_dtype, w_dtype, out_dtype, with_gate", [
    (8, 96, F32, F32, F32, False),  # a float32 model
    (300, 200, BF16, F32, F32, False),  # SigmoidMoe: 16-bit x, the float32 table bound by _Router
    (8, 1100, BF16, BF16, BF16, True),  # qwen3_5_moe: a 16-bit router and shared gate, 16-bit logits
    (300, 96, F32, F32, F32, True),
])
def test_the_logits_are_the_products_within_float32_rounding(num_experts, hidden, x_dtype, w_dtype, out_dtype,
                                                             with_gate):
    x, weight, gate = router_cases.tables(num_experts, hidden, x_dtype, w_dtype, 3, with_gate)
    router_cases.check_against_exact(x, weight, gate, out_dtype)


@pytest.mark.parametrize("w_dtype, with_gate", [(F32, False), (BF16, True)])
def test_a_row_alone_and_batched_gives_the_same_bits(w_dtype, with_gate):
    x, weight, gate = router_cases.tables(20, 300, BF16, w_dtype, 6, with_gate, seed=3)
    router_cases.check_batch_invariant(x, weight, gate, F32 if w_dtype == F32 else BF16)


def test_the_config_reads_the_table_never_the_batch():
    assert router.router_config(256, 2304, F32) == (2, 256, 4)  # 129 programs a row with a gate, 1 KB a row chunk
    assert router.router_config(256, 2048, BF16) == (2, 512, 4)
    assert router.router_config(16, 64, F32) == (1, 64, 1)


def test_decode_rows_only():
    weight = torch.zeros(8, 32)
    assert router.router_serves(torch.zeros(1, 32), weight)
    assert router.router_serves(torch.zeros(router.MAX_ROWS, 32), weight)
    assert not router.router_serves(torch.zeros(router.MAX_ROWS + 1, 32), weight)  # a prefill: F.linear's GEMM
    assert not router.router_serves(torch.zeros(0, 32), weight)
    assert not router.router_serves(torch.zeros(2, 64)[:, ::2], weight)  # strided columns


HIDDEN = 48


@pytest.mark.parametrize("num_tokens", [1, 3, router.MAX_ROWS + 1])
@pytest.mark.parametrize("x_dtype", [F32, BF16])
def test_sigmoid_moe_takes_the_kernel_on_its_fused_path_for_decode_rows(num_tokens, x_dtype):
    moe = sigmoid_config()
    layers = [SigmoidMoe(HIDDEN, moe, "silu", fused=f) for f in (False, True)]
    bind_random(layers, 0, x_dtype)
    for layer in layers:  # bound in float32 whatever the core's dtype, as bind_tensors binds it (_Router)
        layer.router.weight = torch.nn.Parameter(layer.router.weight.float(), requires_grad=False)
    x = inputs(num_tokens, HIDDEN, x_dtype)
    want = linear(x.float(), layers[0].router.weight)
    assert torch.equal(layers[0].router_logits(x), want)  # the torch path as it was
    got = layers[1].router_logits(x)
    assert got.dtype == F32
    if num_tokens > router.MAX_ROWS:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, router.router_logits(x, layers[1].router.weight)[0])


@pytest.mark.parametrize("num_tokens", [1, router.MAX_ROWS + 1])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_sparse_moe_gives_the_router_and_the_shared_gate_in_one_launch(num_tokens, dtype):
    layers = [SparseMoe(HIDDEN, 8, 16, 2, True, fused=f) for f in (False, True)]
    for layer in layers:
        layer.shared_gate = Linear(HIDDEN, 1)
    bind_random(layers, 0, dtype)
    x = inputs(num_tokens, HIDDEN, dtype)
    want = (layers[0].router(x), layers[0].shared_gate(x))
    plain = layers[0].router_logits(x, layers[0].shared_gate)
    assert torch.equal(plain[0], want[0]) and torch.equal(plain[1], want[1])
    logits, gate = layers[1].router_logits(x, layers[1].shared_gate)
    assert logits.dtype == gate.dtype == dtype and gate.shape == (num_tokens, 1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == F32 else dict(rtol=2 ** -7, atol=0)
    torch.testing.assert_close(logits, want[0], **tol)
    torch.testing.assert_close(gate, want[1], **tol)
    assert torch.equal(layers[1].router_logits(x)[0], logits)  # the gate's row changes no router logit


@pytest.mark.parametrize("num_experts, x_dtype, w_dtype, out_dtype, with_gate, routing", [
    (300, BF16, F32, F32, False, dict(top_k=4, scoring="sigmoid", num_groups=4, num_topk_groups=2, renorm=True,
                                      scaling=2.5, bias=True)),  # SigmoidMoe: groups, bias, scaling
    (8, BF16, BF16, BF16, True, dict(top_k=2, renorm=True, weights_dtype=BF16)),  # qwen3_5_moe's, with its gate
    (64, F32, F32, F32, False, dict(top_k=6, scoring="sqrtsoftplus", renorm=True)),
])
def test_the_launch_routes_as_moe_route_routes_its_logits(num_experts, x_dtype, w_dtype, out_dtype, with_gate,
                                                          routing):
    """router_logits with a Routing: the row's last program routes it, giving moe_route's weights and ids over the
    same stored logits, bit for bit, at every row of a batch; the logits and gate unchanged; the arrival counters
    back at zero after each launch."""
    from helios.kernels import fused_moe
    from helios.kernels._triton import arrival_counters

    x, weight, gate = router_cases.tables(num_experts, 96, x_dtype, w_dtype, 5, with_gate, seed=4)
    bias = 0.1 * torch.randn(num_experts, generator=torch.Generator().manual_seed(5)) if routing.pop("bias", 0) else None
    spec = router.Routing(score_bias=bias, **routing)
    for rows in (x[:1], x):
        logits, gate_logit, weights, ids = router.router_logits(rows, weight, gate, out_dtype, routing=spec)
        plain = router.router_logits(rows, weight, gate, out_dtype)
        assert torch.equal(logits, plain[0]) and (gate is None or torch.equal(gate_logit, plain[1]))
        want_weights, want_ids = fused_moe.moe_route(logits, spec.top_k, spec.scoring, bias, spec.num_groups,
                                                     spec.num_topk_groups, spec.renorm, spec.scaling,
                                                     spec.weights_dtype)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
        assert not arrival_counters(x.device, "router")[:8].any()
