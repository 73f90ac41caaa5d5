"""ModelRunner.execute over hand-built SchedulerOutputs: new requests, chunked prefill, mixed decode and
prefill in one batch, logprobs, prompt logprobs, and finished/preempted ids dropping state.

The reference for every sampled token is the runner's own forward_logits (parity with HF is checked
in tests/models/test_parity.py); greedy requests use temperature 0.
"""

from __future__ import annotations

import pytest
import torch

from helios.engine.messages import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from helios.runner.model_runner import ModelRunner
from tests.models.test_parity import export_tiny, prompt

PAGE_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    # gemma3 with a window of 4: sliding layers, sandwich norms and paging all on the runner's path
    _, core = export_tiny("gemma3", tmp_path_factory.mktemp("gemma3"), sliding_window=4)
    return core


@pytest.fixture
def runner(core):
    return ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE)


def plan(scheduled, new=(), finished=()):
    return SchedulerOutput(
        new_requests=list(new),
        scheduled=list(scheduled),
        finished_req_ids=list(finished),
        num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled),
    )


def new(req_id, ids, sampling=GREEDY, outputs=()):
    return NewRequestData(req_id=req_id, prompt_token_ids=ids, sampling=sampling, output_token_ids=list(outputs))


def step(req_id, token_ids, num_computed, blocks, sample=True, prompt_lp=False):
    return ScheduledRequest(
        req_id=req_id, token_ids=list(token_ids), num_computed_tokens=num_computed, block_ids=blocks,
        sample=sample, want_prompt_logprobs=prompt_lp,
    )


def greedy_reference(runner, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(runner.forward_logits(seq)[-1].argmax()))
    return seq[len(ids) :]


def test_prefill_then_decode_is_greedy(runner):
    ids = prompt(10)
    blocks = [3, 1, 5, 7, 9]
    out = runner.execute(plan([step("a", ids, 0, blocks)], new=[new("a", ids)]))
    tokens = [out.results[0].sampled_token_id]
    for _ in range(6):
        out = runner.execute(plan([step("a", tokens[-1:], len(ids) + len(tokens) - 1, blocks)]))
        (result,) = out.results
        assert result.req_id == "a" and result.logprobs is None and result.prompt_logprobs is None
        tokens.append(result.sampled_token_id)
    assert tokens == greedy_reference(runner, ids, 7)


def test_chunked_prefill_samples_only_at_the_end(runner):
    ids = prompt(13)
    blocks = [10, 11, 12, 13]
    results = []
    runner.execute(plan([], new=[new("a", ids)]))
    for start in range(0, 13, 5):
        chunk = ids[start : start + 5]
        last = start + len(chunk) == len(ids)
        results += runner.execute(plan([step("a", chunk, start, blocks, sample=last)])).results
    assert [r.sampled_token_id is None for r in results] == [True, True, False]
    assert results[-1].sampled_token_id == int(runner.forward_logits(ids)[-1].argmax())


def test_mixed_batch_equals_alone(runner):
    a, b, c = prompt(9, seed=2), prompt(14, seed=3), prompt(6, seed=4)
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}
    # step 1: a prefills whole, b its first chunk
    first = runner.execute(plan([step("a", a, 0, blocks["a"]), step("b", b[:8], 0, blocks["b"], sample=False)],
                                new=[new("a", a), new("b", b)]))
    a1 = first.results[0].sampled_token_id
    assert first.results[1].sampled_token_id is None
    # step 2: a decodes, b finishes its prefill, c arrives and prefills: one flattened batch
    second = runner.execute(plan(
        [step("a", [a1], len(a), blocks["a"]), step("b", b[8:], 8, blocks["b"]), step("c", c, 0, blocks["c"])],
        new=[new("c", c)],
    ))
    assert [r.req_id for r in second.results] == ["a", "b", "c"]
    got = [r.sampled_token_id for r in second.results]
    assert got == [
        greedy_reference(runner, a, 2)[1],
        int(runner.forward_logits(b)[-1].argmax()),
        int(runner.forward_logits(c)[-1].argmax()),
    ]


def test_finished_ids_drop_state(runner):
    ids = prompt(5)
    runner.execute(plan([step("a", ids, 0, [0, 1])], new=[new("a", ids)]))
    assert "a" in runner.requests
    out = runner.execute(plan([], finished=["a", "never-seen"]))  # unknown ids are a no-op
    assert out.results == [] and "a" not in runner.requests
    with pytest.raises(KeyError):
        runner.execute(plan([step("a", ids[-1:], 5, [0, 1])]))
    # dropped and re-sent as new in the same plan (preemption): drops apply first
    again = runner.execute(plan([step("a", ids, 0, [2, 3])], new=[new("a", ids)], finished=["a"]))
    assert "a" in runner.requests and again.results[0].sampled_token_id == int(runner.forward_logits(ids)[-1].argmax())


def test_resent_after_preemption_continues(runner):
    ids = prompt(8)
    done = greedy_reference(runner, ids, 3)
    # the engine re-sends prompt + outputs so far; their KV is recomputed as context
    context = ids + done[:2]
    out = runner.execute(plan([step("a", context, 0, [6, 2, 4])], new=[new("a", ids, outputs=done[:2])]))
    assert out.results[0].sampled_token_id == done[2]
    assert runner.requests["a"].sampler_state.output_token_ids == done


def test_generation_logprobs(runner):
    ids = prompt(7)
    top = SamplingParams(temperature=0.0, logprobs=3)
    listed = SamplingParams(temperature=0.0, logprobs=1, logprob_token_ids=(5, 7))
    out = runner.execute(plan(
        [step("top", ids, 0, [0, 1]), step("listed", ids, 0, [2, 3]), step("none", ids, 0, [4, 5])],
        new=[new("top", ids, top), new("listed", ids, listed), new("none", ids)],
    ))
    ref = torch.log_softmax(runner.forward_logits(ids)[-1], dim=-1)
    r_top, r_listed, r_none = out.results
    assert r_none.logprobs is None
    assert r_top.logprobs.token.token_id == r_top.sampled_token_id == int(ref.argmax())
    assert r_top.logprobs.token.rank == 1
    assert abs(r_top.logprobs.token.logprob - float(ref.max())) < 1e-5
    assert [a.token_id for a in r_top.logprobs.alternatives] == ref.topk(3).indices.tolist()
    assert [a.token_id for a in r_listed.logprobs.alternatives] == [5, 7]
    assert abs(r_listed.logprobs.alternatives[1].logprob - float(ref[7])) < 1e-5


def test_prompt_logprobs_per_chunk(runner):
    ids = prompt(10)
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    blocks = [20, 21, 22]
    first = runner.execute(
        plan([step("a", ids[:5], 0, blocks, sample=False, prompt_lp=True)], new=[new("a", ids, params)])
    )
    second = runner.execute(plan([step("a", ids[5:], 5, blocks, prompt_lp=True)]))
    records = first.results[0].prompt_logprobs + second.results[0].prompt_logprobs
    # chunk 1 covers positions 0..4 (records of tokens 1..5), chunk 2 positions 5..9 (tokens 6..9 only)
    assert [len(first.results[0].prompt_logprobs), len(second.results[0].prompt_logprobs)] == [5, 4]
    ref = torch.log_softmax(runner.forward_logits(ids), dim=-1)
    for p, record in enumerate(records):
        assert record.token.token_id == ids[p + 1]
        assert abs(record.token.logprob - float(ref[p, ids[p + 1]])) < 1e-5
        assert len(record.alternatives) == 2
    assert first.results[0].sampled_token_id is None
    assert second.results[0].sampled_token_id == int(ref[-1].argmax())


def test_seeded_sampling_same_alone_or_batched(core):
    ids, other = prompt(6, seed=5), prompt(11, seed=6)
    hot = SamplingParams(temperature=1.0, seed=1234)

    def generate(with_neighbour: bool) -> list[int]:
        runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=32, page_size=PAGE_SIZE)
        sched = [step("s", ids, 0, [0, 1, 2])] + ([step("o", other, 0, [3, 4, 5])] if with_neighbour else [])
        news = [new("s", ids, hot)] + ([new("o", other, hot)] if with_neighbour else [])
        tokens = [runner.execute(plan(sched, new=news)).results[0].sampled_token_id]
        for _ in range(4):
            decode = step("s", tokens[-1:], len(ids) + len(tokens) - 1, [0, 1, 2])
            tokens.append(runner.execute(plan([decode])).results[0].sampled_token_id)
        return tokens

    assert generate(False) == generate(True)
