"""Structured output's token masks in the sampler and the model runner: the draw stays inside the mask, the
logprobs describe the raw distribution, rows without a mask are untouched."""

from __future__ import annotations

import math

import pytest
import torch

from helios.engine.messages import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from helios.runner.sampler import SamplerState, mask_logits, sample
from tests.runner.test_model_runner import core, runner  # noqa: F401 (fixtures: a tiny random-weight core)
from tests.runner.test_sampler import DEVICES

VOCAB = 70  # not a multiple of 32: the last mask word is partial


def mask_of(ids, num_words: int = (VOCAB + 31) // 32) -> bytes:
    words = bytearray(4 * num_words)
    for t in ids:
        words[t >> 3] |= 1 << (t & 7)
    return bytes(words)


@pytest.mark.parametrize("device", DEVICES)
def test_masked_rows_keep_exactly_their_tokens_and_others_are_copied(device):
    x = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    before = x.clone()
    keep = [0, 31, 32, 69]
    y = mask_logits(x, [None, mask_of(keep), mask_of([5], num_words=1)])
    assert torch.equal(y[0], x[0]) and y is not x
    assert torch.isfinite(y[1]).nonzero().flatten().tolist() == keep
    assert torch.equal(y[1][keep], x[1][keep])
    assert torch.isfinite(y[2]).nonzero().flatten().tolist() == [5]  # a short mask refuses the rest
    assert torch.equal(x, before)  # the input is untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draws_stay_inside_the_mask(temperature, device):
    keep = [3, 17, 64]
    params = SamplingParams(temperature=temperature, top_p=0.95, top_k=40, seed=11, repetition_penalty=1.2)
    for seed in range(20):
        x = (torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4).to(device)
        [t] = sample(mask_logits(x, [mask_of(keep)]), [SamplerState(params, [3, 4])])
        assert t in keep
        if temperature == 0.0:
            assert t == max(keep, key=lambda i: x[0, i].item())


def test_the_runner_draws_inside_the_mask_and_reports_raw_logprobs(core, runner):  # noqa: F811
    sampling = SamplingParams(temperature=0.0, logprobs=3, max_tokens=8)
    prompt = [3, 5, 7, 9]
    new = [NewRequestData(req_id=r, prompt_token_ids=prompt, sampling=sampling) for r in ("masked", "free")]
    blocks = {"masked": [0], "free": [1]}  # one 4-token page each
    vocab = core.manifest.arch.vocab_size

    def plan(mask_ids) -> SchedulerOutput:
        scheduled = [
            ScheduledRequest(req_id=r, token_ids=prompt, num_computed_tokens=0, block_ids=blocks[r], sample=True,
                             token_mask=mask_of(mask_ids, (vocab + 31) // 32) if r == "masked" else None)
            for r in ("masked", "free")
        ]
        return SchedulerOutput(new_requests=new, scheduled=scheduled, finished_req_ids=[], num_scheduled_tokens=8)

    results = {r.req_id: r for r in runner.execute(plan([11, 12])).results}
    greedy = results["free"].sampled_token_id
    assert results["masked"].sampled_token_id in (11, 12)
    raw, masked = results["free"].logprobs, results["masked"].logprobs
    # the same prompt: the masked row's alternatives are the raw top tokens, whatever the mask allowed
    assert [a.token_id for a in masked.alternatives] == [a.token_id for a in raw.alternatives]
    assert [a.logprob for a in masked.alternatives] == pytest.approx([a.logprob for a in raw.alternatives])
    assert raw.alternatives[0].token_id == greedy
    if greedy not in (11, 12):
        assert masked.token.rank > 1 and math.isfinite(masked.token.logprob)
