"""Tensor parallelism of gemma4 on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on the tiny
random core of tests/models/gemma4_tiny's "moe" variant, which holds every per-layer peculiarity: sliding layers of 2
KV heads of 16 (one per rank) and full layers of their own single KV head of 32 (replicated on both ranks) with
k = v (no v rows); the last two layers KV-shared (only q rows: they read their source layer's pages on the same rank)
with double-wide MLPs split by width; per-layer embeddings, norms and layer scalars replicated; the MoE block's
experts split whole beside every MLP, its router replicated; the tied head's vocabulary gathered before the final
soft-cap.

Both ranks run a 40-token prompt (past the 8-token window) whole and in 8-token chunks: logits within 2e-5 of TP=1's
in float32; rank 0 serves three greedy requests (32 tokens each) through an EngineCore over its TensorParallelRunner
while rank 1 runs the worker loop: TP=1's tokens, every plan run on both (tests/runner/tp_harness).
"""

from __future__ import annotations

import torch

from tests.models.gemma4_tiny import build_gemma4
from tests.runner.tp_harness import TpCase, parity_tests, rank1_cut, window_workload

# NOTE: atol 2e-5, not the harness's 1e-5: the largest difference is 1.01e-5 of a logit near 0.5 on an Intel Xeon
# (torch 2.13's oneDNN float32 kernels for that CPU; under 1e-5 on the AMD EPYC of earlier runs): the o and down
# products summed over two ranks round differently from one product, through 4 layers, PLE and the soft-cap
CASE = TpCase(labels=("gemma4",), build=lambda label, out_dir: build_gemma4(out_dir, "moe"),
              workload=window_workload(), atol=2e-5)
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_per_layer_kv_shapes_cut_by_head(cores):
    """Rank 1 of 2 without a group: a full layer's qkv takes its 2 of the 4 q heads of 32 and its one (replicated) KV
    head's k rows (k = v: no v rows); a KV-shared layer's only its q rows; a double-wide MLP half its width; the PLE
    tables, the layer scalars and the router whole, the experts half."""
    arch, full, shard, local = rank1_cut(cores["gemma4"])
    assert (local.num_heads, local.num_kv_heads, local.full_num_kv_heads) == (2, 1, 1)
    i = arch.layer_types.index("full")
    nq, d = arch.num_heads, arch.full_head_dim
    qkv = full[f"layers.{i}.attn.qkv.weight"]
    assert qkv.shape[0] == (nq + 1) * d  # q and k: v is k's projection
    assert torch.equal(shard[f"layers.{i}.attn.qkv.weight"], torch.cat([qkv[nq * d // 2 : nq * d], qkv[nq * d :]]))
    shared = next(j for j, source in enumerate(arch.kv_sources) if source != j)
    qkv = full[f"layers.{shared}.attn.qkv.weight"]
    assert torch.equal(shard[f"layers.{shared}.attn.qkv.weight"], qkv[qkv.shape[0] // 2 :])
    wide = full[f"layers.{shared}.mlp.down.weight"]
    assert wide.shape[1] == 2 * arch.intermediate_size
    assert torch.equal(shard[f"layers.{shared}.mlp.down.weight"], wide[:, arch.intermediate_size :])
    for name in ("ple.embed.weight", "ple.proj.weight", f"layers.{i}.layer_scalar", f"layers.{i}.ple_gate.weight",
                 f"layers.{i}.moe.router.weight"):
        assert shard[name] is full[name]
    assert shard[f"layers.{i}.moe.down.weight"].shape[0] == arch.moe.num_experts // 2
