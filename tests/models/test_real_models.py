"""The other real models of ../shared/models.md through ignition and the engine, against transformers'
GGUF loading: Qwen2.5-Coder-0.5B-Instruct (qwen2) and Gemma 3 270M (gemma3). Slow: large downloads."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from helios.core.load import load_core
from helios.engine.messages import EngineRequest
from ignition.export import ExportOptions, export_core
from tests.models.engine_harness import greedy, make_engine, run, tokens

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
CASES = {
    "qwen2": ("qwen25_coder", ["def quicksort(arr):\n", "The three primary colors are",
                                    "<|im_start|>user\nWrite hello world in C.<|im_end|>\n<|im_start|>assistant\n"]),
    "gemma3": ("gemma3_270m", ["The capital of France is", "Once upon a time", "import numpy as np\n"]),
}


# each model's transformers oracle is conftest's GgufOracle, loaded once for this and tests/ignition/test_gguf_source
@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.gguf_oracle(CASES[f][0] + "_oracle"))
                                        for f in sorted(CASES)])
def real(request, tmp_path_factory):
    model_name, prompts = CASES[request.param]
    gguf = request.getfixturevalue(model_name + "_gguf")
    path = export_core(gguf, tmp_path_factory.mktemp("cores") / request.param, ExportOptions(dtype="float32"))
    core = load_core(path)
    oracle = request.getfixturevalue(model_name + "_oracle")
    yield request.param, core, oracle.model, oracle.tokenizer, prompts
    shutil.rmtree(path, ignore_errors=True)  # 1-2 GB of float32 weights: CI's disk is shared


def test_greedy_and_logprobs_match_transformers(real):
    family, core, model, tok, prompts = real
    assert core.manifest.arch.family == family
    engine = make_engine(core, num_pages=256, chunk=16)
    reqs = [EngineRequest(req_id=str(i), prompt_token_ids=tok.encode(p, add_special_tokens=True),
                          sampling=greedy(NEW_TOKENS, logprobs=1)) for i, p in enumerate(prompts)]
    outs = run(engine, reqs)
    # the logprobs' oracle: transformers' teacher-forced pass in float64 (its float32 pass is itself up to ~1e-4 off
    # there: on an AVX2-only host, 9.9e-5 for a qwen2 prompt where ours was 1.2e-5)
    exact_model = copy.deepcopy(model).double()
    for req in reqs:
        ids = torch.tensor([req.prompt_token_ids])
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
            exact = torch.log_softmax(exact_model(torch.tensor([req.prompt_token_ids + ref])).logits[0], -1)
        assert tokens(outs[req.req_id]) == ref, (family, req.req_id)
        exact = exact[len(req.prompt_token_ids) - 1 : -1]
        lps = [e for o in outs[req.req_id] for e in (o.logprobs or [])]
        assert len(lps) == len(ref)
        for step, entry in enumerate(lps):
            assert abs(entry.token.logprob - exact[step, ref[step]].item()) < 1e-4, (family, step)
    del exact_model
