"""helios.kernels.router on CUDA at the published router shapes (qwen3_5_moe's 256 x 2048 bf16 table with its shared
gate, kimi_linear's 256 x 2304 float32 table read by bf16 rows): the logits within float32 rounding of the exact
products and of cuBLAS's F.linear, a row alone = batched bit for bit, the PDL launch = the plain one, and a CUDA
graph's replay = the eager launch."""

from __future__ import annotations

import pytest
import torch

from helios.kernels._triton import HAS_TRITON, interpret_mode, pdl_scope
from tests.kernels import router_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

F32, BF16 = torch.float32, torch.bfloat16
# (num_experts, hidden, x dtype, table dtype, logits dtype, a shared gate row)
SHAPES = {
    "qwen3_5_moe": (256, 2048, BF16, BF16, BF16, True),
    "kimi_linear": (256, 2304, BF16, F32, F32, False),
    "float32_model": (128, 2688, F32, F32, F32, False),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_the_logits_are_the_products_within_float32_rounding(shape, num_tokens):
    num_experts, hidden, x_dtype, w_dtype, out_dtype, with_gate = SHAPES[shape]
    x, weight, gate = router_cases.tables(num_experts, hidden, x_dtype, w_dtype, num_tokens, with_gate, "cuda")
    router_cases.check_against_exact(x, weight, gate, out_dtype)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_row_alone_and_batched_gives_the_same_bits(shape):
    num_experts, hidden, x_dtype, w_dtype, out_dtype, with_gate = SHAPES[shape]
    x, weight, gate = router_cases.tables(num_experts, hidden, x_dtype, w_dtype, 16, with_gate, "cuda", seed=3)
    router_cases.check_batch_invariant(x, weight, gate, out_dtype)


@pytest.mark.parametrize("shape", ["qwen3_5_moe", "kimi_linear"])
def test_the_pdl_launch_and_a_graph_replay_give_the_eager_bits(shape):
    from helios.kernels.router import router_logits

    num_experts, hidden, x_dtype, w_dtype, out_dtype, with_gate = SHAPES[shape]
    x, weight, gate = router_cases.tables(num_experts, hidden, x_dtype, w_dtype, 1, with_gate, "cuda", seed=5)
    want = router_logits(x, weight, gate, out_dtype)
    with pdl_scope(True):  # sm90+: programmatic dependent launch (the table's first chunk loads before the wait)
        got = router_logits(x, weight, gate, out_dtype)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and (gate is None or torch.equal(got[1], want[1]))
        static_x = x.clone()
        router_logits(static_x, weight, gate, out_dtype)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = router_logits(static_x, weight, gate, out_dtype)
    other = router_cases.tables(num_experts, hidden, x_dtype, w_dtype, 1, with_gate, "cuda", seed=6)[0]
    static_x.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    eager = router_logits(other, weight, gate, out_dtype)
    assert torch.equal(captured[0], eager[0]) and (gate is None or torch.equal(captured[1], eager[1]))
