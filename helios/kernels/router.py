"""The MoE router's logits of a decode step in one launch: `router_logits`, a GEMV over the router's [E, H] table
and, where the layer has one, a shared expert's gate row [1, H], accumulated in float32.

It replaces x.float() + F.linear (the float32 routers of helios.layers.moe.SigmoidMoe) or the router's and the
gate's two projections (qwen3_5's SharedExpertMoe) on the fused path: one launch where a graphed batch-1 step had
two or three. With a Routing, the same launch also routes: the last program of each row to finish (an arrival
counter, as helios.kernels.decode_qkv's merge) runs fused_moe.moe_route's program over the row's stored logits, so
the routing's launch is gone too. Imports torch and helios.kernels (_triton, fused_moe's route_row) only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from helios.kernels._triton import (
    HAS_TRITON,
    arrival_counters,
    cdiv,
    check_last_dim_contiguous,
    interpret_mode,
    jit,
    next_power_of_2,
    on_gpu,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    round_to,
    tl,
    use_pdl,
)
from helios.kernels.fused_moe import SCORINGS, route_row

# rows (tokens) a launch serves: one program per (row, tile) reads its tile of the table again for every row, so
# past small decode batches F.linear's GEMM is the better product. NOTE: not measured on a GPU yet; the batch-1 row
# is the one the kernel is for (the graphed step's gaps, issues 20/21)
MAX_ROWS = 16
_TARGET_PROGRAMS = 128  # programs a row at least where the table has the rows: ~one per SM of an H100 / H200


@jit
def _router_kernel(
    x_ptr,  # [M, H], 16-bit or float32
    w_ptr,  # [E, H] the router's table, any float dtype
    gate_w_ptr,  # [1, H] the shared expert's gate row, w's dtype (read when num_rows is E + 1)
    out_ptr,  # [M, num_rows] contiguous: the router's logits, then the gate's
    num_experts,
    num_rows,  # E, or E + 1 with a gate row
    hidden,
    stride_xm,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    # ROUTE: the row's last program to arrive at counter_ptr[m] routes it (fused_moe.route_row over the stored logits)
    ROUTE: tl.constexpr = False,
    counter_ptr=None,  # [>= M] int32, zero
    num_programs=1,  # programs a row
    bias_ptr=None,  # [E] float32 score bias (read with HAS_BIAS)
    weights_ptr=None,  # [M, TOP_K] out
    ids_ptr=None,  # [M, TOP_K] int32 out
    renorm_eps=0.0,
    scaling=1.0,
    TOP_K: tl.constexpr = 1,
    K_POW2: tl.constexpr = 1,
    SCORING: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False,
    NUM_GROUPS: tl.constexpr = 1,
    G_POW2: tl.constexpr = 1,
    TOPK_GROUPS: tl.constexpr = 1,
    RENORM: tl.constexpr = False,
    BLOCK_E: tl.constexpr = 1,
):
    m = tl.program_id(1).to(tl.int64)
    first = tl.program_id(0) * BLOCK_N
    # the program past the table's tiles takes the gate's row, through its own pointer (no [E + 1, H] copy)
    if first < num_experts:
        base = w_ptr + first.to(tl.int64) * stride_wn
        count = num_experts - first
    else:
        base = gate_w_ptr
        count = num_rows - num_experts
    local = tl.arange(0, BLOCK_N)
    row_mask = local < count
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = base + local.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_row = x_ptr + m * stride_xm
    # the table is constant: its first chunk is in flight before the wait on the kernel that wrote x
    w_next = tl.load(w_rows + offs_k[None, :], mask=row_mask[:, None] & (offs_k < hidden)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    # NOTE: each lane sums its columns in chunk order, then one tree over the lanes: the order depends on
    # (E, H, dtype) through BLOCK_N / BLOCK_K only, never on M, so a row's logits are the same alone or batched
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        w = w_next
        cols = k + offs_k
        nxt = cols + BLOCK_K
        w_next = tl.load(w_rows + nxt[None, :], mask=row_mask[:, None] & (nxt < hidden)[None, :], other=0.0)
        x = tl.load(x_row + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    pdl_launch_dependents(USE_PDL)
    logits = round_to(tl.sum(acc, axis=1), out_ptr.dtype.element_ty)  # to nearest, then an exact store
    out_cols = tl.minimum(first, num_experts) + local  # the gate's program writes column E
    tl.store(out_ptr + m * num_rows + out_cols, logits.to(out_ptr.dtype.element_ty), mask=row_mask)
    if ROUTE:
        # every thread's logit stores are issued before the one release; the last to arrive acquires them
        tl.debug_barrier()
        counter = counter_ptr + m
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_programs - 1:
            route_row(out_ptr + m * num_rows, bias_ptr, ids_ptr + m * TOP_K, weights_ptr + m * TOP_K,
                      ids_ptr + m * TOP_K, num_experts, renorm_eps, scaling, TOP_K, K_POW2, SCORING, HAS_BIAS, False,
                      NUM_GROUPS, G_POW2, TOPK_GROUPS, RENORM, BLOCK_E, True)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch


def router_config(num_experts: int, hidden: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) from the table's shape and dtype alone (never the batch: see the kernel's
    NOTE). 1 KB of each table row a chunk (16-byte loads), and tiles narrow enough for ~_TARGET_PROGRAMS
    programs a row: a 256-expert table is 2 rows a program."""
    block_k = min(1024 // dtype.itemsize, next_power_of_2(hidden))
    block_n = max(1, min(8, next_power_of_2(num_experts) // _TARGET_PROGRAMS))
    num_warps = max(1, min(4, block_n * block_k * dtype.itemsize // 512))  # 16 bytes a thread a chunk
    return block_n, block_k, num_warps


def router_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether router_logits takes this product: 1 to MAX_ROWS rows (decode) with contiguous last dims, on a GPU
    (or meta while helios.kernels.aot traces a model) or in Triton's interpreter."""
    if not (HAS_TRITON and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and not weight.is_mkldnn):
        return False  # NOTE: first: a table packed for oneDNN (helios.layers.linear) has no strides to ask
    return x.stride(-1) == 1 and weight.stride(-1) == 1 and (on_gpu(x) or interpret_mode())


class Routing(NamedTuple):
    """fused_moe.moe_route's arguments (no given ids) for router_logits to route in its launch."""

    top_k: int
    scoring: str = "softmax"
    score_bias: torch.Tensor | None = None  # [E] float32
    num_groups: int = 1
    num_topk_groups: int = 1
    renorm: bool = False
    scaling: float = 1.0
    weights_dtype: torch.dtype = torch.float32


def router_logits(
    x: torch.Tensor,  # [M, H], small M
    weight: torch.Tensor,  # [E, H]
    gate_weight: torch.Tensor | None = None,  # [1, H] in weight's dtype: a shared expert's gate
    out_dtype: torch.dtype = torch.float32,
    routing: Routing | None = None,
) -> tuple:  # logits [M, E], gate logit [M, 1] (None without gate_weight); with routing + (weights, ids) [M, k]
    """x @ weight.T (and x @ gate_weight.T) in one launch: each product of x's and the table's values taken in
    float32, summed in float32, rounded once to out_dtype; F.linear(x.float(), weight.float()) to float32 rounding
    (router_logits_ref). The two outputs are views of one [M, E + 1] buffer. routing: the launch also routes each
    row as fused_moe.moe_route routes the logits it stored (the same weights and ids)."""
    require_triton()
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (
        f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if gate_weight is not None:
        assert gate_weight.shape == (1, weight.shape[1]) and gate_weight.dtype == weight.dtype, (
            f"gate_weight {tuple(gate_weight.shape)} {gate_weight.dtype}, weight {weight.dtype}")
        check_last_dim_contiguous("gate_weight", gate_weight)
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    num_rows = num_experts + (gate_weight is not None)
    out = torch.empty(num_tokens, num_rows, dtype=out_dtype, device=x.device)
    route_args, routed = {}, ()
    if routing is not None:
        r = routing
        assert num_experts % r.num_groups == 0 and r.num_topk_groups <= r.num_groups and r.top_k <= num_experts
        weights = torch.empty(num_tokens, r.top_k, dtype=r.weights_dtype, device=x.device)
        ids = torch.empty(num_tokens, r.top_k, dtype=torch.int32, device=x.device)
        routed = (weights, ids)
    if num_tokens > 0:
        block_n, block_k, num_warps = router_config(num_experts, hidden, weight.dtype)
        num_programs = cdiv(num_experts, block_n) + num_rows - num_experts
        if routing is not None:
            route_args = dict(
                ROUTE=True, counter_ptr=arrival_counters(x.device, "router"), num_programs=num_programs,
                bias_ptr=r.score_bias if r.score_bias is not None else out, weights_ptr=weights, ids_ptr=ids,
                renorm_eps=0.0 if r.scoring == "softmax" else 1e-20, scaling=float(r.scaling), TOP_K=r.top_k,
                K_POW2=next_power_of_2(r.top_k), SCORING=SCORINGS[r.scoring], HAS_BIAS=r.score_bias is not None,
                NUM_GROUPS=r.num_groups, G_POW2=next_power_of_2(r.num_groups), TOPK_GROUPS=r.num_topk_groups,
                RENORM=r.renorm, BLOCK_E=next_power_of_2(num_experts))
        pdl = use_pdl(x, num_tokens)
        _router_kernel[(num_programs, num_tokens)](
            x, weight, gate_weight if gate_weight is not None else weight, out, num_experts, num_rows, hidden,
            x.stride(0), weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=pdl, num_warps=num_warps,
            launch_pdl=pdl, **route_args)
    return (out[:, :num_experts], (out[:, num_experts:] if gate_weight is not None else None), *routed)


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor, gate_weight: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """router_logits in torch: F.linear in float32, one rounding to out_dtype."""
    logits = F.linear(x.float(), weight.float()).to(out_dtype)
    gate = None if gate_weight is None else F.linear(x.float(), gate_weight.float()).to(out_dtype)
    return logits, gate
