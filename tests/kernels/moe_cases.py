"""MoE blocks for the fused-MoE tests (tests/kernels/test_fused_moe*.py in the interpreter, tests/gpu on CUDA): a torch
path and a fused path of one block with the same random weights, inputs, and a sigmoid-routed config; every MoE
family's own blocks, built by its model class from its tiny checkpoint's Architecture."""

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


# --- every MoE family's own block (tests/kernels/test_fused_moe_families.py, tests/gpu/test_fused_moe_cuda.py) ---

MOE_REFUSAL = "MoE routing syncs with the host"  # helios.runner.cuda_graphs.unsupported_reason's MoE answer


def family_builders() -> dict:
    """family -> build(out_dir) of its tiny checkpoint with routed experts (tests/models/*_tiny.py), each with the
    family's routing options (the comments say which)."""
    from tests.models import (deepseek_v4_tiny, gemma4_tiny, glm5_next_tiny, kimi_linear_tiny, mimo_v2_flash_tiny,
                              minimax_m3_tiny, muse_spark_tiny, nemotron_h_tiny, qwen4_exp_tiny, step3p7_tiny)

    return {
        "gemma4": lambda out: gemma4_tiny.build_gemma4(out, "moe"),  # softmax top-k, the router reads another input
        "mimo_v2_flash": mimo_v2_flash_tiny.build_mimo,  # sigmoid + bias, 2 groups, no shared expert
        "minimax_m3": minimax_m3_tiny.build_minimax_m3,  # SwiGLU-OAI with its clamp, a shared expert
        "muse_spark": muse_spark_tiny.build_muse_spark,  # the experts inside normed latent projections
        "step3p7": step3p7_tiny.build_step3p7,  # clamps after the activation (its first MoE layer: 0.4), scaling
        "glm5_next": glm5_next_tiny.build_glm5_next,  # sigmoid + bias, clamped SwiGLU, mHC streams
        "kimi_linear": kimi_linear_tiny.build_kimi_linear,  # sigmoid + bias, a shared expert
        "nemotron_h": nemotron_h_tiny.build_nemotron_h,  # relu2 experts, 2 groups, scaling 2.5
        "deepseek_v4": deepseek_v4_tiny.build_deepseek_v4,  # sqrtsoftplus + bias; hash layers (tid2eid rows)
        "qwen4_exp": lambda out: qwen4_exp_tiny.build_qwen4_exp("plain", out),  # softmax + a gated shared expert
    }


def family_arch(family: str, out_dir):
    """The family's tiny checkpoint's Architecture (ignition's convert only: no tensor is produced)."""
    from ignition.archs import convert
    from ignition.sources.hf import open_hf_dir

    return convert(open_hf_dir(family_builders()[family](out_dir)), torch.float32)[0]


def arch_getter(root):
    """family -> its tiny checkpoint's Architecture (family_arch under root / family), each built on first use: a
    module fixture's value."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = family_arch(family, root / family)
        return cache[family]

    return get


def unbound_model(arch, backend, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The family's model on `backend` with its parameters still on meta (a test binds the blocks it runs)."""
    from helios.models import model_class

    return model_class(arch.family)(arch, backend, device, dtype=dtype)


def moe_blocks(model) -> dict:
    """The model's routed MoE blocks by module name."""
    from helios.layers.moe import RoutedMoe

    return {name: m for name, m in model.named_modules() if isinstance(m, RoutedMoe)}


def blocks_to_run(family: str, blocks: dict) -> list[str]:
    """The first MoE block; for deepseek_v4 also the first of the other routing kind (hash / by score)."""
    names = [next(iter(blocks))]
    if family == "deepseek_v4":
        names.append(next(n for n, b in blocks.items() if b.is_hash != blocks[names[0]].is_hash))
    return names


def run_block(block, family: str, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The block called as its layer calls it: gemma4's router reads another input (the un-normed stream),
    deepseek_v4's block takes the token ids (the hash layers' table rows)."""
    if family == "gemma4":
        return block(x, router_input=x.flip(-1))
    if family == "deepseek_v4":
        return block(x, token_ids)
    return block(x)


def bind_block_weights(pair: list, num_experts: int, seed: int, dtype: torch.dtype = torch.float32,
                       device: str = "cpu") -> None:
    """bind_random's weights; a hash table (deepseek_v4's tid2eid) gets distinct expert ids in each row instead."""
    bind_random(pair, seed, dtype, device)
    if getattr(pair[0], "tid2eid", None) is not None:
        g = torch.Generator().manual_seed(seed)
        rows, k = pair[0].tid2eid.shape
        table = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(rows)]).to(dtype)
        for block in pair:
            block.tid2eid = torch.nn.Parameter(table.to(device), requires_grad=False)
