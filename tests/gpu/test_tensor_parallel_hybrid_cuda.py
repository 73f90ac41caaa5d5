"""Tensor parallelism of the hybrids (qwen3_5, qwen3_5_moe) on two GPUs over NCCL (issue 23): the CPU test's checks
(tests/runner/test_tensor_parallel_hybrid.py) on the device. Rank 0 in this process on GPU 0, rank 1 in a worker
process on GPU 1 (start_tensor_parallel, as `helios serve --tensor-parallel 2` starts them); the Triton backend's
fused path with the gated delta rule's Triton kernels on each rank's heads (one key head and its two value heads of
the tiny config), eager (no graphs under TP yet). Greedy tokens of batched float32 requests, one prompt prefilled in
three chunks, must be a one-GPU runner's (CUDA graphs and all). mimo_v2_flash too (tests/runner/
test_tensor_parallel_mimo.py on the device: sliding layers with their own KV heads and sinks split by head, the
sigmoid-routed experts whole), and step3p7 (tests/runner/test_tensor_parallel_step3p7.py: sliding layers with their own
query heads, per-head gates split with them, clamped experts whole) and muse_spark (tests/runner/
test_tensor_parallel_muse_spark.py: residual gates, NoPE layers, the latent MoE's experts whole, soft-capped logits
after the vocabulary gather) and gemma4's "moe" variant (tests/runner/test_tensor_parallel_gemma4.py: per-layer KV
shapes, a replicated full-layer KV head, KV-shared layers, PLE replicated, the MoE block's experts whole) and
minimax_m3's "wrapper" variant (tests/runner/test_tensor_parallel_minimax_m3.py: the lightning indexer's heads split
with their query heads, the sparse decode kernel on each rank's heads) and nemotron_h's "latent" variant (tests/runner/
test_tensor_parallel_nemotron_h.py: Mamba-2 heads split with their B/C groups through the Triton conv and scan, the
latent MoE's experts whole) and kimi_linear's "grouped" variant (tests/runner/test_tensor_parallel_kimi_linear.py:
KDA heads through the Triton KDA kernels, MLA by head through the MLA decode kernel, the latents replicated). Needs
two GPUs; not run yet (no machine of two GPUs was lent when it was written)."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.runner.model_runner import ModelRunner
from tests.gpu.family_cuda import CUDA_MARKS
from tests.models.hybrid_harness import prompt
from tests.runner.tp_harness import engine_tokens

pytestmark = [
    *CUDA_MARKS,
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

PAGE_SIZE, NUM_PAGES = 16, 256
MAX_CONCURRENCY = 4
NUM_NEW = 32


def build(family: str, out_dir):
    """The family's tiny random HF checkpoint (tests/models/*_tiny)."""
    from tests.models.gemma4_tiny import build_gemma4
    from tests.models.hybrid_tiny import build_hybrid
    from tests.models.kimi_linear_tiny import build_kimi_linear
    from tests.models.mimo_v2_flash_tiny import build_mimo
    from tests.models.minimax_m3_tiny import build_minimax_m3
    from tests.models.muse_spark_tiny import build_muse_spark
    from tests.models.nemotron_h_tiny import build_nemotron_h
    from tests.models.step3p7_tiny import build_step3p7

    builders = {"mimo_v2_flash": build_mimo, "step3p7": build_step3p7, "muse_spark": build_muse_spark,
                "gemma4": lambda out: build_gemma4(out, "moe"), "minimax_m3": build_minimax_m3,
                "nemotron_h": lambda out: build_nemotron_h(out, "latent"),
                "kimi_linear": lambda out: build_kimi_linear(out, "grouped")}
    return builders[family](out_dir) if family in builders else build_hybrid(family, out_dir)


FAMILIES = ("qwen3_5", "qwen3_5_moe", "mimo_v2_flash", "step3p7", "muse_spark", "gemma4", "minimax_m3",
            "nemotron_h", "kimi_linear")


@pytest.fixture(scope="module", params=FAMILIES)
def core(request, tmp_path_factory):
    from ignition.export import ExportOptions, export_core

    root = tmp_path_factory.mktemp(request.param)
    src = build(request.param, root / "hf")
    return load_core(export_core(src, root / "core", ExportOptions(dtype="float32")))


def greedy(runner, core) -> dict[str, list[int]]:
    """Four greedy requests at once (a hybrid's with a state slot each); 64-token prefill chunks (the recurrent
    grid) beside decodes."""
    recurrent = core.manifest.arch.recurrent
    states = {} if recurrent is None else dict(num_state_slots=MAX_CONCURRENCY, state_chunk=recurrent.chunk_size)
    config = SchedulerConfig(max_concurrency=MAX_CONCURRENCY, max_num_batched_tokens=128, prefill_chunk_size=64,
                             page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_model_len=NUM_PAGES * PAGE_SIZE, **states)
    prompts = [prompt(n, seed=i) for i, n in enumerate((150, 9, 70, 40))]
    return engine_tokens(config, runner, prompts, NUM_NEW)


def test_tp2_greedy_equals_one_gpu(core):
    from helios.runner.parallel import start_tensor_parallel

    single = greedy(ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE_SIZE, device="cuda",
                                num_state_slots=MAX_CONCURRENCY), core)
    driver = start_tensor_parallel(core, 2, "cuda", NUM_PAGES, PAGE_SIZE, num_state_slots=MAX_CONCURRENCY)
    try:
        assert driver.runner.graphs is None
        tokens = greedy(driver, core)
    finally:
        driver.close()
    assert tokens == single
    assert [w.exitcode for w in driver.workers] == [0]
