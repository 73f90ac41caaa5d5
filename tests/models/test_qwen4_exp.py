"""Parity of qwen4_exp (GDN + QSA-indexed gated attention + hyper-connections + MoE, with and without PLE n-gram
embeddings) against HF transformers on tiny random checkpoints, through the real path: an HF directory, ignition's
float32 export, helios.core.load, the ModelRunner with its paged KV (+ index keys) and state slots (+ PLE conv
state), and the engine. Prompts run past indexer_budget (8 tokens), so QSA drops blocks; the PLE prompts carry EOS
tokens, which restart the n-gram context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.layers.attention import AttentionMetadata
from helios.layers.ple import ngram_token_ids
from helios.runner.model_runner import ModelRunner
from tests.ignition.tiny_models import EOS_ID
from tests.models.qwen4_exp_tiny import VARIANTS, build_qwen4_exp
from tests.models.test_hybrid_parity import PAGE_SIZE, generate, greedy_request, hf_logits, make_engine, prompt


def export_qwen4_exp(variant: str, root: Path):
    """(HF model, LoadedCore) of the variant's tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_qwen4_exp(variant, root / "hf")
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
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, num_state_slots=1)
    ids = with_eos(prompt(150))
    ref = hf_logits(hf, ids)
    whole = runner.forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    # chunks on the recurrent grid (64) carry the GDN and PLE states and read the cached index keys
    chunked = runner.forward_logits(ids, chunk_size=64)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)


def test_greedy_matches_generate(qwen4):
    _, hf, core = qwen4
    ids, num_new = with_eos(prompt(90, seed=5)), 32
    got = generate(make_engine(core, chunk=64), [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


def test_sixteen_requests_together_give_what_each_gives_alone(qwen4):
    _, _, core = qwen4
    reqs = [greedy_request(f"r{i}", with_eos(prompt(7 + 23 * i, seed=10 + i), every=29 + i), 12) for i in range(16)]
    # a budget of 128 tokens: prompts up to 352 tokens split into grid chunks beside the others' decodes
    together = generate(make_engine(core, budget=128), reqs)
    for r in reqs:
        alone = generate(make_engine(core, max_concurrency=1, budget=512, chunk=512), [r])[r.req_id]
        assert together[r.req_id] == alone, r.req_id


def test_a_second_turn_reuses_the_first_turns_state(qwen4):
    """A state checkpoint restores the GDN and PLE states; the index keys come back with the cached pages and the
    n-gram context from the tokens: the second turn gives exactly what it gives without reuse."""
    _, _, core = qwen4
    engine = make_engine(core, max_concurrency=4, checkpoints=2)
    first = greedy_request("t1", with_eos(prompt(100, seed=21)), 60)  # its decode passes 128: a checkpoint
    history = first.prompt_token_ids + generate(engine, [first])["t1"]
    second = greedy_request("t2", history + prompt(30, seed=22), 16)
    outputs = []
    engine.add_request(second)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].num_cached_tokens == 128
    reused = [t for o in outputs for t in o.new_token_ids]
    assert reused == generate(make_engine(core, max_concurrency=4), [second])["t2"]


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
