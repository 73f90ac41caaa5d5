"""Parity of glm5_next (safe-gate KDA + NoPE MLA with the DSA indexer + mHC streams + clamped SwiGLU and sigmoid-routed
MoE) against HF transformers on tiny random checkpoints, text only, through the real path: an HF directory
(Glm5NextForConditionalGeneration), ignition's float32 export, helios.core.load, the ModelRunner with its paged latents
and index rows and its state slots, and the engine (state slots, chunked prefill on the recurrent grid). Prompts run
far past the indexer's budget (16 or 24 tokens), so most pools are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.runner.model_runner import ModelRunner
from tests.models.glm5_next_tiny import VARIANTS, build_glm5_next
from tests.models.hybrid_harness import (
    PAGE_SIZE,
    check_batched_equals_alone,
    check_fused_loop_equals_eager,
    check_greedy_matches_generate,
    check_logits_and_prompt_logprobs,
    check_second_turn,
    check_tiers,
    hf_logits,
    prompt,
)


def export_glm5_next(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint."""
    from transformers import Glm5NextForConditionalGeneration

    from ignition.export import ExportOptions, export_core

    src = build_glm5_next(root / "hf", variant)
    core = load_core(export_core(src, root / "core", ExportOptions(dtype="float32", prompt_logprobs=True)))
    hf = Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    return hf, core


@pytest.fixture(scope="module", params=VARIANTS)
def glm(request, tmp_path_factory):
    hf, core = export_glm5_next(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def _hf_selection(hf, ids: list[int]) -> list[torch.Tensor]:
    """Per indexer layer of HF's forward over ids: [S, S] bool, the keys each query attends to."""
    masks, hooks = [], []

    def record(module, args, kwargs, out):  # out: [1, S, W] token ids, -1 unused
        idx = out[0].long()
        counts = torch.zeros(idx.shape[0], idx.shape[0], dtype=torch.int32)
        masks.append(counts.scatter_add_(1, idx.clamp(min=0), (idx >= 0).int()) > 0)

    for block in hf.model.language_model.layers:
        if getattr(block.self_attn, "indexer", None) is not None:
            hooks.append(block.self_attn.indexer.register_forward_hook(record, with_kwargs=True))
    hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    return masks


def test_the_export_is_glm5_next(glm):
    variant, _, core = glm
    arch = core.manifest.arch
    types = {"base": ["linear", "linear", "linear", "full"], "shared": ["linear", "full", "full", "linear"]}
    assert arch.family == "glm5_next" and arch.layer_types == types[variant]
    assert arch.recurrent.kind == "kimi_delta" and arch.recurrent.gate_lower_bound == -5.0
    assert arch.mla.qk_rope_head_dim == 0 and arch.mla.cache_dim == 16 and arch.position_embedding == "none"
    assert arch.dsa.shared_layers == ([2] if variant == "shared" else [])
    assert arch.mhc.num_streams == (4 if variant == "shared" else 2)


def test_the_runner_keeps_latents_and_index_rows_in_pages(glm):
    """An MLA + DSA layer's pages hold kv_lora_rank values per token and, beside them in a second paged tensor, the
    index key and pool-gate logits (2 x index_head_dim); the host tiers copy both (paged_tensors)."""
    _, _, core = glm
    arch = core.manifest.arch
    runner = ModelRunner(arch, core.tensors, 8, PAGE_SIZE, num_state_slots=2)
    num_attn = len(arch.attention_layers)
    assert [tuple(t.shape) for t in runner.kv_cache.layers] == [(1, 8, PAGE_SIZE, 16)] * num_attn
    assert [tuple(t.shape) for t in runner.kv_cache.index_layers] == [(1, 8, PAGE_SIZE, 32)] * num_attn
    assert len(runner.kv_cache.paged_tensors) == 2 * num_attn
    caches = [runner.layer_caches[i] for i in arch.attention_layers]
    assert all(c[0] is t and c[1] is x for c, t, x in zip(caches, runner.kv_cache.layers,
                                                          runner.kv_cache.index_layers))


def test_logits_and_prompt_logprobs_match(glm):
    _, hf, core = glm
    check_logits_and_prompt_logprobs(hf, core, prompt(150))


def test_the_selection_is_hf_and_drops_pools(glm, monkeypatch):
    """Each query's selected keys equal HF's indexer output, whole and over chunks; most earlier keys are dropped."""
    from helios.layers import dsa

    _, hf, core = glm
    ids = prompt(150, seed=3)
    want = _hf_selection(hf, ids)
    got: list[list[torch.Tensor]] = []
    select = dsa.DsaIndexer.select

    def spy(self, q, weights, rows):
        mask = select(self, q, weights, rows)
        got.append(mask)
        return mask

    monkeypatch.setattr(dsa.DsaIndexer, "select", spy)
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, num_state_slots=1)
    for chunk in (None, 64):
        got.clear()
        runner.forward_logits(ids, chunk_size=chunk)
        per_layer = len(want)
        for j, ref in enumerate(want):  # chunks come layer by layer: chunk c of layer j is got[c * layers + j]
            rows = torch.cat([torch.nn.functional.pad(m, (0, len(ids) - m.shape[1])) for m in got[j::per_layer]])
            assert torch.equal(rows, ref), (chunk, j)
    causal = torch.ones(150, 150, dtype=torch.bool).tril()
    assert want[0].sum() < 0.4 * causal.sum()


def test_greedy_matches_generate(glm):
    _, hf, core = glm
    check_greedy_matches_generate(hf, core, prompt(90, seed=5))


def test_sixteen_requests_together_give_what_each_gives_alone(glm):
    _, _, core = glm
    check_batched_equals_alone(core, [prompt(7 + 23 * i, seed=10 + i) for i in range(16)])


def test_a_second_turn_reuses_pages_and_state(glm):
    """Prefix reuse: the first turn's latent pages and index rows and a KDA state checkpoint at 128 tokens serve
    the second turn, which gives exactly the tokens of a run without reuse."""
    _, _, core = glm
    check_second_turn(core, prompt(100, seed=21), prompt(30, seed=22))


def test_index_rows_travel_with_their_pages_through_host_dram_and_disk(glm, tmp_path):
    """A conversation's KDA checkpoint pushed into host DRAM, then with its latent pages and index rows through the
    host pages onto disk (and read back after a restart): the second turn still gives the tokens of a run without
    reuse (tests/models/test_hybrid_parity's tiers, with the index rows riding in every page copy)."""
    variant, _, core = glm
    if variant != "base":
        pytest.skip("one variant covers the tiers")
    check_tiers(core, tmp_path)

def test_the_fused_norms_give_the_eager_paths_logits(glm):
    """The GPU path's norms (Glm5NextLayer.fused_norms: one Triton launch each; the mHC streams keep their adds) =
    the torch norms' logits."""

    def fuse(model):
        for layer in model.layers:
            layer.fused_norms = True

    check_fused_loop_equals_eager(glm[2], fuse, is_fused=lambda model: all(l.fused_norms for l in model.layers))

