"""deepseek_v4 on the GPU: the tiny random checkpoint (tests/models/deepseek_v4_tiny.py: sliding, CSA and HCA layers,
hash-routed and score-routed experts, mHC streams) exported in float32 and bfloat16, run by the CUDA runner (its
attention is helios.layers.compressed_attention's torch ops on the device; MoE keeps CUDA graphs off) through the
engine with the raw rows in the window page group: float32 greedy tokens = HF transformers' generate on the device;
16 batched = alone in both dtypes."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.engine_core import EngineCore
from helios.kernels._triton import HAS_TRITON, interpret_mode
from tests.models.deepseek_v4_tiny import build_deepseek_v4
from tests.models.hybrid_harness import generate, greedy_request, prompt, window_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from ignition.export import ExportOptions, export_core

    root = tmp_path_factory.mktemp("deepseek_v4")
    src = build_deepseek_v4(root / "hf")
    return src, {name: load_core(export_core(src, root / name, ExportOptions(dtype=name))) for name in DTYPES}


def cuda_engine(core, **kw) -> EngineCore:
    """The raw rows in the window page group (room for every request's window and chunk), as compose builds it."""
    return window_engine(core, num_pages=512, device="cuda", prefix_caching=False, **kw)


def test_greedy_matches_transformers_on_the_gpu_in_float32(exported):
    """32 greedy tokens of a 150-token prompt (window 8, CSA keeping 3 entries) = HF generate on the device."""
    from transformers import DeepseekV4ForCausalLM

    src, cores = exported
    hf = DeepseekV4ForCausalLM.from_pretrained(src, dtype=torch.float32).to("cuda").eval()
    ids, num_new = prompt(150, seed=5), 32
    engine = cuda_engine(cores["float32"])
    assert engine.runner.graphs is None  # MoE routing keeps graphs off
    got = generate(engine, [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=num_new, min_new_tokens=num_new,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sixteen_requests_together_give_what_each_gives_alone(exported, dtype):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    core = exported[1][dtype]
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    together = generate(cuda_engine(core), reqs)
    for r in reqs:
        alone = generate(cuda_engine(core, max_concurrency=1, budget=512, chunk=512), [r])[r.req_id]
        assert together[r.req_id] == alone, r.req_id
