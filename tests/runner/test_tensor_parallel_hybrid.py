"""Tensor parallelism of the hybrid families on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on tiny
random cores of qwen3_5 (a dense MLP), qwen3_5_moe (experts and a gated shared expert) and qwen3_next (dense and MoE
layers) from tests/models/hybrid_tiny: three gated-delta-rule layers (2 key heads serving 4 value heads: one key head
and its two value heads per rank; each rank's state slots hold its heads only) and one gated full-attention layer
(qwen3_5's with one KV head, which both ranks hold; qwen3_5_moe's two split).

Both ranks run a 150-token prompt's forward_logits whole and in chunks of the recurrent grid (64: three chunks, the
state carried between them on each rank): the last position's logits within 1e-5 of TP=1's in float32. Then rank 0
serves two greedy requests (that prompt in 64-token prefill chunks beside the other's decodes, 32 new tokens each)
through an EngineCore over its TensorParallelRunner while rank 1 runs the worker loop: TP=1's tokens, and rank 1 ran
every plan rank 0 did (tests/runner/tp_harness)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from helios.core.load import load_core
from helios.layers.parallel import TensorGroup
from helios.runner.parallel import shard_arch, shard_tensors
from helios.runner.state_cache import StateCache
from tests.models.hybrid_tiny import build_hybrid
from tests.runner.tp_harness import RANK1, TpCase, Workload, parity_tests, rank1_cut

# the dense model's attention has one KV head: each rank holds it (replicated), the MoE models' two split; qwen3_next
# with a dense MLP in every other layer beside the experts
CONFIGS = {"qwen3_5": {"num_key_value_heads": 1}, "qwen3_5_moe": {}, "qwen3_next": {"decoder_sparse_step": 2}}
# Two prompts with a state slot each: the long one in chunks of the recurrent grid (64, RecurrentConfig.chunk_size:
# forward_logits' and the engine's prefill chunks) beside the other's decodes; it takes three prefill chunks, so the
# engine runs at least 32 + 2 eager forwards. NOTE: the last position within 1e-5 of TP=1 and each rank's chunked
# logits within 1e-5 of its whole ones, but not every position within 1e-5 (1e-4): the row-parallel sums round the
# two halves of o, out and down apart, and the recurrence amplifies those ulps (up to 3e-5 over the 150 positions here,
# logits of scale 4, the last 5e-6; a one-process TP=1 runner whose o, out and down add their input halves' products
# apart differed from TP=1 by exactly as much).
CASE = TpCase(labels=("qwen3_5", "qwen3_5_moe", "qwen3_next"),
              build=lambda family, out_dir: build_hybrid(family, out_dir, **CONFIGS[family]),
              workload=Workload(prompt_lens=(150, 40), chunk=64, num_new=32, prefill_chunk=64,
                                max_num_batched_tokens=128, max_concurrency=2, page_size=16, num_pages=32,
                                num_state_slots=2),
              atol=1e-4, last_atol=1e-5, chunked_atol=1e-5, min_plans=32 + 2)
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_gated_delta_and_gated_attention_shards_are_cut_by_head(cores):
    """Rank 1 of 2 without a group: the gated delta rule's in_proj takes its key head's q and k rows, its value
    heads' v, z, b and a rows; conv its q, k and v channels; dt_bias / A_log its value heads; out its value heads'
    columns; gated attention's qkv its q, k, v and gate heads; the shared expert whole; the rank's architecture
    says so (and its state slots hold its heads)."""
    arch, full, shard, local = rank1_cut(cores["qwen3_5_moe"])
    r = arch.recurrent
    assert (local.recurrent.num_key_heads, local.recurrent.num_heads) == (r.num_key_heads // 2, r.num_heads // 2)
    assert local.recurrent.conv_dim == r.conv_dim // 2 and local.intermediate_size == arch.intermediate_size
    dk, dv, hk, hv = r.key_head_dim, r.value_head_dim, r.num_key_heads, r.num_heads
    key, value = hk * dk, hv * dv

    def second_halves(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
        return torch.cat([t[(a + b) // 2 : b] for a, b in zip(bounds, bounds[1:])])

    gdn = arch.layer_types.index("linear")
    name = f"layers.{gdn}.linear."
    torch.testing.assert_close(shard[name + "in_proj.weight"],
                               second_halves(full[name + "in_proj.weight"], [key, key, value, value, hv, hv]))
    torch.testing.assert_close(shard[name + "conv.weight"],
                               second_halves(full[name + "conv.weight"], [key, key, value]))
    assert torch.equal(shard[name + "A_log"], full[name + "A_log"][hv // 2 :])
    assert torch.equal(shard[name + "out.weight"], full[name + "out.weight"][:, value // 2 :])
    assert shard[name + "norm.weight"] is full[name + "norm.weight"]
    attn = arch.layer_types.index("full")
    d, nq, nkv = arch.head_dim, arch.num_heads, arch.num_kv_heads
    qkv = f"layers.{attn}.attn.qkv.weight"
    torch.testing.assert_close(shard[qkv], second_halves(full[qkv], [nq * d, nkv * d, nkv * d, nq * d]))
    shared = f"layers.{attn}.moe.shared.down.weight"
    assert shard[shared] is full[shared]
    # the state slots of a rank hold its heads: half the bytes
    assert StateCache.bytes_per_slot(local, torch.float32) * 2 == StateCache.bytes_per_slot(arch, torch.float32)
    # qwen3_next's dense layers beside its experts: their MLP width splits (qwen3_5_moe's shared width stays whole)
    mixed = load_core(cores["qwen3_next"]).manifest.arch
    assert mixed.moe.dense_layers and shard_arch(mixed, RANK1).intermediate_size == mixed.intermediate_size // 2


def test_one_kv_head_is_replicated_and_unsplittable_sizes_name_the_field(cores):
    """qwen3_5's one KV head: both ranks hold its k and v rows (and their own q and gate heads); a gated delta rule
    with one key head over two ranks, or 2 value heads over 4, is refused naming the field."""
    arch = load_core(cores["qwen3_5"]).manifest.arch
    full = load_core(cores["qwen3_5"]).tensors
    d, nq = arch.head_dim, arch.num_heads
    name = f"layers.{arch.layer_types.index('full')}.attn.qkv.weight"
    for rank in range(2):
        tp = TensorGroup(rank=rank, world_size=2)
        assert shard_arch(arch, tp).num_kv_heads == arch.num_kv_heads == 1
        q = slice(rank * nq // 2 * d, (rank + 1) * nq // 2 * d)
        gate = slice(nq * d + 2 * d + q.start, nq * d + 2 * d + q.stop)
        want = torch.cat([full[name][q], full[name][nq * d : nq * d + 2 * d], full[name][gate]])
        assert torch.equal(shard_tensors(arch, {name: full[name]}, tp)[name], want)
    r = arch.recurrent
    one_key_head = msgspec.structs.replace(arch, recurrent=msgspec.structs.replace(r, num_key_heads=1))
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        shard_arch(one_key_head, TensorGroup(rank=0, world_size=2))
    with pytest.raises(ValueError, match="linear_num_key_heads"):  # 2 key heads over 4 ranks
        shard_arch(arch, TensorGroup(rank=0, world_size=4))


def test_serve_path_runs_a_hybrid_on_two_ranks_without_host_tiers(cores, results, tmp_path):
    """compose.build_engine with tensor_parallel 2 (`helios serve --tensor-parallel 2`) on qwen3_5 with prefix
    caching, a host DRAM tier and a disk directory asked for: state slots and checkpoints on both ranks, no host
    tiers (each rank would write its own shard's records under the same names); the long prompt's greedy tokens are
    TP=1's, and close() joins the worker."""
    from helios.compose import build_engine
    from helios.server.config import ServerConfig
    from helios.server.runtime import resolve_serving
    from tests.models.hybrid_harness import generate, greedy_request

    single, _ = results
    core = load_core(cores["qwen3_5"])
    config = ServerConfig(device="cpu", tensor_parallel=2, kv_cache_tokens=1024, host_cache_bytes=1 << 24,
                          host_disk_dir=str(tmp_path), host_disk_bytes=1 << 24)
    engine, runner = build_engine(core, config, resolve_serving(core.manifest, config), own_thread=False)
    try:
        assert runner.state_cache is not None and runner.state_host is None and runner.host_store is None
        tokens = generate(engine.core, [greedy_request("r0", CASE.workload.prompts()[0], CASE.workload.num_new)])
    finally:
        runner.close()
    assert tokens["r0"] == single["qwen3_5"]["tokens"]["r0"]
    assert [w.exitcode for w in runner.workers] == [0]
