"""Parity of nemotron_h (Mamba-2 + positionless attention + relu2 MLP + sigmoid-routed MoE) against HF transformers
on tiny random checkpoints, through the real path: an HF directory, ignition's float32 export, helios.core.load,
the ModelRunner with its paged KV and state slots, and the engine (state slots, chunked prefill on the recurrent
grid)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.layers.moe import route_sigmoid
from tests.models.nemotron_h_tiny import VARIANTS, build_nemotron_h
from tests.models.hybrid_harness import (
    check_batched_equals_alone,
    check_fused_loop_equals_eager,
    check_greedy_matches_generate,
    check_logits_and_prompt_logprobs,
    prompt,
)


def export_nemotron_h(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_nemotron_h(root / "hf", variant)
    core = load_core(export_core(src, root / "core", ExportOptions(dtype="float32", prompt_logprobs=True)))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return hf, core


@pytest.fixture(scope="module", params=VARIANTS)
def nemotron(request, tmp_path_factory):
    hf, core = export_nemotron_h(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def test_the_export_is_nemotron_h(nemotron):
    variant, _, core = nemotron
    arch = core.manifest.arch
    types = {"grouped": ["linear", "ffn", "full", "ffn", "linear", "ffn"], "latent": ["linear", "full", "ffn", "ffn"]}
    assert arch.family == "nemotron_h" and arch.layer_types == types[variant]
    assert arch.recurrent.kind == "mamba2" and arch.moe.scoring == "sigmoid" and arch.position_embedding == "none"


def test_logits_and_prompt_logprobs_match(nemotron):
    _, hf, core = nemotron
    check_logits_and_prompt_logprobs(hf, core, prompt(150), chunk_size=32)


def test_greedy_matches_generate(nemotron):
    _, hf, core = nemotron
    check_greedy_matches_generate(hf, core, prompt(90, seed=5))


def test_sixteen_requests_together_give_what_each_gives_alone(nemotron):
    _, _, core = nemotron
    check_batched_equals_alone(core, [prompt(7 + 23 * i, seed=10 + i) for i in range(16)])


@pytest.mark.parametrize(("num_groups", "num_topk_groups", "norm_topk_prob"), [(1, 1, True), (4, 2, True),
                                                                                (8, 3, False)])
def test_sigmoid_router_matches_hf(num_groups, num_topk_groups, norm_topk_prob):
    """route_sigmoid against NemotronHTopkRouter (DeepseekV3TopkRouter's twin): the same experts and weights."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from tests.models.nemotron_h_tiny import config

    cfg = config(n_routed_experts=32, num_experts_per_tok=4, n_group=num_groups, topk_group=num_topk_groups,
                 norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    router = NemotronHTopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) / 8)
        router.e_score_correction_bias.copy_(0.1 * torch.randn(32, generator=gen))
    x = torch.randn(40, 64, generator=gen)
    logits, hf_weights, hf_experts = router(x)
    weights, experts = route_sigmoid(x @ router.weight.T, 4, router.e_score_correction_bias, num_groups,
                                     num_topk_groups, norm_topk_prob, 2.5)
    order, hf_order = experts.sort(dim=-1), hf_experts.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices),
                               atol=1e-6, rtol=1e-6)


def test_the_fused_path_gives_the_eager_paths_logits(nemotron):
    """The GPU path's layer loop (NemotronHBlock.forward_fused through pre_norm_stack) = the eager loop's logits."""
    check_fused_loop_equals_eager(nemotron[2], fuse=lambda model: setattr(model, "path", "fused"),
                                  is_fused=lambda model: model.path == "fused")

