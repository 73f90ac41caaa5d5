"""gemma4's per-layer embedding (PLE) inputs: (norm(proj / sqrt(H)) + table rows * sqrt(P)) / sqrt(2) per layer
slice; the torch ops, or on the Triton path one launch (helios.kernels.ple_inputs) with the same roundings."""

from __future__ import annotations

import torch

from helios.layers.norm import RMSNorm


def per_layer_inputs(
    proj: torch.Tensor,  # [T, L * P] the projection of the scaled embedding
    rows: torch.Tensor,  # [T, L * P] the PLE table's rows of the tokens
    norm: RMSNorm,  # over P, its weight multiplied in float32
    num_layers: int,
    proj_scale: float,  # H^-0.5
    row_scale: float,  # sqrt(P): HF rounds it to the dtype first
    kernel: bool = False,
) -> torch.Tensor:  # [T, L, P]
    num_tokens = proj.shape[0]
    if kernel and proj.dim() == 2 and norm.weight is not None and norm.multiply_in_float32 and not norm.scale_first:
        from helios.kernels.ple_inputs import ple_inputs

        return ple_inputs(proj, rows, norm.weight, norm.eps, num_layers, proj_scale, row_scale)
    rows = rows * torch.tensor(row_scale).to(proj.dtype)
    proj = norm((proj * proj_scale).reshape(num_tokens, num_layers, -1))
    return (proj + rows.reshape(proj.shape)) * 2.0**-0.5
