"""minimax_m3 on the GPU: the tiny random checkpoint (the wrapper variant: sparse, full and sparse layers, a dense MLP
then experts) exported in float32 and bfloat16, run by the CUDA runner through the engine: the full layers through
the Triton attention backend, the sparse layers' indexer and block-sparse attention through their torch ops on the
device (index keys in pages beside the K/V; MoE and the indexer keep CUDA graphs off). float32 greedy tokens = HF
transformers' generate on the device; 16 batched = alone in both dtypes."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.model_runner import ModelRunner
from tests.models.hybrid_harness import PAGE_SIZE, generate, greedy_request, prompt
from tests.models.minimax_m3_tiny import build_minimax_m3

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

    root = tmp_path_factory.mktemp("minimax_m3")
    src = build_minimax_m3(root / "hf", "wrapper")
    return src, {name: load_core(export_core(src, root / name, ExportOptions(dtype=name))) for name in DTYPES}


def cuda_engine(core, max_concurrency: int = 16, budget: int = 256, chunk: int = 128) -> EngineCore:
    num_pages = 512
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget,
                             prefill_chunk_size=chunk, page_size=PAGE_SIZE, num_pages=num_pages,
                             max_model_len=num_pages * PAGE_SIZE)
    return EngineCore(config, ModelRunner(core.manifest.arch, core.tensors, num_pages, PAGE_SIZE, device="cuda"))


def test_greedy_matches_transformers_on_the_gpu_in_float32(exported):
    """32 greedy tokens of a 150-token prompt (38 blocks of 4, 4 kept per query) = HF generate on the device."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    src, cores = exported
    hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(src, dtype=torch.float32).to("cuda").eval()
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
