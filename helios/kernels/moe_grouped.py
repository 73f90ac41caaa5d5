"""The routed experts' two GEMMs for prompt-sized batches through torch's grouped GEMM (`torch._grouped_mm`: CUTLASS
on sm90+), in place of helios.kernels.fused_moe's Triton grouped GEMM, which reaches ~26% of the bf16 matmul rate
on an H200 at every tile (benchmarks/RESULTS.md, session 17): entries sorted by expert (a stable sort, so within an
expert they keep their order), x's rows gathered in that order, gate_up as one grouped GEMM, the activation kernel
(helios.kernels.activation, or relu2) on its [gate | up] rows, down as a second grouped GEMM, the rows put back in
entry order. Same result layout as fused_moe.expert_outputs: [T*k, W], entry token * k + slot.
Numerics: each product is one float32-accumulated dot rounded to the model dtype, as the Triton kernel's epilogue
rounds gate and up before the activation; on an H100 the two gave the same bits at three published shapes
(benchmarks/gpu_moe_prefill.py, session 18). No host sync: every size comes from shapes.
Imports torch and helios.kernels only (fused_moe's sort by expert; the activation kernels when it runs).
"""

from __future__ import annotations

import torch

from helios.kernels.fused_moe import sort_by_expert

# from this many (token, slot) entries fused_moe takes its prompt-sized tiles (gemm_config): the batches served here
MIN_ENTRIES = 1025


def grouped_serves(x: torch.Tensor, w_in: torch.Tensor, w_down: torch.Tensor, num_entries: int) -> bool:
    """Whether expert_outputs_grouped serves these operands on this device: a prompt-sized batch of 16-bit rows
    on a CUDA device of compute capability 9.0 or more (torch's grouped GEMM kernels), widths that keep every row
    16-byte aligned."""
    if num_entries < MIN_ENTRIES or not x.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype != torch.bfloat16 or w_in.dtype != x.dtype or w_down.dtype != x.dtype:
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(size % 8 == 0 for size in (*w_in.shape[1:], *w_down.shape[1:]))


def expert_order(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries sorted by expert (stable: entry order within an expert) [N] int64, and each expert's end in that
    order [E] int32 (the grouped GEMM's offsets; an expert with no entry repeats the previous end)."""
    _, order, counts = sort_by_expert(topk_ids, num_experts)
    return order, counts.cumsum(0).to(torch.int32)


def _activation(h: torch.Tensor, act: str, limit: float | None, clamp_after_act: bool,
                alpha: float | None) -> torch.Tensor:
    if act == "relu2":
        from helios.kernels.relu2 import relu2

        return relu2(h)
    from helios.kernels import activation

    assert act in ("silu", "gelu_tanh"), act
    return getattr(activation, f"{act}_and_mul")(h, limit, clamp_after_act, alpha)  # as GatedMLP's fused path


def expert_outputs_grouped(
    x: torch.Tensor,  # [T, W]
    topk_ids: torch.Tensor,  # [T, k]
    w_in: torch.Tensor,  # [E, 2*F, W] gate_up (gated act) or [E, F, W] up (relu2)
    w_down: torch.Tensor,  # [E, W, F]
    act: str,
    limit: float | None = None,
    clamp_after_act: bool = False,
    alpha: float | None = None,
) -> torch.Tensor:  # [T*k, W] in x's dtype, entry token * k + slot
    """fused_moe.expert_outputs by two grouped GEMMs over the entries sorted by expert (see the module's doc)."""
    top_k, num_entries = topk_ids.shape[1], topk_ids.numel()
    if num_entries == 0:
        return x.new_empty(0, w_down.shape[1])
    order, ends = expert_order(topk_ids, w_in.shape[0])
    rows = x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))  # [N, W], by expert
    h = torch._grouped_mm(rows, w_in.transpose(1, 2), offs=ends)  # [N, 2F] or [N, F]
    y = torch._grouped_mm(_activation(h, act, limit, clamp_after_act, alpha), w_down.transpose(1, 2), offs=ends)
    return torch.empty_like(y).index_copy_(0, order, y)
