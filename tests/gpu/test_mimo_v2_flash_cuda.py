"""mimo_v2_flash on the GPU: the tiny random checkpoint (full and sliding layers, sinks, V narrower than q/k, MoE)
exported in float32 and bfloat16, run by the CUDA runner (Triton attention backend: paged decode and prefill with
sinks, V zero-padded to the q/k head_dim; MoE keeps CUDA graphs off) through the engine with the sliding layers'
pages in a window group. float32 greedy tokens = HF transformers' generate on the device; 16 batched = alone in
both dtypes; the sink kernels = their torch reference on CUDA."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.model_runner import ModelRunner
from tests.kernels import checks
from tests.models.hybrid_harness import PAGE_SIZE, generate, greedy_request, prompt
from tests.models.mimo_v2_flash_tiny import build_mimo

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

    root = tmp_path_factory.mktemp("mimo_v2_flash")
    src = build_mimo(root / "hf")
    return src, {name: load_core(export_core(src, root / name, ExportOptions(dtype=name))) for name in DTYPES}


def cuda_engine(core, max_concurrency: int = 16, budget: int = 256, chunk: int = 128) -> EngineCore:
    arch = core.manifest.arch
    num_pages = 512
    window_pages = max_concurrency * window_pages_per_request(arch.sliding_window, PAGE_SIZE, chunk)
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget,
                             prefill_chunk_size=chunk, page_size=PAGE_SIZE, num_pages=num_pages,
                             max_model_len=num_pages * PAGE_SIZE, sliding_window=arch.sliding_window,
                             window_pages=window_pages)
    runner = ModelRunner(arch, core.tensors, num_pages, PAGE_SIZE, device="cuda", window_pages=window_pages)
    return EngineCore(config, runner)


def test_greedy_matches_transformers_on_the_gpu_in_float32(exported):
    """32 greedy tokens of a 150-token prompt (far past the 17-token window) = HF generate on the device."""
    from transformers import MiMoV2FlashForCausalLM

    src, cores = exported
    hf = MiMoV2FlashForCausalLM.from_pretrained(src, dtype=torch.float32).to("cuda").eval()
    ids, num_new = prompt(150, seed=5), 32
    got = generate(cuda_engine(cores["float32"]), [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=num_new, min_new_tokens=num_new,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sixteen_requests_together_give_what_each_gives_alone(exported, dtype):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    core = exported[1][dtype]
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    together = generate(cuda_engine(core, budget=128, chunk=64), reqs)
    for r in reqs:
        alone = generate(cuda_engine(core, max_concurrency=1, budget=512, chunk=512), [r])[r.req_id]
        assert together[r.req_id] == alone, r.req_id


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_sinks_on_cuda(dtype, num_splits):
    checks.check_decode("cuda", dtype, 16, 16, seq_lens=(37, 5, 300), num_splits=num_splits, sliding_window=129,
                        num_kv_heads=2, head_dim=192, sinks=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_with_sinks_on_cuda(dtype):
    checks.check_prefill("cuda", dtype, 8, 16, (200, 1, 9), (200, 33, 300), sliding_window=129, num_kv_heads=4,
                         head_dim=192, sinks=True)
