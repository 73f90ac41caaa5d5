"""A mixed step (decode rows beside prompt chunks) on the recurrent layers' Triton path (fused=True), in Triton's CPU
interpreter: its one-token sequences take the one-token kernel and give, bit for bit, what a decode step of those rows
alone gives, and only the prompts reach the chunked rule; outputs and states equal the torch path's.

fla's chunked rules run on CUDA only, so here the torch reference stands in for them (helios.kernels.gated_delta's
gated_delta_rule and helios.kernels.kda's kda_rule route a multi-token step to fla); the GPU side of this is
tests/gpu/test_recurrent_families_cuda.py's 16 requests together = alone in float32 (fla's dots are TF32 there, so a
decode row that rode in fla's prefill beside a prompt changed its outputs)."""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import RecurrentConfig
from helios.layers.attention import AttentionMetadata
from helios.layers.kda import KimiDeltaAttention
from helios.layers.linear_attention import GatedDeltaNet, mixed_rows

HIDDEN, SLOTS = 32, 6


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def metadata(query_lens, starts, slots) -> AttentionMetadata:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [s + n for s, n in zip(starts, query_lens)]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)])
    return AttentionMetadata(positions=positions, slot_mapping=positions, query_start_loc=torch.tensor(qsl).int(),
                             seq_lens=torch.tensor(seq_lens).int(),
                             block_tables=torch.arange(len(slots))[:, None].int(),
                             query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
                             state_slots=torch.tensor(slots, dtype=torch.int32), state_slots_cpu=list(slots))


def layers(kind: str):
    """The torch path's layer and the Triton path's, with one set of random weights."""
    if kind == "gated_delta":
        cfg = RecurrentConfig(kind="gated_delta", num_heads=4, num_key_heads=2, key_head_dim=16, value_head_dim=16,
                              conv_kernel=4)
        pair = [GatedDeltaNet(HIDDEN, cfg, 1e-6, fused=fused) for fused in (False, True)]
    else:
        cfg = RecurrentConfig(kind="kimi_delta", num_heads=2, num_key_heads=2, key_head_dim=16, value_head_dim=16,
                              conv_kernel=4)
        pair = [KimiDeltaAttention(HIDDEN, cfg, 1e-6, fused=fused) for fused in (False, True)]
    g = torch.Generator().manual_seed(1)
    for name, p in pair[0].named_parameters():
        t = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * (0.5 if p.ndim == 1 else 1.0)
        if name == "A_log":
            t = t.abs().log()
        for layer in pair:
            owner, _, leaf = name.rpartition(".")
            (layer.get_submodule(owner) if owner else layer)._parameters[leaf] = torch.nn.Parameter(t.clone(), False)
    return cfg, pair


def chunked_stand_in(monkeypatch, kind: str, seen: list):
    """The kernels' chunked rule (fla, CUDA only) replaced by the torch reference, recording each call's tokens."""
    from helios.kernels import gated_delta, kda

    def rule(q, k, v, g, beta, state, slots, query_start_loc, starts, chunk_size=64, qk_normalized=False, **_):
        seen.append(query_start_loc.tolist())
        assert qk_normalized, "the conv normalized q and k (16-wide heads)"  # the reference normalizes them again:
        # a unit vector stays one up to eps
        return gated_delta.gated_delta_rule_ref(q, k, v, g, beta, state, slots, query_start_loc, starts, chunk_size)

    if kind == "gated_delta":
        monkeypatch.setattr(gated_delta, "gated_delta_rule", rule)
    else:
        monkeypatch.setattr(kda, "kda_rule", rule)


def states(cfg):
    return (torch.zeros(SLOTS, cfg.conv_kernel - 1, cfg.conv_dim),
            torch.zeros(SLOTS, cfg.num_heads, cfg.key_head_dim, cfg.value_head_dim))


@pytest.mark.parametrize("kind", ["gated_delta", "kimi_delta"])
def test_mixed_step_decodes_its_one_token_rows_as_a_decode_step(interpreter, monkeypatch, kind):
    cfg, (torch_layer, fused_layer) = layers(kind)
    seen: list = []
    chunked_stand_in(monkeypatch, kind, seen)
    g = torch.Generator().manual_seed(2)
    reference = states(cfg)
    with torch.inference_mode():
        torch_layer(torch.randn(9 + 5 + 7, HIDDEN, generator=g), reference, metadata([9, 5, 7], [0, 0, 0], [3, 1, 5]))
        ours = tuple(t.clone() for t in reference)
        # prompts (a fresh one in slot 0, a continued one in slot 3) around decodes (slots 1 and 5) and a fresh
        # one-token prompt (slot 4): the one-token rows are not one run, so they are gathered
        step = metadata([6, 1, 1, 4, 1], [0, 5, 7, 9, 0], [0, 1, 5, 3, 4])
        x = torch.randn(13, HIDDEN, generator=g)
        singles, rest = mixed_rows(step)
        assert singles[1].query_start_loc_cpu == [0, 1, 2, 3] and singles[1].state_slots_cpu == [1, 5, 4]
        assert rest[1].query_start_loc_cpu == [0, 6, 10] and rest[1].seq_lens_cpu == [6, 13]
        alone = tuple(t.clone() for t in ours)
        want = torch_layer(x, reference, step)
        got = fused_layer(x, ours, step)
        assert seen == [[0, 6, 10]], "only the prompts reach the chunked rule"
        decode_rows = [6, 7, 12]
        by_themselves = fused_layer(x[decode_rows], alone, metadata([1, 1, 1], [5, 7, 0], [1, 5, 4]))
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    assert torch.equal(got[decode_rows], by_themselves), "a decode row's output depends on the step it rides in"
    live = [0, 1, 3, 4, 5]
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a[live], b[live], atol=3e-5, rtol=3e-5)
    for a, b in zip(ours, alone):
        assert torch.equal(a[[1, 4, 5]], b[[1, 4, 5]])


def test_a_step_of_one_kind_is_not_split():
    for lens in ([1, 1, 1], [4, 9], [3]):
        assert mixed_rows(metadata(lens, [0] * len(lens), list(range(len(lens))))) is None
    step = metadata([1, 1, 3], [4, 2, 0], [0, 1, 2])
    (single_rows, _), (rest_rows, rest) = mixed_rows(step)
    assert single_rows == slice(0, 2) and rest_rows == slice(2, 5), "one run of rows is a view, not a gather"
    assert rest.positions.tolist() == [0, 1, 2] and rest.state_slots.tolist() == [2]
    assert mixed_rows(step) is mixed_rows(step), "derived once a step"
