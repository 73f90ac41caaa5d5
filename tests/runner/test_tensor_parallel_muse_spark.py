"""Tensor parallelism of muse_spark on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on the tiny
random core of tests/models/muse_spark_tiny (full and sliding layers of 4 query heads over 2 KV heads, one per rank,
the elementwise output gate's rows split with their heads; NoPE layers; the weightless q/k/o norms per head; residual
gates and centred norms replicated; dense SwiGLU layers split by width; the latent MoE's experts split whole with the
router, its score bias and the latent projections and norms replicated; soft-capped logits after the vocabulary
gather).

Both ranks run a 40-token prompt (past the 8-token window) whole and in 8-token chunks: logits within 1e-5 of TP=1's
in float32; rank 0 serves three greedy requests (32 tokens each) through an EngineCore over its TensorParallelRunner
while rank 1 runs the worker loop: TP=1's tokens, every plan run on both (tests/runner/tp_harness).
"""

from __future__ import annotations

import torch

from tests.models.muse_spark_tiny import build_muse_spark
from tests.runner.tp_harness import TpCase, parity_tests, rank1_cut, window_workload

CASE = TpCase(labels=("muse_spark",), build=lambda label, out_dir: build_muse_spark(out_dir),
              workload=window_workload())
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_gate_rows_split_with_their_heads(cores):
    """Rank 1 of 2 without a group: a layer's qkv takes its 2 of the 4 q heads, its one of the 2 KV heads' k and v
    rows and the elementwise gate rows of its q heads (after v); the residual gates, the latent projections and norms
    and the router's score bias whole, the experts half."""
    arch, full, shard, local = rank1_cut(cores["muse_spark"])
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, arch.intermediate_size // 2)
    d, nq, nkv = arch.head_dim, arch.num_heads, arch.num_kv_heads
    qkv = full["layers.1.attn.qkv.weight"]
    q, kv = nq * d, nkv * d
    want = torch.cat([qkv[q // 2 : q], qkv[q + kv // 2 : q + kv], qkv[q + kv + kv // 2 : q + 2 * kv],
                      qkv[q + 2 * kv + q // 2 :]])
    assert torch.equal(shard["layers.1.attn.qkv.weight"], want)
    moe = next(j for j in range(arch.num_layers) if j not in arch.moe.dense_layers)
    for name in ("attn_residual.weight", "mlp_residual.weight", "moe.latent_in.weight", "moe.latent_out.weight",
                 "moe.latent_norm.weight", "moe.expert_norm.weight", "moe.router.bias"):
        assert shard[f"layers.{moe}.{name}"] is full[f"layers.{moe}.{name}"]
    assert shard[f"layers.{moe}.moe.down.weight"].shape[0] == arch.moe.num_experts // 2
