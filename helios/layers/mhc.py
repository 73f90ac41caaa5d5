"""Manifold-constrained hyper-connections (mHC, glm5_next): the residual stream is S streams of the hidden size,
[T, S, H]; before a sublayer one projection of the normed streams gives per token the collapse weights (pre), the
expansion weights (post) and a doubly stochastic mix of the streams (comb, Sinkhorn); after it the streams become
post * y + comb^T x (helios.core.manifest.MhcConfig). qwen4_exp's gated residual (hyper_connections.py) is another
scheme: no mix matrix, no Sinkhorn. Imports torch and helios.layers only.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import MhcConfig
from helios.layers.linear import linear, meta_parameter
from helios.layers.recurrent import sigmoid


def weighted_sum(
    weights: torch.Tensor,  # [T, M] float32
    x: torch.Tensor,  # [T, M, H]
) -> torch.Tensor:  # [T, H] float32
    """sum_m weights[:, m] * x[:, m] as a chain of elementwise ops: a row's bits never depend on the batch (HF's
    broadcast sum / matmul rounds within float32 of it)."""
    out = weights[:, 0, None] * x[:, 0].float()
    for m in range(1, x.shape[1]):
        out = out + weights[:, m, None] * x[:, m].float()
    return out


class ManifoldHyperConnection(nn.Module):
    """The weights around one sublayer. Tensors bound (layers.L.attn_hc.* / mlp_hc.*): proj.weight
    [(2 + S)*S, S*H] (rows: pre, post, comb row-major), bias [(2 + S)*S], scale [3] (pre, post, comb)."""

    def __init__(self, hidden_size: int, config: MhcConfig, eps: float) -> None:
        super().__init__()
        self.config = config
        self.eps = eps  # the streams' unweighted RMSNorm (arch.rms_norm_eps)
        s = config.num_streams
        self.proj = nn.Module()
        self.proj.weight = meta_parameter((2 + s) * s, s * hidden_size)
        self.bias = meta_parameter((2 + s) * s)
        self.scale = meta_parameter(3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, S, H] -> (post [T, S], comb [T, S, S] float32, the sublayer's input [T, H] in x's dtype), as
        Glm5NextTextHyperConnection (in float32)."""
        c, s = self.config, self.config.num_streams
        flat = x.reshape(x.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        mixed = linear(flat, self.proj.weight.float())  # [T, (2 + S)*S]
        bias, scale = self.bias.float(), self.scale.float()
        pre_w, post_w, comb_w = mixed.split([s, s, s * s], dim=-1)
        pre_b, post_b, comb_b = bias.split([s, s, s * s])
        # NOTE: recurrent's exp-based sigmoid: the same bits at every row offset (F.sigmoid's SIMD tail differs)
        pre = sigmoid(pre_w * scale[0] + pre_b) + c.eps
        post = 2 * sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, s, s) * scale[2] + comb_b.view(s, s), dim=-1) + c.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + c.eps)
        for _ in range(c.sinkhorn_iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + c.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + c.eps)
        return post, comb, weighted_sum(pre, x).to(x.dtype)


def expand_streams(
    x: torch.Tensor,  # [T, S, H] the streams before the sublayer
    y: torch.Tensor,  # [T, H] its output
    post: torch.Tensor,  # [T, S] float32
    comb: torch.Tensor,  # [T, S, S] float32
) -> torch.Tensor:  # [T, S, H] in x's dtype
    """Stream n becomes post_n y + sum_m comb_mn x_m (HF: post.unsqueeze(-1) * y.unsqueeze(-2) + comb^T @ x, with
    post and comb cast to the model dtype first)."""
    post, comb = post.to(x.dtype), comb.to(x.dtype)
    out = [post[:, n, None] * y + weighted_sum(comb[:, :, n], x).to(x.dtype) for n in range(x.shape[1])]
    return torch.stack(out, dim=1)
