"""Norm folding: the one weight rewrite helios makes, as an explicit load step before the model is built.

On the GPU path of a 16-bit llama-family model (plain gated MLPs, no qkv bias) each layer's attn and mlp norm
weights are multiplied into the columns of its qkv and gate_up weights and the norm weights set to 1, so that a
projection of the un-normed stream times its rstd is the projection of the normed one: batch-1 decode then runs
without norm kernels (helios.models.llama's "norm_free" path) and every other path reads the folded weights (its
norm kernels multiply by 1). Numerics: each weight product is rounded to 16 bits once, where the unfolded path
rounds the normed row times its weight; both within the dtype's tolerance.

Why here and not an ignition transform recorded in the manifest: the fold belongs to one execution target, not
to the checkpoint. The CPU path (float32, parity with transformers bit for bit) and every GPU path with
HELIOS_DEFER_NORMS=0 read the weights as exported, so a core would have to carry both forms or lose them;
done at load, one core serves every target and switch, and the runner reports it (StartupTimes.weights).
Imports torch, helios.core.manifest and helios.models (which families fold).
"""

from __future__ import annotations

import torch

from helios.core.manifest import Architecture
from helios.models import folds_norm_weights
from helios.switches import Switches

# (norm, projection) tensor names of layer i that fold together
FOLDS = (("layers.{i}.attn_norm.weight", "layers.{i}.attn.qkv.weight"),
         ("layers.{i}.mlp_norm.weight", "layers.{i}.mlp.gate_up.weight"))


def should_fold(arch: Architecture, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                fused: bool, switches: Switches) -> bool:
    """The GPU path's rule: the fused (Triton) layers, compiled kernels, a 16-bit dtype on CUDA, the defer_norms
    switch on, and a family whose every layer folds (foldable)."""
    from helios.kernels._triton import HAS_TRITON, interpret_mode

    on_gpu = torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and HAS_TRITON
    return on_gpu and not interpret_mode() and fused and switches.defer_norms and foldable(arch, tensors)


def foldable(arch: Architecture, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every layer has a plain gated MLP and no qkv / o / MLP bias (the family says; the names confirm)."""
    if arch.moe is not None or not folds_norm_weights(arch):
        return False
    for i in range(arch.num_layers):
        for norm, projection in FOLDS:
            if norm.format(i=i) not in tensors or projection.format(i=i) not in tensors:
                return False
        bias = (f"layers.{i}.attn.qkv.bias", f"layers.{i}.attn.o.bias", f"layers.{i}.mlp.gate_up.bias",
                f"layers.{i}.mlp.down.bias")
        if any(name in tensors for name in bias):
            return False
    return True


def fold_norm_weights(arch: Architecture, tensors: dict[str, torch.Tensor]) -> None:
    """Fold every layer's norm weights into its qkv / gate_up weights, in `tensors` (new tensors replace the
    entries: the old ones may be shared with the caller, and each is freed as it goes when they are not)."""
    for i in range(arch.num_layers):
        for norm_name, projection_name in FOLDS:
            norm, projection = tensors[norm_name.format(i=i)], tensors[projection_name.format(i=i)]
            tensors[projection_name.format(i=i)] = projection * norm.to(projection.dtype)
            tensors[norm_name.format(i=i)] = torch.ones_like(norm)
