from __future__ import annotations

import pytest

from helios.core.manifest import LogprobCaps
from helios.frontend.sampling import InvalidRequest, SamplingFields, resolve_max_tokens, resolve_sampling
from tests.frontend.conftest import make_manifest

M = make_manifest()


def _sp(**kw):
    return resolve_sampling(SamplingFields(**kw), M, max_tokens=4)


def test_defaults_fill_omitted_fields():
    sp = _sp()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed) == (0.7, 0.9, 20, 5)
    assert sp.eos_token_ids == (2,) and sp.max_tokens == 4


def test_values_are_clamped_and_unranged_ones_fixed():
    assert _sp(temperature=0.0).temperature == 0.05
    assert _sp(temperature=9.0).temperature == 2.0
    assert _sp(top_p=0.1).top_p == 0.9  # no range: fixed at the default
    assert _sp(presence_penalty=1.5).presence_penalty == 0.0
    assert _sp(top_k=5000).top_k == 100 and _sp(top_k=0).top_k == -1
    with pytest.raises(InvalidRequest):
        _sp(temperature=float("nan"))
    with pytest.raises(InvalidRequest):
        _sp(top_k=-5)


def test_seed_offset_advances_per_choice():
    assert resolve_sampling(SamplingFields(seed=10), M, 4, seed_offset=2).seed == 12


def test_stop_limits():
    _sp(stop=["a", "b", "c", "d"])
    for bad in (dict(stop=["a"] * 5), dict(stop=[""]), dict(stop=["x" * 4097]),
                dict(stop_token_ids=list(range(17))), dict(stop_token_sequences=[[1] * 65]),
                dict(stop_token_sequences=[[]]), dict(stop_token_ids=[320]), dict(stop=["a"], stop_token_ids=[1])):
        with pytest.raises(InvalidRequest):
            _sp(**bad)
    assert _sp(stop_token_ids=[3], stop_token_sequences=[[4, 5]]).stop_token_sequences == ((4, 5),)


def test_logprob_limits():
    assert _sp(logprobs=5).logprobs == 5
    with pytest.raises(InvalidRequest, match="at most 5"):
        _sp(logprobs=6)
    with pytest.raises(InvalidRequest):
        _sp(logprobs=21)
    none = make_manifest(logprobs=LogprobCaps(max_top_logprobs=0, prompt_logprobs=False))
    with pytest.raises(InvalidRequest, match="without generation logprob"):
        resolve_sampling(SamplingFields(logprobs=0), none, 4)
    with pytest.raises(InvalidRequest, match="prompt-logprobs"):
        resolve_sampling(SamplingFields(prompt_logprobs=0), none, 4)
    assert _sp(prompt_logprobs=0).prompt_logprobs == 0


def test_logprob_token_ids_rules():
    assert _sp(logprobs=0, logprob_token_ids=[3, 1, 3]).logprob_token_ids == (3, 1)
    assert _sp(logprobs=0, logprob_token_ids=[]).logprob_token_ids is None
    with pytest.raises(InvalidRequest, match="requires generation logprobs"):
        _sp(logprob_token_ids=[1])
    with pytest.raises(InvalidRequest):
        _sp(logprobs=0, logprob_token_ids=[320])
    with pytest.raises(InvalidRequest, match="at most 128"):
        _sp(logprobs=0, logprob_token_ids=[1] * 129)
    no_explicit = make_manifest(logprobs=LogprobCaps(max_top_logprobs=5, explicit_token_ids=False))
    with pytest.raises(InvalidRequest, match="re-export"):
        resolve_sampling(SamplingFields(logprobs=0, logprob_token_ids=[1]), no_explicit, 4)


def test_max_tokens_resolution():
    assert resolve_max_tokens(None, 10, 128, 16, allow_zero=False) == 16
    assert resolve_max_tokens(None, 120, 128, 16, allow_zero=False) == 8
    assert resolve_max_tokens(0, 128, 128, 16, allow_zero=True) == 0
    for args in ((0, 10, False), (200, 10, False), (None, 128, False), (None, 129, True), (-1, 1, True)):
        with pytest.raises(InvalidRequest):
            resolve_max_tokens(args[0], args[1], 128, 16, allow_zero=args[2])
