"""Parity of qwen4_exp (GDN + QSA-indexed gated attention + hyper-connections + MoE, with and without PLE n-gram
embeddings) against HF transformers on tiny random checkpoints, through the real path: an HF directory, ignition's
float32 export, helios.core.load, the ModelRunner with its paged KV (+ index keys) and state slots (+ PLE conv
state), and the engine. Prompts run past indexer_budget (8 tokens), so QSA drops blocks; the PLE prompts carry EOS
tokens, which restart the n-gram context.

The checkpoints here have 8 index heads (TIE_FREE), not the builder's 2: a block scores exactly 0 when every index
head's product is negative (relu), so with 2 heads a quarter of the blocks tie at 0, and where such a tie straddles
the cut HF's torch.topk keeps blocks by its own, device-dependent order while helios keeps the earlier ones
(helios.layers.qsa.Indexer.select); with 8 heads (2^-8 per block) no tie decides a choice in these prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.layers.attention import AttentionMetadata
from helios.layers.ple import ngram_token_ids
from tests.ignition.tiny_models import EOS_ID
from tests.models.qwen4_exp_tiny import VARIANTS, build_qwen4_exp
from tests.models.hybrid_harness import (
    check_batched_equals_alone,
    check_greedy_matches_generate,
    check_logits_and_prompt_logprobs,
    check_second_turn,
    generate,
    greedy_request,
    make_engine,
    prompt,
)


TIE_FREE = dict(indexer_n_heads=8)  # the module docstring says why


def export_qwen4_exp(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_qwen4_exp(variant, root / "hf", **TIE_FREE)
    core = load_core(export_core(src, root / "core", ExportOptions(dtype="float32", prompt_logprobs=True)))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return hf, core


@pytest.fixture(scope="module", params=VARIANTS)
def qwen4(request, tmp_path_factory):
    hf, core = export_qwen4_exp(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def with_eos(ids: list[int], every: int = 37) -> list[int]:
    """The prompt with EOS at a few places (two in a row once): the PLE n-gram context restarts after each."""
    out = list(ids)
    for p in range(every // 2, len(out), every):
        out[p] = EOS_ID
    if len(out) > 42:
        out[41] = out[42] = EOS_ID
    return out


def test_the_export_is_qwen4_exp(qwen4):
    variant, _, core = qwen4
    arch = core.manifest.arch
    types = {"plain": ["linear", "full", "linear", "full"], "ple": ["linear", "linear", "linear", "full"]}
    assert arch.family == "qwen4_exp" and arch.layer_types == types[variant]
    assert (arch.indexer.block_size, arch.indexer.num_blocks) == (4, 2)
    assert arch.hyper_connections.num_streams == (2 if variant == "plain" else 3)
    assert arch.recurrent.output_gate == ("sigmoid" if variant == "plain" else "silu")
    assert (arch.ple is None) == (variant == "plain")
    if arch.ple is not None:
        assert arch.ple.layers == [0, 2] and arch.ple.reset_token_id == EOS_ID


def test_logits_and_prompt_logprobs_match(qwen4):
    _, hf, core = qwen4
    check_logits_and_prompt_logprobs(hf, core, with_eos(prompt(150)))


def test_greedy_matches_generate(qwen4):
    _, hf, core = qwen4
    check_greedy_matches_generate(hf, core, with_eos(prompt(90, seed=5)))


def test_sixteen_requests_together_give_what_each_gives_alone(qwen4):
    _, _, core = qwen4
    check_batched_equals_alone(core, [with_eos(prompt(7 + 23 * i, seed=10 + i), every=29 + i) for i in range(16)])


def test_a_second_turn_reuses_the_first_turns_state(qwen4):
    """A state checkpoint restores the GDN and PLE states; the index keys come back with the cached pages and the
    n-gram context from the tokens: the second turn gives exactly what it gives without reuse."""
    _, _, core = qwen4
    check_second_turn(core, with_eos(prompt(100, seed=21)), prompt(30, seed=22))


# ---- the parts against HF's modules ---------------------------------------------------------------------------


def test_ngram_context_matches_hf_shift(qwen4):
    """ngram_token_ids over chunks (the context from the tokens before each) = HF's _shift_right_ignore_eos over
    the whole sequence, EOS runs and a sequence starting with EOS included."""
    variant, hf, _ = qwen4
    if variant != "ple":
        pytest.skip("no PLE")
    ngram = hf.model.layers[0].ple.ple_embedding
    tokens = torch.tensor(with_eos(prompt(80, seed=3), every=11))
    tokens[0] = EOS_ID
    want = torch.stack([ngram._shift_right_ignore_eos(tokens[None], s)[0] for s in range(3)], dim=1)
    bounds = [0, 5, 6, 40, 80]  # chunks of 5, 1, 34 and 40 tokens
    context = [[EOS_ID] * max(0, 2 - a) + tokens[max(0, a - 2) : a].tolist() for a in bounds[:-1]]
    got = ngram_token_ids(tokens, torch.tensor(context), bounds, EOS_ID)
    assert torch.equal(got, want)


def test_indexer_selection_matches_hf(qwen4):
    """Indexer.select from the cached raw keys = HF's selection mask, queries of a chunk in the middle included."""
    _, hf, core = qwen4
    from helios.models import build_model

    layer = next(i for i, t in enumerate(core.manifest.arch.layer_types) if t == "full")
    model = build_model(core.manifest.arch, core.tensors)
    ours, theirs = model.layers[layer].attn.indexer, hf.model.layers[layer].self_attn.indexer
    x = torch.randn(1, 60, 64, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(60)
    cos, sin = hf.model.rotary_emb(x, positions.view(1, 1, -1).expand(3, 1, -1))
    causal = torch.ones(60, 60, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want = theirs(x, (cos, sin), causal, None)[0, 0]  # [60, 60]
        q, k = ours.project(x[0], *model.rotary.cos_sin(positions, x.dtype))
        chunks = [ours.select(q[a:b], k[:b], a) for a, b in ((0, 23), (23, 24), (24, 60))]
    got = torch.cat([torch.nn.functional.pad(m, (0, 60 - m.shape[1])) for m in chunks])
    assert torch.equal(got, want)
    assert got.sum(dim=1)[-1] < 60  # the last query drops blocks


def test_ple_token_context_reaches_the_batch(qwen4):
    """The runner hands the PLE its n-gram context from the request's own tokens (prompt, then outputs)."""
    variant, _, core = qwen4
    engine = make_engine(core, max_concurrency=2)
    if variant != "ple":
        assert engine.runner.context_tokens is None
        return
    assert engine.runner.context_tokens == (2, EOS_ID)
    seen: list[AttentionMetadata] = []
    model = engine.runner.model
    forward = model.forward
    model.forward = lambda ids, meta, caches: seen.append(meta) or forward(ids, meta, caches)
    ids = prompt(70, seed=8)
    out = generate(engine, [greedy_request("a", ids, 3)])["a"]
    rows = [m.context_token_ids.tolist() for m in seen]
    assert rows[0] == [[EOS_ID, EOS_ID]] and rows[1] == [ids[62:64]]  # chunks of 64, then 6
    assert rows[-1] == [[ids[-1], out[0]]]  # the last decode: the prompt's last token and the first output
