"""Checks of helios.kernels.router, shared by tests/kernels/test_router.py (the interpreter) and
tests/gpu/test_router_cuda.py (CUDA): the logits against the exact (float64) products within float32 rounding,
against the torch path's F.linear, and a row's logits alone = batched bit for bit."""

from __future__ import annotations

import torch

from helios.kernels import router


def tables(num_experts: int, hidden: int, x_dtype: torch.dtype, w_dtype: torch.dtype, num_tokens: int,
           with_gate: bool, device: str = "cpu", seed: int = 0):
    """(x [T, H], weight [E, H], gate_weight [1, H] or None): O(1) activations, rows scaled by 1/sqrt(H)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g, device=device).to(x_dtype)
    weight = (torch.randn(num_experts, hidden, generator=g, device=device) / hidden ** 0.5).to(w_dtype)
    gate = (torch.randn(1, hidden, generator=g, device=device) / hidden ** 0.5).to(w_dtype) if with_gate else None
    return x, weight, gate


def check_against_exact(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None,
                        out_dtype: torch.dtype) -> None:
    """Each logit within float32 summation error of the float64 product (and one rounding to a 16-bit out_dtype),
    as close as the torch path's F.linear is; the gate's logit likewise."""
    logits, gate_logit = router.router_logits(x, weight, gate, out_dtype)
    assert logits.dtype == out_dtype and logits.shape == (x.shape[0], weight.shape[0])
    assert (gate_logit is None) == (gate is None)
    full = weight if gate is None else torch.cat([weight, gate])
    got = logits if gate is None else torch.cat([logits, gate_logit], dim=1)
    exact = x.double() @ full.double().T
    scale = x.double().abs() @ full.double().abs().T  # sum |x_i w_i|: what float32 summation error scales with
    # NOTE: 2^-24 per add is the worst case of a sequential sum over H; the kernel's is ~H/BLOCK_K + log2(BLOCK_K)
    # adds deep, so a bound of H ulps of the magnitude sum is loose but still catches a wrong product or index
    bound = scale * x.shape[1] * 2.0 ** -24
    if out_dtype != torch.float32:  # plus one rounding to the 16-bit dtype: half an ulp of the float32 sum
        bound = bound + (exact.abs() + bound) * torch.finfo(out_dtype).eps / 2
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"error / bound up to {(err / bound).max().item():.3g}"
    ref = router.router_logits_ref(x, weight, gate, out_dtype)
    want = ref[0] if gate is None else torch.cat(ref, dim=1)
    assert ((want.double() - exact).abs() <= bound).all()  # the torch path is as close: the bound is not loose
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale.max().item())
    else:  # the same 16-bit value but where the float32 sums round to either side of a tie
        assert (got != want).float().mean() < 0.02
        torch.testing.assert_close(got.float(), want.float(), rtol=torch.finfo(out_dtype).eps, atol=0)


def check_batch_invariant(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None,
                          out_dtype: torch.dtype) -> None:
    """Every row of every batch of 1 to MAX_ROWS rows (the last rows of x: each row at another offset) = that row
    alone, bit for bit; a batch padded with zero rows (a graph bucket's padding) changes no real row."""
    alone = [router.router_logits(x[i:i + 1], weight, gate, out_dtype) for i in range(x.shape[0])]
    for num_rows in range(1, x.shape[0] + 1):
        batch = router.router_logits(x[-num_rows:], weight, gate, out_dtype)
        for j in range(num_rows):
            i = x.shape[0] - num_rows + j
            assert torch.equal(batch[0][j], alone[i][0][0]), (num_rows, j)
            assert gate is None or torch.equal(batch[1][j], alone[i][1][0]), (num_rows, j)
    padded = torch.cat([x[:2], torch.zeros(3, x.shape[1], dtype=x.dtype, device=x.device)])
    got = router.router_logits(padded, weight, gate, out_dtype)
    assert torch.equal(got[0][:2], torch.cat([alone[0][0], alone[1][0]]))
