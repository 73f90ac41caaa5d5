"""The hybrid families on the GPU: a tiny random checkpoint exported in float32 and bfloat16, run by the CUDA
runner (Triton attention backend, the gated delta rule's Triton kernels) through the engine with state slots;
greedy tokens identical to HF transformers' generate on the same device and dtype, and batched = alone. Both
families decode through CUDA graphs (the GDN's Triton decode step; the MoE's fused path).

HF runs its torch reference ops here, not flash-linear-attention's kernels: with fla installed it would take them,
and their Triton autotuning for HF's shapes and dtypes takes minutes per test on a fresh machine."""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.runner.model_runner import ModelRunner
from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_greedy_on_cuda, export_dtypes
from tests.models.hybrid_tiny import build_hybrid
from tests.models.hybrid_harness import PAGE_SIZE, check_batched_equals_alone, prompt

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = build_hybrid(request.param, root / "hf")
    return request.param, src, export_dtypes(src, root)


def cuda_engine(core, max_concurrency: int = 16, budget: int = 256, chunk: int = 128) -> EngineCore:
    arch = core.manifest.arch
    num_pages = 512
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget,
                             prefill_chunk_size=chunk, page_size=PAGE_SIZE, num_pages=num_pages,
                             max_model_len=num_pages * PAGE_SIZE, num_state_slots=max_concurrency,
                             state_chunk=arch.recurrent.chunk_size)
    runner = ModelRunner(arch, core.tensors, num_pages, PAGE_SIZE, device="cuda", num_state_slots=max_concurrency)
    return EngineCore(config, runner)


def check_greedy_on_the_gpu(src, core, hf_class=None) -> None:
    """32 greedy tokens of a 150-token prompt through the CUDA engine = the generate of HF's model of src (hf_class,
    by default AutoModelForCausalLM; on the device, its torch path; family_cuda.check_tokens_match_hf). A model CUDA
    graphs support decodes every token after the first through them."""
    from transformers import AutoModelForCausalLM

    engine = check_greedy_on_cuda(hf_class or AutoModelForCausalLM, src, core, engine=cuda_engine)
    if engine.runner.graphs is not None:
        assert engine.runner.launches["graph"] >= 31, engine.runner.launches  # the 32 tokens but the first


def check_batched_equals_alone_on_the_gpu(core) -> None:
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone (one engine for the
    alone runs: each engine captures its graphs)."""
    prompts = [prompt(7 + 23 * i, seed=10 + i) for i in range(16)]
    check_batched_equals_alone(core, prompts, engine=cuda_engine, one_alone_engine=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    family, src, cores = exported
    assert cuda_engine(cores[dtype]).runner.graphs is not None  # GDN's Triton decode and the fused MoE: graphed
    check_greedy_on_the_gpu(src, cores[dtype])


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    check_batched_equals_alone_on_the_gpu(exported[2]["float32"])
