"""Tensor parallelism of nemotron_h on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on the tiny
random "latent" core of tests/models/nemotron_h_tiny: a Mamba-2 mixer of 8 heads in 4 B/C groups (4 heads and 2
groups per rank: in_proj's z, x, B, C and dt rows, the conv's x, B and C channels, dt_bias / A_log / D and the gated
norm's groups cut alike; each rank's state slots hold its heads; out row parallel), positionless attention (4 query
heads over 2 KV heads, one per rank), the latent MoE's relu2 experts whole per rank (router, score bias, latent
projections and shared expert replicated) and a relu2 MLP split by width.

Both ranks run a 40-token prompt whole and in 16-token chunks of the recurrent grid (three chunks, the state carried
across them on each rank): logits within 1e-5 of TP=1's in float32 at every position; rank 0 serves three greedy
requests (32 tokens each, a state slot each) through an EngineCore over its TensorParallelRunner while rank 1 runs
the worker loop: TP=1's tokens, every plan run on both (tests/runner/tp_harness).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from helios.runner.parallel import shard_arch
from tests.models.nemotron_h_tiny import build_nemotron_h
from tests.runner.tp_harness import RANK1, TpCase, parity_tests, rank1_cut, recurrent_workload

# the latent variant's recurrent grid (chunk_size) is 16 tokens
CASE = TpCase(labels=("nemotron_h",), build=lambda label, out_dir: build_nemotron_h(out_dir, "latent"),
              workload=recurrent_workload(16))
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_mamba_heads_split_with_their_groups(cores):
    """Rank 1 of 2 without a group: the mixer's in_proj takes its heads' z, x and dt rows and its groups' B and C
    rows, the conv its x, B and C channels, dt_bias / A_log / D / the gated norm its heads; the rank's recurrent
    config counts its heads and groups (its state slots hold them); the experts half, the latent projections whole."""
    arch, full, shard, local = rank1_cut(cores["nemotron_h"])
    r = arch.recurrent
    assert (local.recurrent.num_heads, local.recurrent.num_key_heads) == (r.num_heads // 2, r.num_key_heads // 2)
    assert local.recurrent.conv_dim == r.conv_dim // 2
    i = arch.layer_types.index("linear")
    inner, groups = r.num_heads * r.value_head_dim, r.num_key_heads * r.key_head_dim
    w = full[f"layers.{i}.mamba.in_proj.weight"]
    z, x, b, c = inner, 2 * inner, 2 * inner + groups, 2 * inner + 2 * groups
    want = torch.cat([w[z // 2 : z], w[z + inner // 2 : x], w[x + groups // 2 : b], w[b + groups // 2 : c],
                      w[c + r.num_heads // 2 :]])
    assert torch.equal(shard[f"layers.{i}.mamba.in_proj.weight"], want)
    conv = full[f"layers.{i}.mamba.conv.weight"]
    assert torch.equal(shard[f"layers.{i}.mamba.conv.weight"],
                       torch.cat([conv[inner // 2 : inner], conv[inner + groups // 2 : inner + groups],
                                  conv[inner + groups + groups // 2 :]]))
    for name in ("A_log", "D", "norm.weight"):
        t = full[f"layers.{i}.mamba.{name}"]
        assert torch.equal(shard[f"layers.{i}.mamba.{name}"], t[t.shape[0] // 2 :])
    moe = arch.layer_types.index("ffn", arch.layer_types.index("full"))
    assert shard[f"layers.{moe}.moe.up.weight"].shape[0] == arch.moe.num_experts // 2
    for name in ("moe.latent_in.weight", "moe.latent_out.weight", "moe.shared.up.weight", "moe.router.bias"):
        assert shard[f"layers.{moe}.{name}"] is full[f"layers.{moe}.{name}"]
    one_group = msgspec.structs.replace(arch, recurrent=msgspec.structs.replace(r, num_key_heads=1))
    with pytest.raises(ValueError, match=r"recurrent\.num_key_heads \(n_groups\) = 1"):
        shard_arch(one_group, RANK1)
