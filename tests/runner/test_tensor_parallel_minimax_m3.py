"""Tensor parallelism of minimax_m3 on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on the tiny
random "wrapper" core of tests/models/minimax_m3_tiny (sparse, full, sparse layers of 4 query heads over 2 KV heads,
one per rank; 2 index heads, one per rank with the query heads it selects for, the index key whole on both; 4-token
blocks, 4 kept: a 16-token budget; a dense SwiGLU-OAI first layer split by width; sigmoid-routed experts whole per
rank with the router, its score bias and the shared expert replicated).

Both ranks run a 40-token prompt (far past the indexer's budget, so most blocks are dropped, each rank choosing for its
own heads) whole and in 8-token chunks: logits within 1e-5 of TP=1's in float32; rank 0 serves three greedy requests
(32 tokens each) through an EngineCore over its TensorParallelRunner while rank 1 runs the worker loop: TP=1's tokens,
every plan run on both (tests/runner/tp_harness).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from helios.layers.parallel import TensorGroup
from helios.runner.parallel import shard_arch, shard_tensors
from tests.models.minimax_m3_tiny import build_minimax_m3
from tests.runner.tp_harness import RANK1, TpCase, parity_tests, rank1_cut, window_workload

CASE = TpCase(labels=("minimax_m3",), build=lambda label, out_dir: build_minimax_m3(out_dir, "wrapper"),
              workload=window_workload())
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_index_heads_split_with_their_query_heads(cores):
    """Rank 1 of 2 without a group: a sparse layer's indexer keeps its one of the 2 index query heads and the index
    key whole; with 1 index head (4 ranks over 2 index heads: each of ranks 2, 3 holds head 1, replicated) the heads
    its query heads read; the index norms whole."""
    arch, full, shard, local = rank1_cut(cores["minimax_m3"])
    assert (local.num_heads, local.num_kv_heads, local.msa.num_heads) == (2, 1, 1)
    di, i = arch.msa.head_dim, arch.msa.layers[0]
    qk = full[f"layers.{i}.attn.indexer.qk.weight"]
    assert torch.equal(shard[f"layers.{i}.attn.indexer.qk.weight"], torch.cat([qk[di : 2 * di], qk[2 * di :]]))
    for name in ("attn.indexer.q_norm.weight", "attn.indexer.k_norm.weight", "moe.router.bias"):
        key = f"layers.{arch.num_layers - 1}.{name}"
        assert shard[key] is full[key]
    four = TensorGroup(rank=3, world_size=4)
    assert shard_arch(arch, four).msa.num_heads == 1
    assert torch.equal(shard_tensors(arch, full, four)[f"layers.{i}.attn.indexer.qk.weight"],
                       torch.cat([qk[di : 2 * di], qk[2 * di :]]))
    three = msgspec.structs.replace(arch, msa=msgspec.structs.replace(arch.msa, num_heads=3))
    with pytest.raises(ValueError, match=r"msa\.num_heads \(index_n_heads\) = 3"):
        shard_arch(three, RANK1)
