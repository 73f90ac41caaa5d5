"""Host embedding tables on the GPU (helios/runner/host_embedding.py): gemma4's PLE table left in host memory behind
a device row cache (pinned staging, copies on a side stream, the step's stream waiting for them), run by the CUDA
runner through the engine with decode graphs (HostRows read inside the captured graph) and the speculative next
step: greedy tokens = HF transformers' generate (float32, bfloat16); 16 batched requests through a cache small
enough to evict give the bound table's tokens; qwen4_exp's hashed n-gram tables from the host give the bound
tables' logits (eager: its indexed attention is not graphed)."""

from __future__ import annotations

import pytest
import torch

from helios.runner.model_runner import ModelRunner
from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_greedy_on_cuda, cuda_engine, export_dtypes
from tests.models.gemma4_tiny import build_gemma4
from tests.models.hybrid_harness import generate, greedy_request, prompt
from tests.models.qwen4_exp_tiny import build_qwen4_exp

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """(HF directory, {dtype name: LoadedCore}) of the base variant (PLE 8 per layer)."""
    root = tmp_path_factory.mktemp("gemma4")
    src = build_gemma4(root / "hf", "base")
    return src, export_dtypes(src, root)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gemma4_greedy_with_the_ple_table_on_the_host_matches_transformers(gemma4, dtype):
    """32 greedy tokens of a 150-token prompt (128-token chunks) through a 160-row cache = HF generate on the
    device; decode steps replay captured graphs whose PLE rows come from the cache."""
    from transformers import Gemma4ForConditionalGeneration

    src, cores = gemma4
    engine = check_greedy_on_cuda(Gemma4ForConditionalGeneration, src, cores[dtype], host_embeddings="on",
                                  host_embedding_rows=160)
    runner = engine.runner
    assert runner.host_embeddings is not None and "ple.embed.weight" not in dict(runner.model.named_parameters())
    assert runner.graphs is not None and runner.launches["graph"] > 0, runner.startup.graphs
    stats = runner.stats()
    assert stats.embedding_row_cache_misses > 0 and stats.replay_readiness_samples > 0
    assert stats.embedding_row_cache_bytes == stats.embedding_row_cache_misses * 6 * 8 * DTYPES[dtype].itemsize


def test_gemma4_batched_through_an_evicting_cache_gives_the_bound_tables_tokens(gemma4):
    """16 requests together (32-token chunks, 64 tokens a step, decodes graphed and speculated) through a 72-row
    cache = the same engine with the table bound on the device, token for token (float32)."""
    core = gemma4[1]["float32"]
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    host = cuda_engine(core, budget=64, chunk=32, host_embeddings="on", host_embedding_rows=72)
    got = generate(host, reqs)
    assert got == generate(cuda_engine(core, budget=64, chunk=32), reqs)
    stats = host.runner.stats()
    assert stats.embedding_row_cache_evictions > 0 and host.runner.launches["graph"] > 0, host.runner.launches
    assert stats.embedding_row_cache_bytes == stats.embedding_row_cache_misses * 6 * 8 * 4


def test_qwen4_exp_hashed_tables_on_the_host_give_the_bound_tables_logits(tmp_path):
    """forward_logits of a 128-token prompt in 64-token chunks: host tables (a cache of one chunk's rows and a
    little more: evictions) = bound tables, on the device in float32."""
    core = export_dtypes(build_qwen4_exp("ple", tmp_path / "hf"), tmp_path, ["float32"])["float32"]
    arch = core.manifest.arch
    ple = arch.ple
    rows = 64 * (ple.ngram_size - 1) * ple.heads_per_ngram + 16
    ids = prompt(128, seed=4)

    def logits(**host):
        runner = ModelRunner(arch, core.tensors, 64, 16, device="cuda", num_state_slots=1, **host)
        return runner, runner.forward_logits(ids, 64)

    bound = logits()[1]
    runner, got = logits(host_embeddings="on", host_embedding_rows=rows)
    torch.testing.assert_close(got, bound, atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), bound.argmax(-1))
    assert runner.stats().embedding_row_cache_evictions > 0
