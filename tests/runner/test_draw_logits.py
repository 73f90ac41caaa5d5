"""What the draw reads (logit_bias, structured output's token masks) in the sampler and the model runner: the
draw stays inside the mask and follows the bias, the logprobs describe the raw distribution, rows without
either are untouched."""

from __future__ import annotations

import math

import pytest
import torch

from helios.engine.messages import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from helios.runner.sampler import SamplerState, draw_logits, sample
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
    y = draw_logits(x, [None, mask_of(keep), mask_of([5], num_words=1)])
    assert torch.equal(y[0], x[0]) and y is not x
    assert draw_logits(x, [None] * 3, [(), (), ()]) is x  # nothing applies: no copy
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
        [t] = sample(draw_logits(x, [mask_of(keep)]), [SamplerState(params, [3, 4])])
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


@pytest.mark.parametrize("device", DEVICES)
def test_bias_is_added_before_the_mask(device):
    x = torch.zeros(2, VOCAB, device=device)
    y = draw_logits(x, [None, mask_of([1, 2])], [((1, -100.0), (5, 7.5)), ((1, 3.0), (2, -1.0), (9, 50.0))])
    assert y[0, 1].item() == -100.0 and y[0, 5].item() == 7.5 and int((y[0] != 0).sum()) == 2
    assert y[1, 1].item() == 3.0 and y[1, 2].item() == -1.0 and torch.isinf(y[1, 9])  # 9 is masked out
    assert torch.equal(x, torch.zeros_like(x))


def test_a_banning_bias_moves_greedy_and_a_forcing_bias_wins():
    x = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    top = int(x.argmax())
    greedy = SamplerState(SamplingParams(temperature=0.0), [])
    assert sample(draw_logits(x, [None], [((top, -100.0),)]), [greedy]) != [top]
    sampled = SamplerState(SamplingParams(temperature=1.0, top_p=0.9, seed=1), [])
    low = int(x.argmin())
    assert sample(draw_logits(x, [None], [((low, 100.0),)]), [sampled]) == [low]


def test_the_runner_applies_logit_bias_to_the_draw_only(core, runner):  # noqa: F811
    prompt = [3, 5, 7, 9]
    plain = SamplingParams(temperature=0.0, logprobs=2, max_tokens=4)
    first = runner.execute(SchedulerOutput(
        new_requests=[NewRequestData(req_id="p", prompt_token_ids=prompt, sampling=plain)],
        scheduled=[ScheduledRequest(req_id="p", token_ids=prompt, num_computed_tokens=0, block_ids=[0], sample=True)],
        finished_req_ids=[], num_scheduled_tokens=4)).results[0]
    target = (first.sampled_token_id + 1) % core.manifest.arch.vocab_size
    biased = SamplingParams(temperature=0.0, logprobs=2, max_tokens=4, logit_bias=((target, 100.0),))
    second = runner.execute(SchedulerOutput(
        new_requests=[NewRequestData(req_id="b", prompt_token_ids=prompt, sampling=biased)],
        scheduled=[ScheduledRequest(req_id="b", token_ids=prompt, num_computed_tokens=0, block_ids=[1], sample=True)],
        finished_req_ids=["p"], num_scheduled_tokens=4)).results[0]
    assert second.sampled_token_id == target
    assert [a.token_id for a in second.logprobs.alternatives] == [a.token_id for a in first.logprobs.alternatives]
    assert second.logprobs.alternatives[0].logprob == pytest.approx(first.logprobs.alternatives[0].logprob)
