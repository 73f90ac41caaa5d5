"""Tensor parallelism on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on tiny random cores of a
dense family (llama: tied embeddings, so the vocabulary-parallel embedding is also the head) and a MoE family
(qwen3_moe: q/k norms, an untied head, expert-parallel MoE layers beside a dense one).

Both ranks run every sequence's forward_logits (whole and chunked: logits within 1e-5 of TP=1's in float32), then
rank 0 serves greedy requests through an EngineCore over its TensorParallelRunner while rank 1 runs the worker loop:
the tokens must be TP=1's, and rank 1 must have run every plan rank 0 did (tests/runner/tp_harness).
"""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.layers.parallel import TensorGroup
from helios.runner.parallel import shard_arch, shard_tensors
from tests.ignition.tiny_models import build_tiny
from tests.models.hybrid_harness import generate, greedy_request
from tests.runner.tp_harness import RANK1, WORLD_SIZE, TpCase, Workload, parity_tests, rank1_cut

# three prompts, the first's forward_logits in 5-token chunks (pages of 4: chunks end mid-page); the engine's 8-token
# prefill chunks beside decodes (mixed steps); one eager forward per engine step on every rank (forward_logits
# bypasses execute: not counted)
CASE = TpCase(labels=("llama", "qwen3_moe"), build=build_tiny,
              workload=Workload(prompt_lens=(20, 7, 13), chunk=5, num_new=12), min_plans=1)
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_shards_are_views_where_contiguous_and_cut_right(cores):
    """Rank 1 of 2 without a group: vocabulary rows and whole experts are views of the mapped core; qkv takes its
    q, k and v heads; o and down their input columns; the shapes bind as the rank's architecture says."""
    arch, full, shard, local = rank1_cut(cores["qwen3_moe"])
    assert (local.num_heads, local.num_kv_heads) == (arch.num_heads // 2, arch.num_kv_heads // 2)
    v = arch.vocab_size // 2
    assert shard["embed.weight"].data_ptr() == full["embed.weight"][v:].data_ptr()
    moe_layer = next(i for i in range(arch.num_layers) if i not in arch.moe.dense_layers)
    name = f"layers.{moe_layer}.moe.gate_up.weight"
    e = arch.moe.num_experts // 2
    assert shard[name].data_ptr() == full[name][e:].data_ptr() and shard[name].shape[0] == e
    d, nq, nkv = arch.head_dim, arch.num_heads, arch.num_kv_heads
    qkv = full["layers.0.attn.qkv.weight"]
    want = torch.cat([qkv[nq // 2 * d : nq * d], qkv[(nq + nkv // 2) * d : (nq + nkv) * d],
                      qkv[(nq + nkv + nkv // 2) * d :]])
    assert torch.equal(shard["layers.0.attn.qkv.weight"], want)
    o = full["layers.0.attn.o.weight"]
    assert torch.equal(shard["layers.0.attn.o.weight"], o[:, o.shape[1] // 2 :])
    # a whole model of rank 1's shapes binds them (bind_tensors is strict about shapes and names)
    from helios.models import build_model

    build_model(local, shard, tp=RANK1)
    # a core's multi-token-prediction modules pass through whole: the runner keeps them mapped, never binds them
    draft = {"mtp.0.enorm.weight": torch.ones(arch.hidden_size)}
    assert shard_tensors(arch, {**full, **draft}, RANK1)["mtp.0.enorm.weight"] is draft["mtp.0.enorm.weight"]


def test_unsplittable_sizes_and_families_are_refused(cores):
    import msgspec

    arch = load_core(cores["llama"]).manifest.arch
    with pytest.raises(ValueError, match="num_heads"):
        shard_arch(arch, TensorGroup(rank=0, world_size=3))
    with pytest.raises(ValueError, match="num_kv_heads = 3 neither splits"):  # nor divides 2 ranks
        shard_arch(msgspec.structs.replace(arch, num_heads=6, num_kv_heads=3), TensorGroup(rank=0, world_size=2))
    # fewer KV heads than ranks: one each, ranks 0-1 KV head 0, ranks 2-3 KV head 1 (their q heads' group)
    assert shard_arch(arch, TensorGroup(rank=3, world_size=4)).num_kv_heads == 1
    with pytest.raises(ValueError, match="tensor parallelism covers"):
        shard_arch(msgspec.structs.replace(arch, family="gemma3"), TensorGroup(rank=0, world_size=2))


def test_serve_path_starts_ranks_and_matches_single_rank(cores, results):
    """compose.build_engine with tensor_parallel 2 on the CPU (`helios serve --tensor-parallel 2`): rank 0 in this
    process, rank 1 in a worker process it starts (helios.runner.parallel.start_tensor_parallel); a greedy request
    gives TP=1's tokens, and close() stops and joins the worker."""
    from helios.compose import build_engine
    from helios.server.config import ServerConfig
    from helios.server.runtime import resolve_serving

    single, _ = results
    core = load_core(cores["llama"])
    config = ServerConfig(device="cpu", tensor_parallel=WORLD_SIZE, kv_cache_tokens=1024, prefix_caching=False)
    engine, runner = build_engine(core, config, resolve_serving(core.manifest, config), own_thread=False)
    try:
        tokens = generate(engine.core, [greedy_request("r0", CASE.workload.prompts()[0], CASE.workload.num_new)])
    finally:
        runner.close()
    assert tokens["r0"] == single["llama"]["tokens"]["r0"]
    assert [w.exitcode for w in runner.workers] == [0]
    # a plan after a worker is gone fails at once rather than waiting at a collective
    from helios.engine.messages import SchedulerOutput

    with pytest.raises(RuntimeError, match="helios-rank1 exited"):
        runner.execute(SchedulerOutput(new_requests=[], scheduled=[], finished_req_ids=[], num_scheduled_tokens=0))
