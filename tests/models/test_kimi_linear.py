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
from tests.models.test_hybrid_parity import PAGE_SIZE, generate, greedy_request, hf_logits, make_engine, prompt


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
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, num_state_slots=1)
    ids = prompt(150)
    ref = hf_logits(hf, ids)
    whole = runner.forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    # chunks on the KDA grid (64) carry the state and read the earlier chunks' latents: the same rows as whole
    chunked = runner.forward_logits(ids, chunk_size=64)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)


def test_greedy_matches_generate(kimi):
    _, hf, core = kimi
    ids, num_new = prompt(90, seed=5), 32
    got = generate(make_engine(core, chunk=64), [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


def test_sixteen_requests_together_give_what_each_gives_alone(kimi):
    _, _, core = kimi
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    # a budget of 128 tokens: prompts up to 352 tokens split into grid chunks beside the others' decodes
    together = generate(make_engine(core, budget=128), reqs)
    for r in reqs:
        alone = generate(make_engine(core, max_concurrency=1, budget=512, chunk=512), [r])[r.req_id]
        assert together[r.req_id] == alone, r.req_id


def test_a_second_turn_reuses_latent_pages_and_state(kimi):
    """Prefix reuse: the first turn's latent pages and a KDA state checkpoint at 128 tokens serve the second turn,
    which gives exactly the tokens of a run without reuse."""
    _, _, core = kimi
    engine = make_engine(core, max_concurrency=4, checkpoints=2)
    first = greedy_request("t1", prompt(100, seed=21), 60)  # its decode passes 128: the endpoint checkpoint
    history = first.prompt_token_ids + generate(engine, [first])["t1"]
    second = greedy_request("t2", history + prompt(30, seed=22), 16)
    outputs = []
    engine.add_request(second)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].num_cached_tokens == 128
    reused = [t for o in outputs for t in o.new_token_ids]
    assert reused == generate(make_engine(core, max_concurrency=4), [second])["t2"]


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
