"""Manifold-constrained hyper-connections (mHC: glm5_next, deepseek_v4): the residual stream is S streams of the
hidden size, [T, S, H]; before a sublayer one projection of the normed streams gives per token the collapse weights
(pre), the expansion weights (post) and a doubly stochastic mix of the streams (comb, Sinkhorn); after it the streams
become post * y + comb^T x (helios.core.manifest.MhcConfig). The torch path is helios.kernels.mhc's references;
`fused` (the Triton backend) takes its kernels: three launches per sublayer instead of ~150 torch kernels. qwen4_exp's
gated residual (hyper_connections.py) is another scheme: no mix matrix, no Sinkhorn. Imports torch, helios.core,
helios.layers and helios.kernels.mhc only."""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import MhcConfig
from helios.kernels import mhc as mhc_kernels
from helios.layers.linear import linear, meta_parameter


class ManifoldHyperConnection(nn.Module):
    """The weights around one sublayer. Tensors bound (layers.L.attn_hc.* / mlp_hc.*): proj.weight
    [(2 + S)*S, S*H] (rows: pre, post, comb row-major), bias [(2 + S)*S], scale [3] (pre, post, comb).
    fused: helios.kernels.mhc's launches (the GPU path) instead of the torch ops."""

    def __init__(self, hidden_size: int, config: MhcConfig, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.config = config
        self.eps = eps  # the streams' unweighted RMSNorm (arch.rms_norm_eps)
        self.fused = fused
        s = config.num_streams
        self.proj = nn.Module()
        self.proj.weight = meta_parameter((2 + s) * s, s * hidden_size)
        self.bias = meta_parameter((2 + s) * s)
        self.scale = meta_parameter(3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, S, H] -> (post [T, S], comb [T, S, S] float32, the sublayer's input [T, H] in x's dtype), as
        Glm5NextTextHyperConnection (in float32)."""
        c = self.config
        args = (x, self.proj.weight, self.bias, self.scale, self.eps, c.eps, c.sinkhorn_iterations)
        if self.fused:
            return mhc_kernels.mhc_pre(*args)
        return mhc_kernels.mhc_pre_ref(*args, linear=linear)

    def expand(
        self,
        x: torch.Tensor,  # [T, S, H] the streams before the sublayer
        y: torch.Tensor,  # [T, H] its output
        post: torch.Tensor,  # [T, S] float32
        comb: torch.Tensor,  # [T, S, S] float32
    ) -> torch.Tensor:  # [T, S, H] in x's dtype
        """Stream n becomes post_n y + sum_m comb_mn x_m (helios.kernels.mhc.mhc_expand_ref)."""
        return (mhc_kernels.mhc_expand if self.fused else mhc_kernels.mhc_expand_ref)(x, y, post, comb)


class HyperHead(nn.Module):
    """deepseek_v4's head over the streams (HF's DeepseekV4HyperHead): the streams' weighted sum, weights sigmoid(scale * proj(unit-RMS streams) + bias)
    + eps. Tensors bound: hc_head.proj.weight [S, S*H], hc_head.bias [S], hc_head.scale [1]. fused:
    helios.kernels.mhc.hyper_head (two launches) instead of the torch ops."""

    def __init__(self, hidden_size: int, num_streams: int, eps: float, hc_eps: float, fused: bool = False) -> None:
        super().__init__()
        self.eps, self.hc_eps = eps, hc_eps
        self.fused = fused
        self.proj = nn.Module()
        self.proj.weight = meta_parameter(num_streams, num_streams * hidden_size)
        self.bias = meta_parameter(num_streams)
        self.scale = meta_parameter(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, S, H] -> [T, H]
        args = (x, self.proj.weight, self.bias, self.scale, self.eps, self.hc_eps)
        return mhc_kernels.hyper_head(*args) if self.fused else mhc_kernels.hyper_head_ref(*args, linear=linear)
