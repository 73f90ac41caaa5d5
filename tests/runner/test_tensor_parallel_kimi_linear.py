"""Tensor parallelism of kimi_linear on the CPU: two gloo ranks on 127.0.0.1 against one process (TP=1), on both tiny
random variants of tests/models/kimi_linear_tiny: Kimi delta attention of 4 heads (2 per rank: in_proj's q, k, v and
b rows, the conv's q, k, v channels, f_b / g_b rows, dt_bias and A_log by head, the low-rank gate inputs f_a / g_a
whole; each rank's state slots hold its heads; out row parallel), NoPE MLA of 4 heads ("base": in_proj's q rows by
head; "grouped": a q latent, whole, and q_b's rows by head; kv_b's rows by head; the kv latent, its norm and the rope
key whole, so both ranks page the same latents; o row parallel), dense SwiGLU layers split by width and the
sigmoid-routed experts whole per rank ("grouped": group-limited, two shared experts) with the router, its score bias
and the shared experts replicated.

Both ranks run a 160-token prompt whole and in 64-token chunks of the recurrent grid (three chunks, the state carried
across them on each rank): the last position's logits within 1e-5 of TP=1's in float32 (every position within 1e-4:
see CASE); rank 0 serves three greedy requests (32 tokens each, a state slot each) through an EngineCore over its
TensorParallelRunner while rank 1 runs the worker loop: TP=1's tokens, every plan run on both (tests/runner/tp_harness).
"""

from __future__ import annotations

import torch

from tests.models.kimi_linear_tiny import build_kimi_linear
from tests.runner.tp_harness import TpCase, parity_tests, rank1_cut, recurrent_workload

# NOTE: the last position within 1e-5, every position only within 1e-4, as the gated delta rule's
# (tests/runner/test_tensor_parallel_hybrid): the row-parallel sums round the two halves of out, o and down apart in
# float32 and the recurrence carries those ulps along the prompt (1.5e-5 at a few middle positions here, logits of
# scale ~0.1-1; the last within 1e-5). KDA's recurrent grid (chunk_size) is 64 tokens.
CASE = TpCase(labels=("base", "grouped"), build=lambda variant, out_dir: build_kimi_linear(out_dir, variant),
              workload=recurrent_workload(64), atol=1e-4, last_atol=1e-5)
cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)


def test_kda_and_mla_cut_by_head(cores):
    """Rank 1 of 2 without a group: KDA's in_proj takes its heads' q, k, v and b rows and f_a / g_a whole, the conv
    its q, k, v channels, f_b / dt_bias / A_log its heads; MLA's in_proj (no q latent) its heads' q rows and the kv
    latent and rope key whole, kv_b its heads' rows; with a q latent in_proj and its norm whole, q_b by head; the
    rank's recurrent config counts its heads."""
    arch, full, shard, local = rank1_cut(cores["base"])
    r, m = arch.recurrent, arch.mla
    assert (local.num_heads, local.recurrent.num_heads) == (arch.num_heads // 2, r.num_heads // 2)
    d, inner, half = r.key_head_dim, r.num_heads * r.key_head_dim, r.num_heads * r.key_head_dim // 2
    i = arch.layer_types.index("linear")
    w = full[f"layers.{i}.kda.in_proj.weight"]
    want = torch.cat([w[half:inner], w[inner + half : 2 * inner], w[2 * inner + half : 3 * inner],
                      w[3 * inner : 3 * inner + 2 * d], w[3 * inner + 2 * d + r.num_heads // 2 :]])
    assert torch.equal(shard[f"layers.{i}.kda.in_proj.weight"], want)
    for name in ("f_b.weight", "dt_bias", "A_log"):
        t = full[f"layers.{i}.kda.{name}"]
        assert torch.equal(shard[f"layers.{i}.kda.{name}"], t[t.shape[0] // 2 :])
    assert shard[f"layers.{i}.kda.norm.weight"] is full[f"layers.{i}.kda.norm.weight"]
    j = arch.layer_types.index("full")
    q = arch.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    w = full[f"layers.{j}.mla.in_proj.weight"]
    assert torch.equal(shard[f"layers.{j}.mla.in_proj.weight"], torch.cat([w[q // 2 : q], w[q:]]))
    kv_b = full[f"layers.{j}.mla.kv_b.weight"]
    assert torch.equal(shard[f"layers.{j}.mla.kv_b.weight"], kv_b[kv_b.shape[0] // 2 :])
    arch, full, shard, _ = rank1_cut(cores["grouped"])
    j = arch.layer_types.index("full")
    for name in ("in_proj.weight", "q_a_norm.weight", "kv_a_norm.weight"):
        assert shard[f"layers.{j}.mla.{name}"] is full[f"layers.{j}.mla.{name}"]
    q_b = full[f"layers.{j}.mla.q_b.weight"]
    assert torch.equal(shard[f"layers.{j}.mla.q_b.weight"], q_b[q_b.shape[0] // 2 :])
