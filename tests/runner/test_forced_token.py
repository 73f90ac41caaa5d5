"""Forced tokens (the reasoning close at the thinking budget) in the sampler and the model runner: returned
untouched, no draw now, the next draw skips their position, other rows unchanged, no logprob record."""

from __future__ import annotations

import torch

from helios.engine.messages import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from helios.runner.sampler import SamplerState, sample
from tests.runner.test_model_runner import core, runner  # noqa: F401 (fixtures: a tiny random-weight core)

VOCAB = 64
PARAMS = SamplingParams(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.3)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_forced_rows_return_their_id_and_leave_other_rows_alone():
    x = logits(3)
    alone = [sample(x[i : i + 1], [SamplerState(PARAMS, [1, 2])])[0] for i in (0, 2)]
    states = [SamplerState(PARAMS, [1, 2]) for _ in range(3)]
    got = sample(x, states, [None, 42, None])
    assert got == [alone[0], 42, alone[1]]
    assert states[1]._num_draws == 0  # nothing drawn for the forced row


def test_a_forced_position_is_skipped_like_a_resent_token():
    """Forced at output 0, sampled at output 1 == a request re-sent after preemption with output 0."""
    x0, x1 = logits(1, 1), logits(1, 2)
    forced = SamplerState(PARAMS, [1, 2])
    token = sample(x0, [forced], [42])[0]
    forced.append(token)
    resent = SamplerState(PARAMS, [1, 2])
    resent.append(42)
    assert sample(x1, [forced]) == sample(x1, [resent])


def test_the_runner_returns_the_forced_token_without_a_logprob_record(runner):  # noqa: F811
    sampling = SamplingParams(temperature=0.0, logprobs=2, max_tokens=8)
    prompt = [3, 5, 7, 9]
    new = [NewRequestData(req_id=r, prompt_token_ids=prompt, sampling=sampling) for r in ("forced", "free")]
    blocks = {"forced": [0], "free": [1]}  # one 4-token page each
    scheduled = [
        ScheduledRequest(req_id=r, token_ids=prompt, num_computed_tokens=0, block_ids=blocks[r], sample=True,
                         forced_token_id=11 if r == "forced" else None)
        for r in ("forced", "free")
    ]
    plan = SchedulerOutput(new_requests=new, scheduled=scheduled, finished_req_ids=[], num_scheduled_tokens=8)
    results = {r.req_id: r for r in runner.execute(plan).results}
    assert results["forced"].sampled_token_id == 11 and results["forced"].logprobs is None
    assert results["free"].logprobs is not None
    assert runner.requests["forced"].sampler_state.output_token_ids == [11]
