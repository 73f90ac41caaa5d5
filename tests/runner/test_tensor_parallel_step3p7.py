"""Tensor parallelism of step3p7 on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on the tiny
random core of tests/models/step3p7_tiny ("base": full layers of 4 query heads, sliding layers of their own 6, both
over 2 KV heads, one per rank; a per-head sigmoid gate row per query head, split with its head; partial rotary on the
full layers; SwiGLU clamps on dense, routed and shared experts; dense first layers, then sigmoid-routed experts split
whole over the ranks with the router, its score bias and the shared expert replicated; an MTP layer passed through).

Both ranks run a 40-token prompt (past the 8-token window) whole and in 8-token chunks: logits within 1e-5 of TP=1's
in float32; rank 0 serves three greedy requests (32 tokens each) through an EngineCore over its TensorParallelRunner
while rank 1 runs the worker loop: TP=1's tokens, every plan run on both (tests/runner/tp_harness).
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

FAMILIES = ("step3p7",)
PAGE_SIZE, NUM_PAGES = 4, 64
RUNNER_KWARGS: dict = {}
NUM_NEW = 32
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
    from tests.models.step3p7_tiny import build_step3p7

    return float32_cores(lambda family, out_dir: build_step3p7(out_dir), FAMILIES, tmp_path_factory)


@pytest.fixture(scope="module")
def results(cores, tmp_path_factory):
    """(TP=1, per rank of TP=2) results (tests/runner/tp_harness)."""
    return single_and_ranked(__name__, cores, tmp_path_factory.mktemp("ranks"))


def test_logits_equal_single_rank(results):
    single, ranked = results
    for rank_result in ranked["step3p7"]:  # every rank gathers the whole vocabulary
        for key in ("whole", "chunked"):
            torch.testing.assert_close(rank_result["logits"][key], single["step3p7"]["logits"][key], atol=1e-5,
                                       rtol=0)


def test_greedy_identical_and_workers_ran_every_plan(results):
    single, ranked = results
    driver, worker = ranked["step3p7"]
    assert driver["tokens"] == single["step3p7"]["tokens"]
    assert all(len(t) == NUM_NEW for t in driver["tokens"].values())
    assert worker["plans"] == driver["plans"] == single["step3p7"]["plans"] > NUM_NEW


def test_sliding_heads_and_their_gates_split_together(cores):
    """Rank 1 of 2 without a group: a sliding layer's qkv takes its 3 of the 6 sliding q heads, its one of the 2 KV
    heads' k and v rows and the gate rows of its q heads (one per head, last); the shared expert and the router's
    score bias whole, the experts half; the MTP layer's tensors whole."""
    core = load_core(cores["step3p7"])
    arch, full = core.manifest.arch, core.tensors
    tp = TensorGroup(rank=1, world_size=2)
    shard, local = shard_tensors(arch, full, tp), shard_arch(arch, tp)
    assert (local.num_heads, local.sliding_num_heads, local.num_kv_heads) == (2, 3, 1)
    i = arch.layer_types.index("sliding")
    d, nq, nkv = arch.head_dim, arch.sliding_num_heads, arch.num_kv_heads
    qkv = full[f"layers.{i}.attn.qkv.weight"]
    q, kv = nq * d, nkv * d
    want = torch.cat([qkv[q // 2 : q], qkv[q + kv // 2 : q + kv], qkv[q + kv + kv // 2 : q + 2 * kv],
                      qkv[q + 2 * kv + nq // 2 :]])
    assert torch.equal(shard[f"layers.{i}.attn.qkv.weight"], want)
    moe = next(j for j in range(arch.num_layers) if j not in arch.moe.dense_layers)
    assert shard[f"layers.{moe}.moe.router.bias"] is full[f"layers.{moe}.moe.router.bias"]
    assert shard[f"layers.{moe}.moe.shared.down.weight"] is full[f"layers.{moe}.moe.shared.down.weight"]
    assert shard[f"layers.{moe}.moe.down.weight"].shape[0] == arch.moe.num_experts // 2
    assert all(shard[n] is t for n, t in full.items() if n.startswith("mtp."))
