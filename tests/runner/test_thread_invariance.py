"""The CPU path's numbers do not depend on the intra-op thread count (helios.layers.linear: oneDNN for every float32
projection): the same requests give bit-identical ids, logprobs and prompt logprobs at 1 and at 2 threads, so
neither the decode thread policy (helios.runner.cpu_threads) nor a loaded machine (Intel OpenMP's dynamic teams)
can change what a seeded request samples or what a logprob test reads."""

from __future__ import annotations

from contextlib import contextmanager

import msgspec
import pytest
import torch

from helios.core.load import load_core
from helios.engine.messages import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from helios.layers.linear import linear
from helios.runner.model_runner import ModelRunner
from tests.models.test_parity import export_tiny

PAGE_SIZE = 16
SAMPLING = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=7, max_tokens=64,
                          logprobs=5, prompt_logprobs=5)


@contextmanager
def num_threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def test_linear_gives_the_same_bits_at_every_thread_count():
    """Every row count from 1 to 16 (MKL's sgemm differed at 5-11 rows) and a prefill-sized one, narrow and wide
    weights, with and without a bias."""
    g = torch.Generator().manual_seed(0)
    for n, k in ((576, 576), (576, 1536), (960, 576)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        for rows in list(range(1, 17)) + [137]:
            x = torch.randn(rows, k, generator=g)
            for bias in (None, b):
                with num_threads(1):
                    one = linear(x, w, bias)
                with num_threads(2):
                    two = linear(x, w, bias)
                assert torch.equal(one, two), (n, k, rows, bias is None)


def _requests(runner: ModelRunner, vocab: int, steps: int = 8) -> list[bytes]:
    """Prompts of 2 and 3 tokens (a 5-row prefill step), one of 41 joining next (16-token chunks beside their
    decodes), one of 7 joining when that is done (a 10-row mixed step), then 4-row decode steps; every request
    samples with logprobs and prompt logprobs; every step's output encoded."""
    joins = {"r0": 0, "r1": 0, "r2": 1, "r3": 4}
    lengths = {"r0": 2, "r1": 3, "r2": 41, "r3": 7}
    prompts = {r: [(7 * j + 13 * i + 3) % (vocab - 10) + 5 for j in range(lengths[r])] for i, r in enumerate(joins)}
    blocks = {r: list(range(i * 8, i * 8 + 8)) for i, r in enumerate(prompts)}
    done: dict[str, int] = {}  # prompt tokens computed
    out: dict[str, list[int]] = {r: [] for r in prompts}
    encoded = []
    for step in range(steps):
        new, scheduled = [], []
        for r, ids in prompts.items():
            if step < joins[r]:
                continue
            if r not in done:
                new.append(NewRequestData(req_id=r, prompt_token_ids=ids, sampling=SAMPLING))
                done[r] = 0
            if done[r] < len(ids):  # the prompt, 16 tokens a step at most (chunked prefill)
                chunk = ids[done[r] : done[r] + 16]
                scheduled.append(ScheduledRequest(req_id=r, token_ids=chunk, num_computed_tokens=done[r],
                                                  block_ids=blocks[r], sample=done[r] + len(chunk) == len(ids),
                                                  want_prompt_logprobs=True))
                done[r] += len(chunk)
            else:
                scheduled.append(ScheduledRequest(req_id=r, token_ids=out[r][-1:], block_ids=blocks[r], sample=True,
                                                  num_computed_tokens=len(ids) + len(out[r]) - 1))
        result = runner.execute(SchedulerOutput(new_requests=new, scheduled=scheduled, finished_req_ids=[],
                                                num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled)))
        for res in result.results:
            if res.sampled_token_id is not None:
                out[res.req_id].append(res.sampled_token_id)
        encoded.append(msgspec.json.encode(result))
    assert all(out.values())
    return encoded


@pytest.fixture(scope="module", params=["smollm2", "qwen2", "qwen2-bf16"])
def core(request, tmp_path_factory, default_core_path):
    """(core, dtype): SmolLM2-135M's real shapes, and a tiny qwen2 (qkv bias through oneDNN's biased product), also
    run in bfloat16 (its projections packed for oneDNN, helios.layers.linear.pack_cpu_linears)."""
    if request.param == "smollm2":
        return load_core(default_core_path), torch.float32
    tiny = export_tiny("qwen2", tmp_path_factory.mktemp("qwen2"))[1]
    return tiny, torch.bfloat16 if request.param == "qwen2-bf16" else torch.float32


def test_requests_give_the_same_bits_at_one_and_two_threads(core):
    core, dtype = core
    outputs = []
    for threads in (1, 2):
        with num_threads(threads):
            runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE, dtype=dtype)
            runner.decode_threads = None  # the count held fixed for the whole run
            outputs.append(_requests(runner, core.manifest.arch.vocab_size))
    assert outputs[0] == outputs[1]
    assert any(b'"prompt_logprobs":[{' in step for step in outputs[0])  # the records are there to compare


def test_the_decode_thread_policy_is_on_where_it_cannot_change_the_numbers(core):
    """With every CPU op thread-invariant the start-up check passes, so decode steps may pick their count by
    timing (speed) without changing a bit."""
    core, dtype = core
    with num_threads(2):
        runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE, dtype=dtype)
    assert runner.decode_threads is not None and runner.prompt_threads
