"""Linear projections over core tensors stored in torch's [out_features, in_features] orientation.

Weights start on the meta device and are bound without a copy by `helios.models.bind_tensors`.
`linear` is the one matmul entry point: F.linear, oneDNN for float32 projections on the CPU, or
helios.kernels.gemv for one-row 16-bit products on a GPU (batch-1 decode) as the model's switches admit
(helios.switches: gemv, gemv_pdl; a Linear keeps the Switches it was built with).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from helios.kernels import gemv as gemv_kernels
from helios.switches import DEFAULT_SWITCHES, Switches


@functools.cache
def has_onednn_linear() -> bool:
    """oneDNN's float32 linear is built in and agrees with F.linear on a small case (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 16, generator=g), torch.randn(32, 16, generator=g)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), atol=1e-5, rtol=0))


def linear(
    x: torch.Tensor,  # [..., in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
    switches: Switches = DEFAULT_SWITCHES,
) -> torch.Tensor:  # [..., out]
    """y = x @ W^T (+ b). Float32 projections on the CPU go to oneDNN; one-row 16-bit GPU products to the GEMV
    where `switches.gemv` admits the weight's shape; everything else to F.linear.

    NOTE: oneDNN for every float32 CPU projection, because its bits do not depend on the thread count (it splits
    output columns over the threads, never the reduction): MKL's sgemm behind F.linear gives other bits at 1 and 2
    threads for 5-11 rows (torch 2.13, every projection shape of SmolLM2 and Qwen2.5-0.5B), and under load Intel
    OpenMP's dynamic teams change the thread count behind our back, so a busy machine changed logprobs (a
    clean-clone `make test`) and seeded samples. Speed: oneDNN splits the output columns over every thread (~1.7x
    on qkv, gate/up and lm_head, at batch 1, 8 and 512 alike, on the 2-core CI machine, where MKL ran a
    small-batch GEMV on one thread); for narrow outputs (o, down) it splits worse than MKL at batch 1, a cost we
    take for exact results (tests/runner/test_thread_invariance.py). Both accumulate in float32.
    """
    if weight.is_mkldnn:  # packed for oneDNN at load (pack_cpu_linears): 16-bit CPU projections
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if bias is None and gemv_kernels.gemv_serves(x, weight, switches.gemv):
        return gemv_kernels.gemv(x, weight, allow_pdl=switches.gemv_pdl)
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu" and has_onednn_linear():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


PACKED_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def has_onednn_packing(dtype: torch.dtype) -> bool:
    """oneDNN can pack a `dtype` weight and its product with the packed weight gives F.linear's bits on a small
    case (probed once per dtype)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 8), None, "none", [],
                                               "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(y, F.linear(x, w)))


def pack_cpu_weight(weight: torch.Tensor, rows_hint: int = 8) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout for `linear` (a copy), or `weight` itself when it is not a
    16-bit CPU tensor or oneDNN cannot pack it. `rows_hint`: the batch oneDNN picks the layout for.

    NOTE: F.linear of a 16-bit weight on the CPU reorders the plain [out, in] weight into oneDNN's blocked
    layout on every call, so a decode step read and wrote every weight once more before its product: a
    SmolLM2-135M bf16 step's projections took ~1.7x the packed ones' time (2-core EPYC with avx512_bf16,
    batch 1 and 8). The packed product gives the same bits as F.linear (probed: has_onednn_packing)."""
    if (weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2 or weight.is_mkldnn
            or not has_onednn_packing(weight.dtype)):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)


def pack_cpu_linears(model: nn.Module, rows_hint: int = 8) -> int:
    """Pack every `Linear` weight of a 16-bit CPU model for oneDNN (pack_cpu_weight), in place;
    a tied lm_head (the model's `lm_head` None beside an `embed`) gets a Linear of its own over a packed copy of
    the embedding (the lookup keeps the plain table). Returns the bytes packed (new memory: the plain weights
    stay mapped from the core but are no longer read)."""
    packed = 0
    for module in list(model.modules()):
        if isinstance(module, Linear) and module.weight.device.type != "meta":
            weight = pack_cpu_weight(module.weight, rows_hint)
            if weight is not module.weight:
                module.weight = nn.Parameter(weight, requires_grad=False)
                packed += weight.numel() * weight.element_size()
    embed = getattr(model, "embed", None)
    if packed and getattr(model, "lm_head", "absent") is None and isinstance(embed, Embedding):
        head = pack_cpu_weight(embed.weight, rows_hint)
        if head is not embed.weight:
            model.lm_head = Linear(head.shape[1], head.shape[0])
            model.lm_head.weight = nn.Parameter(head, requires_grad=False)
            packed += head.numel() * head.element_size()
    return packed


def one_row_gemv(device: torch.device | str, dtype: torch.dtype | None, switches: Switches, rows: int,
                 cols: int) -> bool:
    """Whether a one-row product with a [rows, cols] weight of `dtype` on `device` takes the GEMV under
    `switches` (what `linear` decides per call, decided once when a model picks its forward path)."""
    return (dtype is not None and gemv_kernels.gemv_available(device, dtype)
            and gemv_kernels.gemv_admits(switches.gemv, rows, cols))


class Linear(nn.Module):
    """y = x @ W^T (+ b); `weight` [out, in], optional `bias` [out]; `switches` pick its one-row GPU kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 switches: Switches = DEFAULT_SWITCHES):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.switches = switches
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return linear(x, self.weight, self.bias, self.switches)

    def serves_gemv(self, x: torch.Tensor) -> bool:  # x [1, in]
        """Whether `linear` sends x's product with this weight to the GEMV (one row on the GPU path)."""
        return self.bias is None and gemv_kernels.gemv_serves(x, self.weight, self.switches.gemv)


class Embedding(nn.Module):
    """Token embedding table `weight` [vocab, hidden]; also serves as the tied lm_head."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device="meta"), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(token_ids, self.weight)


def meta_parameter(*shape: int) -> nn.Parameter:
    """A parameter on the meta device, bound later from the core (never allocated here)."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Stacked(nn.Module):
    """A bare weight of any shape under the name `weight`: stacked MoE experts [E, out, in], a conv's taps [C, K],
    a gated norm's multiplier [d]."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = meta_parameter(*shape)
