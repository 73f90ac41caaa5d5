"""Linear projections over core tensors stored in torch's [out_features, in_features] orientation.

Weights start on the meta device and are bound without a copy by `helios.models.bind_tensors`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W^T (+ b); `weight` [out, in], optional `bias` [out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table `weight` [vocab, hidden]; also serves as the tied lm_head."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device="meta"), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(token_ids, self.weight)


class Stacked(nn.Module):
    """A bare stacked weight (e.g. MoE experts [E, out, in]) under the name `weight`."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)
