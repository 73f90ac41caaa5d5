"""step3p7's fused path (each residual add in its norm's launch, the clamped MLPs' one act-and-mul launch: the
Triton backend's layer kernels) = its eager torch path through a prefill and a decode step: float32 within rounding;
bf16 within an ulp here (the norm kernels' 16-bit conversions truncate in the interpreter: the torch-path norm kernel
alone differs as much) and on CUDA (tests/gpu/test_mlp_folds_cuda.py: the act's exp on the device)."""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import Architecture
from helios.layers.attention import TorchAttentionBackend

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ARCH = Architecture(
    family="step3p7", hidden_size=64, num_heads=4, head_dim=16, num_kv_heads=2, intermediate_size=80, num_layers=2,
    vocab_size=97, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=False,
    qk_norm=True, attn_output_gate=True, attn_gate_per_head=True, sliding_window=4, rope_local_theta=1e4,
    layer_types=["sliding", "full"], swiglu_limits_shared=[7.0, 0.4],
)


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _model(device: str, dtype: torch.dtype, fused: bool):
    from helios.models import bind_tensors, use_layer_kernels
    from helios.models.step3p7 import Step3p7ForCausalLM

    model = Step3p7ForCausalLM(ARCH, TorchAttentionBackend(), device)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in model.named_parameters():
        t = torch.randn(tuple(p.shape), generator=g)
        tensors[name] = (1.0 + 0.1 * t if "norm" in name else 0.3 * t).to(device=device, dtype=dtype)
    bind_tensors(model, tensors, device)
    model.is_fused = fused  # what the Triton backend sets; attention stays on the torch backend on both sides
    use_layer_kernels(model, fused)
    return model.eval()


def check_fused_step(device: str, dtype: torch.dtype, exact_bf16: bool) -> None:
    from helios.engine.messages import ScheduledRequest
    from helios.runner.input_batch import prepare_batch

    page_size = 4
    models = {"torch": _model(device, dtype, False), "fused": _model(device, dtype, True)}
    shape = (2, 16, page_size, ARCH.num_kv_heads, ARCH.head_dim)
    caches = {k: [torch.zeros(shape, dtype=dtype, device=device) for _ in range(ARCH.num_layers)] for k in models}
    steps = [
        [ScheduledRequest(req_id="a", token_ids=list(range(3, 12)), num_computed_tokens=0, block_ids=[7, 2, 9],
                          sample=True)],
        [ScheduledRequest(req_id="a", token_ids=[40], num_computed_tokens=9, block_ids=[7, 2, 9], sample=True)],
    ]
    with torch.inference_mode():
        for scheduled in steps:
            batch = prepare_batch(scheduled, {}, page_size, device)
            hidden = {k: m.forward(batch.token_ids, batch.meta, caches[k]) for k, m in models.items()}
            if dtype == torch.float32:
                torch.testing.assert_close(hidden["fused"], hidden["torch"], atol=1e-5, rtol=1e-5)
            elif exact_bf16:
                assert torch.equal(hidden["fused"], hidden["torch"])
            else:
                torch.testing.assert_close(hidden["fused"], hidden["torch"], atol=2 ** -4, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_step_equals_the_torch_path(interpreter, dtype):
    check_fused_step("cpu", dtype, exact_bf16=False)
