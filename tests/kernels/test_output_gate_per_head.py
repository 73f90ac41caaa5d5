"""helios.kernels.output_gate.sigmoid_gate per head (step3p7's output gate) = helios.layers.attention's torch ops: float32 within
rounding, bf16 bit for bit (Triton interpreter here; on CUDA, tests/gpu/test_mlp_folds_cuda.py, where the
kernel's exp and torch's may differ in float32's last bits, off by one bf16 ulp on at most max_flips)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.usefixtures("interpreter")]


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def check_head_gate(device: str, dtype: torch.dtype, num_tokens: int = 3, num_heads: int = 12, head_dim: int = 128,
                    max_flips: float = 0.0) -> None:
    from helios.kernels.output_gate import sigmoid_gate, sigmoid_gate_ref

    g = torch.Generator().manual_seed(0)
    width = num_heads * head_dim
    o = (torch.randn(num_tokens, width, generator=g) * 3.0).to(device=device, dtype=dtype)
    # the gate: the last num_heads values of a wider qkv row, as the attention reads them
    qkv = (torch.randn(num_tokens, 40 + num_heads, generator=g) * 4.0).to(device=device, dtype=dtype)
    gate = qkv[:, -num_heads:]
    got, want = sigmoid_gate(o, gate), sigmoid_gate_ref(o, gate)
    assert got.dtype == dtype and got.shape == o.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
        return
    diff = got != want
    assert diff.float().mean().item() <= max_flips, f"{int(diff.sum())} of {diff.numel()} differ"
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_gate_matches_the_torch_path(dtype):
    check_head_gate("cpu", dtype)
