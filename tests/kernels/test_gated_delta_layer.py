"""The GatedDeltaNet layer's Triton decode path (helios.layers.linear_attention, fused=True: one
helios.kernels.gated_delta_decode launch from device-side slots and starts) against its torch path, in Triton's
CPU interpreter: after a prefill on the torch path, a decode step of three sequences (one fresh) gives the same
outputs and leaves the same conv and recurrent state in their slots."""

from __future__ import annotations

import torch

from helios.core.manifest import RecurrentConfig
from helios.layers.attention import AttentionMetadata
from helios.layers.linear_attention import GatedDeltaNet


def test_decode_step_matches_the_torch_path():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()
    cfg = RecurrentConfig(kind="gated_delta", num_heads=4, num_key_heads=2, key_head_dim=16, value_head_dim=16,
                          conv_kernel=4)
    hidden, num_slots = 32, 5
    g = torch.Generator().manual_seed(0)
    layers = {fused: GatedDeltaNet(hidden, cfg, 1e-6, fused=fused) for fused in (False, True)}
    weights = {name: torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * (0.5 if p.ndim == 1 else 1.0)
               for name, p in layers[False].named_parameters()}
    for layer in layers.values():
        for name, t in weights.items():
            owner, _, leaf = name.rpartition(".")
            (layer.get_submodule(owner) if owner else layer)._parameters[leaf] = torch.nn.Parameter(t, False)

    def state():
        return (torch.zeros(num_slots, cfg.conv_kernel - 1, cfg.conv_dim),
                torch.zeros(num_slots, cfg.num_heads, cfg.key_head_dim, cfg.value_head_dim))

    def meta(query_lens, starts, slots):
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        seq_lens = [s + n for s, n in zip(starts, query_lens)]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)])
        return AttentionMetadata(positions=positions, slot_mapping=positions,
                                 query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                 block_tables=torch.zeros(len(slots), 1, dtype=torch.int32), query_start_loc_cpu=qsl,
                                 seq_lens_cpu=seq_lens, state_slots=torch.tensor(slots, dtype=torch.int32),
                                 state_slots_cpu=slots)

    reference = state()
    prefill = torch.randn(9 + 5, hidden, generator=g)
    with torch.inference_mode():
        layers[False](prefill, reference, meta([9, 5], [0, 0], [3, 1]))
        fused_state = tuple(t.clone() for t in reference)
        step = torch.randn(3, hidden, generator=g)
        decode = meta([1, 1, 1], [9, 5, 0], [3, 1, 4])  # slot 4: a fresh sequence (its slot is never read)
        fused_state[0][4].fill_(float("nan"))
        fused_state[1][4].fill_(float("nan"))
        want = layers[False](step, reference, decode)
        got = layers[True](step, fused_state, decode)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for ours, ref in zip(fused_state, reference):
        torch.testing.assert_close(ours[[3, 1, 4]], ref[[3, 1, 4]], atol=2e-5, rtol=1e-5)
