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
from helios.layers.parallel import TensorGroup
from helios.runner.parallel import shard_arch
from tests.models.step3p7_tiny import build_step3p7
from tests.runner.tp_harness import TpCase, parity_tests, rank1_cut, window_workload

CASE = TpCase(labels=("step3p7",), build=lambda label, out_dir: build_step3p7(out_dir),
              workload=window_workload())
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_sliding_heads_and_their_gates_split_together(cores):
    """Rank 1 of 2 without a group: a sliding layer's qkv takes its 3 of the 6 sliding q heads, its one of the 2 KV
    heads' k and v rows and the gate rows of its q heads (one per head, last); the shared expert and the router's
    score bias whole, the experts half; the MTP layer's tensors whole."""
    arch, full, shard, local = rank1_cut(cores["step3p7"])
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


def test_sliding_heads_that_do_not_split_name_their_field(cores):
    """Four ranks split the full layers' 4 query heads and replicate the 2 KV heads, but not the sliding layers' 6
    query heads: refused, naming sliding_num_heads."""
    arch = load_core(cores["step3p7"]).manifest.arch
    with pytest.raises(ValueError, match="sliding_num_heads = 6 does not split over 4 ranks"):
        shard_arch(arch, TensorGroup(rank=0, world_size=4))
