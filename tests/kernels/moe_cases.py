"""MoE blocks for the fused-MoE tests (tests/kernels/test_fused_moe.py in the interpreter, tests/gpu on CUDA): a torch
path and a fused path of one block with the same random weights, inputs, and a sigmoid-routed config."""

from __future__ import annotations

import torch

from helios.core.manifest import MoeConfig


def bind_random(layers: list[torch.nn.Module], seed: int, dtype: torch.dtype, device: str = "cpu") -> None:
    """The same random weights into each layer: [.., out, in] tensors scaled by 1/sqrt(in) (activations O(1)),
    router biases small, norm weights near 1; drawn in float32 on `device`, cast to dtype."""
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in layers[0].named_parameters():
        t = torch.randn(p.shape, generator=g, device=device)
        t = (0.1 * t + (1.0 if "norm" in name else 0.0)) if p.ndim == 1 else t / p.shape[-1] ** 0.5
        for layer in layers:
            owner, _, leaf = name.rpartition(".")
            layer.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(t.to(dtype), requires_grad=False)


def torch_and_fused(make, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(torch path, fused path) of one block built by make(fused) with the same weights."""
    layers = [make(False), make(True)]
    assert not layers[0].decode_graph_safe and layers[1].decode_graph_safe
    bind_random(layers, seed, dtype, device)
    return layers


def inputs(num_tokens: int, width: int, dtype: torch.dtype, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tokens, width, generator=g, device=device).to(dtype)


def sigmoid_config(**kw) -> MoeConfig:
    """DeepSeek-V3's router at a small size: sigmoid scores, score bias, 2 of 4 groups, scaling, a shared expert."""
    return MoeConfig(**{**dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, scoring="sigmoid",
                               score_bias=True, num_groups=4, num_topk_groups=2, routed_scaling_factor=2.5,
                               shared_expert_intermediate_size=24, shared_expert_gate=False), **kw})
