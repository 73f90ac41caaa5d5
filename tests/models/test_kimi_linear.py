"""Parity of kimi_linear (Kimi delta attention + NoPE multi-head latent attention + sigmoid-routed MoE with shared
experts) against HF transformers on tiny random checkpoints, through the real path: an HF directory, ignition's
float32 export, helios.core.load, the ModelRunner with its paged latent KV and state slots, and the engine (state
slots, chunked prefill on the recurrent grid)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.layers.moe import route_sigmoid
from helios.runner.model_runner import ModelRunner
from tests.models.kimi_linear_tiny import VARIANTS, build_kimi_linear
from tests.models.hybrid_harness import (
    PAGE_SIZE,
    check_batched_equals_alone,
    check_fused_loop_equals_eager,
    check_greedy_matches_generate,
    check_logits_and_prompt_logprobs,
    check_second_turn,
    prompt,
)


def export_kimi_linear(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_kimi_linear(root / "hf", variant)
    core = load_core(export_core(src, root / "core", ExportOptions(dtype="float32", prompt_logprobs=True)))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return hf, core


@pytest.fixture(scope="module", params=VARIANTS)
def kimi(request, tmp_path_factory):
    hf, core = export_kimi_linear(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def test_the_export_is_kimi_linear(kimi):
    variant, _, core = kimi
    arch = core.manifest.arch
    types = {"base": ["linear", "linear", "linear", "full"], "grouped": ["linear", "full", "linear", "full"]}
    assert arch.family == "kimi_linear" and arch.layer_types == types[variant]
    assert arch.recurrent.kind == "kimi_delta" and arch.moe.scoring == "sigmoid" and arch.position_embedding == "none"
    assert arch.mla.q_lora_rank == (24 if variant == "grouped" else None) and arch.mla.cache_dim == 16 + 8


def test_the_runner_keeps_latents_not_heads(kimi):
    """The MLA layers' pages hold kv_lora_rank + qk_rope_head_dim values per token, not 2 x heads x head_dim."""
    _, _, core = kimi
    arch = core.manifest.arch
    runner = ModelRunner(arch, core.tensors, 8, PAGE_SIZE, num_state_slots=2)
    assert [tuple(t.shape) for t in runner.kv_cache.layers] == [(1, 8, PAGE_SIZE, 24)] * len(arch.attention_layers)
    mla_caches = [runner.layer_caches[i] for i in arch.attention_layers]
    assert all(c is t for c, t in zip(mla_caches, runner.kv_cache.layers))


def test_logits_and_prompt_logprobs_match(kimi):
    _, hf, core = kimi
    check_logits_and_prompt_logprobs(hf, core, prompt(150))


def test_greedy_matches_generate(kimi):
    _, hf, core = kimi
    check_greedy_matches_generate(hf, core, prompt(90, seed=5))


def test_sixteen_requests_together_give_what_each_gives_alone(kimi):
    _, _, core = kimi
    check_batched_equals_alone(core, [prompt(7 + 23 * i, seed=10 + i) for i in range(16)])


def test_a_second_turn_reuses_latent_pages_and_state(kimi):
    """Prefix reuse: the first turn's latent pages and a KDA state checkpoint at 128 tokens serve the second turn,
    which gives exactly the tokens of a run without reuse."""
    _, _, core = kimi
    check_second_turn(core, prompt(100, seed=21), prompt(30, seed=22))


@pytest.mark.parametrize(("num_groups", "num_topk_groups", "norm_topk_prob"), [(1, 1, True), (4, 2, True),
                                                                                (8, 3, False)])
def test_sigmoid_router_matches_hf(num_groups, num_topk_groups, norm_topk_prob):
    """route_sigmoid against KimiLinearTopkRouter: the same experts and weights."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    from tests.models.kimi_linear_tiny import config

    cfg = config(num_experts=32, num_experts_per_token=4, num_expert_group=num_groups, topk_group=num_topk_groups,
                 moe_renormalize=norm_topk_prob, routed_scaling_factor=2.5)
    router = KimiLinearTopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) / 8)
        router.e_score_correction_bias.copy_(0.1 * torch.randn(32, generator=gen))
    x = torch.randn(40, 64, generator=gen)
    _, hf_weights, hf_experts = router(x)
    weights, experts = route_sigmoid(x @ router.weight.T, 4, router.e_score_correction_bias, num_groups,
                                     num_topk_groups, norm_topk_prob, 2.5)
    order, hf_order = experts.sort(dim=-1), hf_experts.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices),
                               atol=1e-6, rtol=1e-6)


def test_the_fused_path_gives_the_eager_paths_logits(kimi):
    """The GPU path's layer loop (KimiLinearLayer.forward_fused through pre_norm_stack) = the eager loop's logits."""
    check_fused_loop_equals_eager(kimi[2], fuse=lambda model: setattr(model, "path", "fused"),
                                  is_fused=lambda model: model.path == "fused")

