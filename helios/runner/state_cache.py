"""The recurrent state of a hybrid model's linear layers: per layer a conv state and a recurrent state, one row
per state slot (the engine hands slots out, helios.engine.state_pool), plus one scratch row past them (the target
of padded rows in a CUDA graph bucket, and of forward_logits).

Layout per linear layer: conv [num_slots + 1, K - 1, C] in the model dtype, recurrent [num_slots + 1, Hv, dk, dv]
float32 (HF keeps the recurrent state in float32 for every dtype). A layer may own more per-request tensors after
these two (extra_states): qwen4_exp's PLE layers their dilated conv's last inputs [num_slots + 1, W, S*H] in the
model dtype. Slot copies and bytes_per_slot cover every tensor of a layer.
"""

from __future__ import annotations

import math

from types import SimpleNamespace

import torch

from helios.core.manifest import Architecture


class StateCache:
    def __init__(self, arch: Architecture, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        r = arch.recurrent
        if r is None:
            raise ValueError("the architecture has no recurrent layers")
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        rows = num_slots + 1
        # NOTE: zeros, not empty: a slot is read only after its request wrote it, but a padded graph row reads
        # the scratch row, which must never carry NaNs into the arithmetic
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {
            i: (
                torch.zeros(rows, r.conv_kernel - 1, r.conv_dim, dtype=dtype, device=device),
                torch.zeros(rows, r.num_heads, r.key_head_dim, r.value_head_dim, dtype=torch.float32, device=device),
            )
            for i in arch.recurrent_layers
        }
        for i, shapes in extra_states(arch).items():
            self.layers[i] += tuple(torch.zeros(rows, *shape, dtype=dtype, device=device) for shape in shapes)

    @property
    def record_view(self) -> SimpleNamespace:
        """Every state tensor as [1, slots, ...] (a view): the layout the host tier's page stores copy along dim 1,
        so HostKVStore and DiskKVStore hold state records with no code of their own."""
        views = [t.unsqueeze(0) for tensors in self.layers.values() for t in tensors]
        return SimpleNamespace(layers=views, paged_tensors=views)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Slot copies (src, dst) in order (checkpoint captures, then restores; helios.engine.state_checkpoints),
        every linear layer's tensors, on the device's stream (ordered with the forwards)."""
        for src, dst in pairs:
            for tensors in self.layers.values():
                for t in tensors:
                    t[dst].copy_(t[src])

    @staticmethod
    def bytes_per_slot(arch: Architecture, dtype: torch.dtype) -> int:
        """Bytes one slot costs across all linear layers."""
        r = arch.recurrent
        if r is None:
            return 0
        conv = (r.conv_kernel - 1) * r.conv_dim * dtype.itemsize
        recurrent = r.num_heads * r.key_head_dim * r.value_head_dim * 4
        extra = sum(math.prod(shape) for shapes in extra_states(arch).values() for shape in shapes)
        return len(arch.recurrent_layers) * (conv + recurrent) + extra * dtype.itemsize


def extra_states(arch: Architecture) -> dict[int, list[tuple[int, ...]]]:
    """Per linear layer the shapes of the model-dtype state tensors it keeps beside (conv, recurrent): a qwen4_exp
    PLE layer's dilated-conv inputs [W, S*H] (helios.layers.ple)."""
    ple = arch.ple
    if ple is None:
        return {}
    width = arch.hyper_connections.num_streams * arch.hidden_size
    return {i: [(ple.state_width, width)] for i in ple.layers}
