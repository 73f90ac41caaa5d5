"""Parity of minimax_m3 (GQA with q/k norms and partial rotary, lightning-indexer block-sparse layers, SwiGLU-OAI MLPs
and sigmoid-routed experts with a shared expert) against HF transformers on tiny random checkpoints, text only, through
the real path: an HF directory (the wrapper with a vision tower, or the text ForCausalLM), ignition's float32 export,
helios.core.load, the ModelRunner with its paged K/V and index keys, and the engine. Prompts run far past the
indexer's budget (16 or 24 tokens), so most key blocks are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.runner.model_runner import ModelRunner
from tests.models.engine_harness import greedy, make_engine, run, tokens
from tests.models.hybrid_harness import (
    PAGE_SIZE,
    check_batched_equals_alone,
    check_greedy_matches_generate,
    check_logits_and_prompt_logprobs,
    export_float32,
    hf_logits,
    prompt,
)
from tests.models.minimax_m3_tiny import VARIANTS, build_minimax_m3


def export_minimax_m3(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint."""
    import transformers as T

    cls = T.MiniMaxM3VLForCausalLM if variant == "text" else T.MiniMaxM3SparseForConditionalGeneration
    return export_float32(cls, build_minimax_m3(root / "hf", variant), root)


@pytest.fixture(scope="module", params=VARIANTS)
def mm3(request, tmp_path_factory):
    hf, core = export_minimax_m3(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def _text_layers(hf):
    return hf.model.language_model.layers if hasattr(hf.model, "language_model") else hf.model.layers


def _hf_selection(hf, ids: list[int]) -> list[torch.Tensor]:
    """Per sparse layer of HF's forward over ids: [S, Ni, S] bool, the keys each query attends to per index head
    (HF's block indices expanded to their keys, causal)."""
    masks, hooks = [], []

    def record(module, args, out):  # out: [1, Ni, S, topk] block ids, -1 unused
        idx = out[0].permute(1, 0, 2).long()  # [S, Ni, topk]
        seq_len, size = idx.shape[0], module.block_size
        blocks = torch.zeros(seq_len, idx.shape[1], -(-seq_len // size) + 1, dtype=torch.bool)
        blocks.scatter_(-1, torch.where(idx < 0, blocks.shape[-1] - 1, idx), True)
        keys = blocks[..., :-1].repeat_interleave(size, dim=-1)[..., :seq_len]
        masks.append(keys & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[:, None, :])

    for block in _text_layers(hf):
        if block.self_attn.indexer is not None:
            hooks.append(block.self_attn.indexer.register_forward_hook(record))
    hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    return masks


def test_the_export_is_minimax_m3(mm3):
    variant, hf, core = mm3
    arch = core.manifest.arch
    text = hf.config.get_text_config()
    assert arch.family == "minimax_m3" and arch.qk_norm and arch.swiglu_alpha == text.swiglu_alpha
    assert arch.msa.layers == [i for i, t in enumerate(text.layer_types) if t == "minimax_m3_sparse"]
    assert (arch.msa.block_size, arch.msa.num_blocks) == (text.index_block_size, text.index_topk_blocks)
    assert arch.rotary_dim == (8 if variant == "wrapper" else None) and arch.index_dim == 16
    assert arch.moe.dense_layers == [i for i, t in enumerate(text.mlp_layer_types) if t == "dense"]


def test_the_runner_keeps_index_keys_in_pages(mm3):
    """Every attention layer keeps its K/V pages and, beside them in a second paged tensor, each token's index key
    (index_head_dim values); the forward takes the pairs and the host tiers copy both (paged_tensors)."""
    _, _, core = mm3
    arch = core.manifest.arch
    runner = ModelRunner(arch, core.tensors, 8, PAGE_SIZE)
    assert [tuple(t.shape) for t in runner.kv_cache.index_layers] == [(1, 8, PAGE_SIZE, 16)] * arch.num_layers
    assert len(runner.kv_cache.paged_tensors) == 2 * arch.num_layers
    assert all(c[0] is t and c[1] is x for c, t, x in zip(runner.layer_caches, runner.kv_cache.layers,
                                                          runner.kv_cache.index_layers))


def test_logits_and_prompt_logprobs_match(mm3):
    _, hf, core = mm3
    check_logits_and_prompt_logprobs(hf, core, prompt(150))


def test_the_selection_is_hf_and_drops_blocks(mm3, monkeypatch):
    """Each query's selected keys per index head equal HF's indexer output, whole and over chunks; most earlier keys
    are dropped."""
    from helios.layers import msa

    _, hf, core = mm3
    ids = prompt(150, seed=3)
    want = _hf_selection(hf, ids)
    got: list[torch.Tensor] = []
    select = msa.LightningIndexer.select

    def spy(self, q, keys):
        mask = select(self, q, keys)
        got.append(mask)
        return mask

    monkeypatch.setattr(msa.LightningIndexer, "select", spy)
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE)
    for chunk in (None, 37):
        got.clear()
        runner.forward_logits(ids, chunk_size=chunk)
        for j, ref in enumerate(want):  # chunk c of sparse layer j is got[c * len(want) + j]
            rows = torch.cat([torch.nn.functional.pad(m, (0, len(ids) - m.shape[-1])) for m in got[j::len(want)]])
            assert torch.equal(rows, ref), (chunk, j)
    causal = torch.ones(150, 150, dtype=torch.bool).tril()
    assert want[0].sum() < 0.3 * causal.sum() * want[0].shape[1]


def test_tied_blocks_go_to_the_earlier_one_whatever_the_chunk():
    """Every block scores the same (one key repeated): each query keeps its own block and the earliest others, and a
    chunk's rows are the whole prompt's rows (the selection never depends on the queries around it)."""
    from helios.core.manifest import MsaConfig
    from helios.layers.msa import LightningIndexer

    config = MsaConfig(num_heads=2, head_dim=8, block_size=4, num_blocks=3, local_blocks=1, layers=[0])
    indexer = LightningIndexer(16, config, 1e-6)
    q = torch.randn(40, 2, 8, generator=torch.Generator().manual_seed(0))
    keys = torch.randn(1, 8, generator=torch.Generator().manual_seed(1)).expand(40, 8)
    whole = indexer.select(q, keys)  # [40, 2, 40]
    for p in (3, 13, 39):
        kept = {b for b in range(10) if whole[p, 0, 4 * b]} | {p // 4}
        assert kept == (set(range(p // 4 + 1)) if p < 12 else {0, 1, p // 4}), p
    assert torch.equal(whole[:, 0], whole[:, 1])
    for start, end in ((0, 7), (7, 21), (21, 40)):
        assert torch.equal(indexer.select(q[start:end], keys[:end]), whole[start:end, :, :end])


def test_greedy_matches_generate(mm3):
    _, hf, core = mm3
    check_greedy_matches_generate(hf, core, prompt(90, seed=5))


def test_sixteen_requests_together_give_what_each_gives_alone(mm3):
    variant, _, core = mm3
    if variant != "wrapper":
        pytest.skip("one variant covers batching")
    check_batched_equals_alone(core, [prompt(7 + 23 * i, seed=10 + i) for i in range(16)])


def test_a_second_turn_reuses_pages_and_index_keys(mm3):
    """Prefix reuse: the first turn's K/V pages and index keys serve the second turn, which gives exactly the tokens
    of a run without reuse."""
    _, _, core = mm3
    first = prompt(100, seed=21)
    history = first + tokens(run(make_engine(core, page_size=PAGE_SIZE), [_req("t1", first, 40)])["t1"])
    second = _req("t2", history + prompt(30, seed=22), 16)
    engine = make_engine(core, page_size=PAGE_SIZE)
    run(engine, [_req("t1", first, 40)])
    reused = run(engine, [second])["t2"]
    assert reused[-1].num_cached_tokens == len(history) // PAGE_SIZE * PAGE_SIZE
    fresh = run(make_engine(core, page_size=PAGE_SIZE, enable_prefix_caching=False), [second])["t2"]
    assert tokens(reused) == tokens(fresh)


def _req(req_id: str, ids: list[int], max_tokens: int):
    from helios.engine.messages import EngineRequest

    return EngineRequest(req_id=req_id, prompt_token_ids=ids, sampling=greedy(max_tokens, ignore_eos=True))


def test_the_fused_path_gives_the_eager_paths_logits(mm3):
    """The GPU path's layer loop (MiniMaxM3Layer.forward_fused through pre_norm_stack: each residual add taken by the
    next norm's launch) = the eager loop's logits."""
    from tests.models.hybrid_harness import check_fused_loop_equals_eager

    check_fused_loop_equals_eager(mm3[2], fuse=lambda model: setattr(model, "path", "fused"),
                                  is_fused=lambda model: model.path == "fused")


def test_decode_steps_on_the_triton_backend_give_the_torch_logits(mm3):
    """Every position fed as a one-token decode step on the Triton backend (the kernels in the interpreter: the sparse
    layers' q/k and index rotations in one launch each, the choice from block_scores' boosted scores in one sort,
    the fused residual norms) = the torch runner's float32 logits of the whole prompt, within 1e-4; 32 tokens: past
    the indexer's budget, so blocks are dropped."""
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()
    _, _, core = mm3
    arch, ids = core.manifest.arch, prompt(32, seed=7)
    want = ModelRunner(arch, core.tensors, 16, PAGE_SIZE, attention_backend="torch").forward_logits(ids)
    runner = ModelRunner(arch, core.tensors, 16, PAGE_SIZE, attention_backend="triton")
    assert runner.model.path == "fused"
    torch.testing.assert_close(runner.forward_logits(ids, chunk_size=1), want, atol=1e-4, rtol=1e-4)
