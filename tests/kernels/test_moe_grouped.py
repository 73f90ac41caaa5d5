"""helios.kernels.moe_grouped (the routed experts through torch's grouped GEMM) on the CPU, the activation kernels in
Triton's interpreter: the products fused_moe.expert_outputs_ref computes, in entry order, for every activation and
with experts that got no entry; and which operands it serves (prompt-sized bf16 batches on sm90+ only)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

from helios.kernels import fused_moe, moe_grouped  # noqa: E402  (after the interpreter check)

HIDDEN, INTER, EXPERTS = 32, 16, 8
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def weights(act: str, dtype: torch.dtype, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    rows = INTER if act == "relu2" else 2 * INTER
    w_in = (torch.randn(EXPERTS, rows, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5).to(dtype)
    return w_in, w_down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act, limit, clamp_after_act, alpha", [
    ("silu", None, False, None), ("gelu_tanh", 0.5, True, None), ("silu", 0.7, False, 1.702), ("relu2", None, False,
                                                                                              None)])
def test_grouped_outputs_are_the_reference_products_in_entry_order(dtype, act, limit, clamp_after_act, alpha):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, HIDDEN, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS - 2, generator=g)[:3] for _ in range(37)]).to(torch.int32)  # 6, 7 idle
    w_in, w_down = weights(act, dtype)
    got = moe_grouped.expert_outputs_grouped(x, ids, w_in, w_down, act, limit, clamp_after_act, alpha)
    want = fused_moe.expert_outputs_ref(x, ids, w_in, w_down, act, limit, clamp_after_act, alpha)
    assert got.shape == (37 * 3, HIDDEN) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_the_order_is_stable_by_expert_and_the_ends_count_each_expert():
    ids = torch.tensor([[3, 0], [0, 3], [5, 0]], dtype=torch.int32)
    order, ends = moe_grouped.expert_order(ids, 6)
    assert order.tolist() == [1, 2, 5, 0, 3, 4]  # expert 0: entries 1, 2, 5; expert 3: 0, 3; expert 5: 4
    assert ends.tolist() == [3, 3, 3, 5, 5, 6] and ends.dtype == torch.int32


def test_only_prompt_sized_bf16_batches_on_a_gpu_are_served():
    w_in, w_down = weights("silu", torch.bfloat16)
    x = torch.zeros(2048, HIDDEN, dtype=torch.bfloat16)
    assert not moe_grouped.grouped_serves(x, w_in, w_down, 2048 * 8)  # a CPU tensor
    assert not moe_grouped.grouped_serves(x, w_in, w_down, moe_grouped.MIN_ENTRIES - 1)
