"""The Triton backend's RMSNorms (helios.layers.norm.use_norm_kernels): a model built for that backend runs every
norm through helios.kernels.rmsnorm, one launch where torch's ops are five (a decode graph's kernel count is what a
batch-1 step on the GPU pays for: benchmarks/decode_launches.py), with torch's values; where the kernel's output
dtype would not be torch's (a float32 multiplier on 16-bit rows, multiplied in the rows' dtype), torch's ops stay.
The kernels run in Triton's interpreter here."""

from __future__ import annotations

import pytest
import torch

from helios.layers.norm import RMSNorm
from helios.runner.model_runner import ModelRunner
from tests.kernels.interpreter import require_interpreter
from tests.models.hybrid_harness import PAGE_SIZE, export_float32, prompt
from tests.models.mimo_v2_flash_tiny import build_mimo


def norm(dim: int, dtype: torch.dtype, multiply_in_float32: bool = False, weight_dtype=None) -> RMSNorm:
    module = RMSNorm(dim, 1e-6, multiply_in_float32)
    gen = torch.Generator().manual_seed(dim)
    module.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(dim, generator=gen)).to(weight_dtype or dtype),
                                       requires_grad=False)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("multiply_in_float32", [False, True])
def test_the_kernel_gives_torchs_norm(dtype, multiply_in_float32):
    require_interpreter()
    module = norm(96, dtype, multiply_in_float32)
    x = torch.randn(5, 3, 2 * 96, generator=torch.Generator().manual_seed(1)).to(dtype)[..., :96]  # strided rows
    want = module(x)
    module.kernel = True
    got = module(x)
    assert got.dtype == want.dtype == dtype
    # the kernel sums the squares in another order: float32 within rounding; 16-bit outputs within two roundings
    # (the interpreter's cast to bf16 truncates)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -6)
    torch.testing.assert_close(got, want, **tol)


def test_a_float32_multiplier_on_16_bit_rows_keeps_torchs_float32_product():
    module = norm(64, torch.bfloat16, weight_dtype=torch.float32)
    module.kernel = True
    x = torch.randn(4, 64).bfloat16()
    assert not module._kernel_takes(x)
    assert module(x).dtype == torch.float32  # weight * h.to(bf16) promotes, as HF's norm does


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    from transformers import MiMoV2FlashForCausalLM

    root = tmp_path_factory.mktemp("norm-kernels")
    return export_float32(MiMoV2FlashForCausalLM, build_mimo(root / "hf"), root)[1]


def test_a_model_on_the_triton_backend_runs_every_norm_as_the_kernel_with_torchs_logits(mimo):
    """mimo_v2_flash (no fused layer loop of its own: its block norms, q/k-free attention and final norm are plain
    RMSNorms): on the Triton backend each norm is the kernel; float32 logits of every position = the torch
    backend's within the parity bound."""
    require_interpreter()
    arch = mimo.manifest.arch
    runners = {name: ModelRunner(arch, mimo.tensors, 16, PAGE_SIZE, attention_backend=name)
               for name in ("torch", "triton")}
    norms = {name: [m for m in r.model.modules() if isinstance(m, RMSNorm)] for name, r in runners.items()}
    assert len(norms["triton"]) == 2 * arch.num_layers + 1
    assert all(m.kernel for m in norms["triton"]) and not any(m.kernel for m in norms["torch"])
    ids = prompt(12, seed=5)
    torch.testing.assert_close(runners["triton"].forward_logits(ids), runners["torch"].forward_logits(ids),
                               atol=1e-4, rtol=1e-4)
