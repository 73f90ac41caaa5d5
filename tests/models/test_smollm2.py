"""The real default core (SmolLM2-135M-Instruct) through the whole engine, against HF transformers'
GGUF loading: greedy continuations identical, chosen-token logprobs within 1e-4; batch invariance."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.messages import EngineRequest, SamplingParams
from tests.models.engine_harness import greedy, make_engine, run, tokens

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def core(default_core_path):
    return load_core(default_core_path)


@pytest.fixture(scope="module")
def encode(smollm2_hf_tokenizer):
    return lambda text: smollm2_hf_tokenizer.encode(text, add_special_tokens=False)


def test_greedy_and_logprobs_match_transformers(core, encode, smollm2_hf_model):
    engine = make_engine(core, chunk=8)  # chunked prefill on purpose
    reqs = [
        EngineRequest(req_id=str(i), prompt_token_ids=encode(p), sampling=greedy(NEW_TOKENS, logprobs=5))
        for i, p in enumerate(PROMPTS)
    ]
    outs = run(engine, reqs)
    for req in reqs:
        ours = tokens(outs[req.req_id])
        with torch.inference_mode():
            ids = torch.tensor([req.prompt_token_ids])
            # NOTE: an explicit mask: generate() would otherwise mask every pad id (2 = <|im_end|>) in the prompt
            ref = smollm2_hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=2,
            )[0, len(req.prompt_token_ids):].tolist()
            logits = smollm2_hf_model(torch.tensor([req.prompt_token_ids + ref])).logits[0].float()
        assert ours == ref, f"prompt {req.req_id}"
        ref_lp = torch.log_softmax(logits, -1)[len(req.prompt_token_ids) - 1 : -1]
        lps = [e for o in outs[req.req_id] for e in (o.logprobs or [])]
        assert len(lps) == NEW_TOKENS
        for step, entry in enumerate(lps):
            assert entry.token.token_id == ref[step]
            assert abs(entry.token.logprob - ref_lp[step, ref[step]].item()) < 1e-4
            assert len(entry.alternatives) == 5
            assert entry.alternatives[0].token_id == int(ref_lp[step].argmax())
    assert engine.metrics().free_pages == engine.metrics().total_pages


def test_paris(core, encode):
    outs = run(make_engine(core), [EngineRequest(req_id="p", prompt_token_ids=encode("The capital of France is"),
                                                 sampling=greedy(3))])
    text = core_decode(core, tokens(outs["p"]))
    assert text.startswith(" Paris")


def core_decode(core, ids):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(core.tokenizer_path)).decode(ids)


def test_batch_invariance_16_seeded_requests(core, encode):
    """16 concurrent seeded sampled requests of different lengths: exactly the tokens each gives alone."""
    base = "Write a short story about a robot who learns to paint. " * 3
    reqs = []
    for i in range(16):
        prompt = encode(base[: 20 + 9 * i])
        params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=8 + (i % 5),
                                repetition_penalty=1.0 + 0.05 * (i % 3))
        reqs.append(EngineRequest(req_id=f"r{i}", prompt_token_ids=prompt, sampling=params))
    together = run(make_engine(core, chunk=64), reqs)
    for req in reqs:
        alone = run(make_engine(core, num_pages=64, chunk=64), [req])
        assert tokens(together[req.req_id]) == tokens(alone[req.req_id]), req.req_id
