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
from helios.runner.model_runner import ModelRunner
from tests.models.nemotron_h_tiny import VARIANTS, build_nemotron_h
from tests.models.test_hybrid_parity import PAGE_SIZE, generate, greedy_request, hf_logits, make_engine, prompt


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
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, num_state_slots=1)
    ids = prompt(150)
    ref = hf_logits(hf, ids)
    whole = runner.forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    # chunks on the recurrent grid (the SSD chunk is 8 or 16) carry the state: the same rows as the whole prompt
    chunked = runner.forward_logits(ids, chunk_size=32)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)


def test_greedy_matches_generate(nemotron):
    _, hf, core = nemotron
    ids, num_new = prompt(90, seed=5), 32
    got = generate(make_engine(core, chunk=64), [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


def test_sixteen_requests_together_give_what_each_gives_alone(nemotron):
    _, _, core = nemotron
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    # a budget of 128 tokens: prompts up to 352 tokens split into grid chunks beside the others' decodes
    together = generate(make_engine(core, budget=128), reqs)
    for r in reqs:
        alone = generate(make_engine(core, max_concurrency=1, budget=512, chunk=512), [r])[r.req_id]
        assert together[r.req_id] == alone, r.req_id


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
