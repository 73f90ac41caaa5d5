"""Tensor parallelism of mimo_v2_flash on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on the tiny
random core of tests/models/mimo_v2_flash_tiny (full and sliding layers with their own KV head counts, 2 and 4:
one and two per rank; the sliding layers' sinks split with their heads; v heads narrower than q/k; a dense first MLP
and sigmoid-routed, group-limited experts split whole over the ranks, the router and its score bias replicated).

Both ranks run a 40-token prompt (past the 17-token window) whole and in 8-token chunks: logits within 1e-5 of TP=1's
in float32; rank 0 serves three greedy requests through an EngineCore over its TensorParallelRunner while rank 1
runs the worker loop: TP=1's tokens, every plan run on both (tests/runner/tp_harness).
"""

from __future__ import annotations

import torch

from tests.models.mimo_v2_flash_tiny import build_mimo
from tests.runner.tp_harness import TpCase, parity_tests, rank1_cut, window_workload

# a 40-token prompt past the 17-token window, in 8-token chunks; 16 greedy tokens per request
CASE = TpCase(labels=("mimo_v2_flash",), build=lambda label, out_dir: build_mimo(out_dir),
              workload=window_workload(num_new=16))
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_sliding_kv_heads_and_sinks_split_with_their_heads(cores):
    """Rank 1 of 2 without a group: a sliding layer's qkv takes its q heads, its 2 of the 4 sliding KV heads' k rows
    and their narrower v rows; the sinks its q heads'; the router's score bias whole; the experts half."""
    arch, full, shard, local = rank1_cut(cores["mimo_v2_flash"])
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
