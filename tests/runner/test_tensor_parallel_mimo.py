"""Tensor parallelism of mimo_v2_flash on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on the tiny
random core of tests/models/mimo_v2_flash_tiny (full and sliding layers with their own KV head counts, 2 and 4:
one and two per rank; the sliding layers' sinks split with their heads; v heads narrower than q/k; a dense first MLP
and sigmoid-routed, group-limited experts split whole over the ranks, the router and its score bias replicated).

Both ranks run a 40-token prompt (past the 17-token window) whole and in 8-token chunks: logits within 1e-5 of TP=1's
in float32; rank 0 serves three greedy requests through an EngineCore over its TensorParallelRunner while rank 1
runs the worker loop: TP=1's tokens, every plan run on both (tests/runner/tp_harness).
"""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.layers.parallel import TensorGroup
from helios.runner.model_runner import ModelRunner
from helios.runner.parallel import shard_arch, shard_tensors
from tests.models.hybrid_harness import prompt
from tests.runner.tp_harness import engine_tokens, float32_cores, single_and_ranked

FAMILIES = ("mimo_v2_flash",)
PAGE_SIZE, NUM_PAGES = 4, 64
RUNNER_KWARGS: dict = {}
NUM_NEW = 16
CHUNK = 8


def prompts() -> list[list[int]]:
    return [prompt(40, seed=1), prompt(9, seed=2), prompt(23, seed=3)]


def logits_of(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Every position's logits of the first prompt, whole and in chunks."""
    ids = prompts()[0]
    return {"whole": runner.forward_logits(ids), "chunked": runner.forward_logits(ids, chunk_size=CHUNK)}


def greedy_tokens(runner, core) -> dict[str, list[int]]:
    """Three greedy requests at once (8-token prefill chunks beside decodes: mixed steps)."""
    config = SchedulerConfig(max_concurrency=4, max_num_batched_tokens=16, prefill_chunk_size=CHUNK,
                             page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_model_len=NUM_PAGES * PAGE_SIZE)
    return engine_tokens(config, runner, prompts(), NUM_NEW)


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    from tests.models.mimo_v2_flash_tiny import build_mimo

    return float32_cores(lambda family, out_dir: build_mimo(out_dir), FAMILIES, tmp_path_factory)


@pytest.fixture(scope="module")
def results(cores, tmp_path_factory):
    """(TP=1, per rank of TP=2) results (tests/runner/tp_harness)."""
    return single_and_ranked(__name__, cores, tmp_path_factory.mktemp("ranks"))


def test_logits_equal_single_rank(results):
    single, ranked = results
    for rank_result in ranked["mimo_v2_flash"]:  # every rank gathers the whole vocabulary
        for key in ("whole", "chunked"):
            torch.testing.assert_close(rank_result["logits"][key], single["mimo_v2_flash"]["logits"][key], atol=1e-5,
                                       rtol=0)


def test_greedy_identical_and_workers_ran_every_plan(results):
    single, ranked = results
    driver, worker = ranked["mimo_v2_flash"]
    assert driver["tokens"] == single["mimo_v2_flash"]["tokens"]
    assert all(len(t) == NUM_NEW for t in driver["tokens"].values())
    assert worker["plans"] == driver["plans"] == single["mimo_v2_flash"]["plans"] > NUM_NEW


def test_sliding_kv_heads_and_sinks_split_with_their_heads(cores):
    """Rank 1 of 2 without a group: a sliding layer's qkv takes its q heads, its 2 of the 4 sliding KV heads' k rows
    and their narrower v rows; the sinks its q heads'; the router's score bias whole; the experts half."""
    core = load_core(cores["mimo_v2_flash"])
    arch, full = core.manifest.arch, core.tensors
    tp = TensorGroup(rank=1, world_size=2)
    shard, local = shard_tensors(arch, full, tp), shard_arch(arch, tp)
    assert (local.num_kv_heads, local.sliding_num_kv_heads) == (arch.num_kv_heads // 2, arch.sliding_num_kv_heads // 2)
    i = arch.layer_types.index("sliding")
    d, dv, nq, nkv = arch.head_dim, arch.v_head_dim, arch.num_heads, arch.sliding_num_kv_heads
    qkv = full[f"layers.{i}.attn.qkv.weight"]
    q, k = nq * d, nkv * d
    want = torch.cat([qkv[q // 2 : q], qkv[q + k // 2 : q + k], qkv[q + k + nkv * dv // 2 :]])
    assert torch.equal(shard[f"layers.{i}.attn.qkv.weight"], want)
    assert torch.equal(shard[f"layers.{i}.attn.sinks"], full[f"layers.{i}.attn.sinks"][nq // 2 :])
    moe = next(j for j in range(arch.num_layers) if j not in arch.moe.dense_layers)
    assert shard[f"layers.{moe}.moe.router.bias"] is full[f"layers.{moe}.moe.router.bias"]
    assert shard[f"layers.{moe}.moe.down.weight"].shape[0] == arch.moe.num_experts // 2
