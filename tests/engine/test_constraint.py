"""Structured output in the engine (fake runner that draws inside the mask, real llguidance matchers held by the
frontend's constraint owner): the grammar's tokens and nothing else, only after reasoning, a tool opener in the
answer's place, preemption, and the owner's state freed when a request ends."""

from __future__ import annotations

import llguidance
import pytest

from helios.engine.messages import ConstraintSpec
from helios.frontend.constraints import ConstraintState, GrammarConstraints
from tests.engine.fakes import VOCAB, allowed, make_core, reference_tokens, request, run_until_idle

EOS = 2
CLOSE = 5  # the reasoning close; the fake model never samples ids below 10 on its own
TOOL = 6  # a single-token tool opener
BYTE0 = 10  # token BYTE0 + b is byte b


class _Vocabulary:
    """VOCAB ids: 0..9 special, 10..265 the 256 bytes, the rest multi-byte words (TokenizerWrapper's reads)."""

    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = list(range(BYTE0))
    tokens = ([f"<|s{i}|>".encode() for i in range(BYTE0)] + [bytes([b]) for b in range(256)]
              + [f"w{i}".encode() for i in range(BYTE0 + 256, VOCAB)])

    def __call__(self, text):
        return [BYTE0 + b for b in (text.encode() if isinstance(text, str) else text)]


_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary()), n_vocab=VOCAB, eos_token=EOS)


def matcher(grammar: str):
    m = llguidance.LLMatcher(_TOKENIZER, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def constraint(lark: str = 'start: "ab" "c"', **kw) -> ConstraintSpec:
    return ConstraintSpec(grammar=llguidance.LLMatcher.grammar_from_lark(lark), **kw)


def make_constrained_core(**kw):
    owner = GrammarConstraints(matcher)
    core, runner = make_core(constraints=owner, **kw)
    return core, runner, owner


def text(tokens: list[int]) -> bytes:
    return bytes(t - BYTE0 for t in tokens if BYTE0 <= t < BYTE0 + 256)


def run_one(req, script=None, ignore_masks=False, **config):
    core, runner, owner = make_constrained_core(script={req.req_id: script} if script else None, **config)
    runner.ignore_masks = ignore_masks
    core.add_request(req)
    got = run_until_idle(core)
    assert len(owner) == 0  # the finished request's grammar state is freed
    return got, runner


def masked_plans(runner) -> list[bool]:
    return [s.token_mask is not None for p in runner.plans for s in p.scheduled if s.sample]


def test_the_output_is_the_grammar_then_eos():
    got, runner = run_one(request("a", max_tokens=16, eos_token_ids=(EOS,), constraint=constraint()))
    tokens = got.tokens["a"]
    assert text(tokens) == b"abc" and tokens[-1] == EOS and len(tokens) == 4
    assert got.final["a"].finish_reason == "stop"
    assert masked_plans(runner) == [True] * 4


def test_an_unconstrained_request_in_the_batch_is_untouched():
    plain = request("p", max_tokens=6, seed=1)
    core, runner, _ = make_constrained_core()
    core.add_request(plain)
    core.add_request(request("a", max_tokens=16, eos_token_ids=(EOS,), constraint=constraint()))
    got = run_until_idle(core)
    assert got.tokens["p"] == reference_tokens(plain)
    assert all(s.token_mask is None for p in runner.plans for s in p.scheduled if s.req_id == "p")
    assert text(got.tokens["a"]) == b"abc"


def test_reasoning_is_free_and_the_grammar_starts_after_the_close():
    script = [300, 301, CLOSE]  # reasoning tokens outside the grammar, then the close
    c = constraint(starts_in_reasoning=True, close_token_id=CLOSE)
    got, runner = run_one(request("a", max_tokens=16, eos_token_ids=(EOS,), constraint=c), script)
    tokens = got.tokens["a"]
    assert tokens[:3] == script and text(tokens[3:]) == b"abc" and tokens[-1] == EOS
    assert masked_plans(runner) == [False] * 3 + [True] * 4


def test_a_close_of_several_tokens_starts_the_grammar_only_once_whole():
    """Kimi K3's close (`<|close|>think<|sep|>` then the response opener) is an id sequence: its first ids alone,
    or all of them interrupted, leave reasoning free; the grammar starts after the whole sequence."""
    close = (CLOSE, 300, TOOL)
    script = [CLOSE, 300, 301, CLOSE, 300, TOOL]  # a partial close, then the whole one
    c = constraint(starts_in_reasoning=True, close_token_ids=close)
    got, runner = run_one(request("a", max_tokens=16, eos_token_ids=(EOS,), constraint=c), script)
    tokens = got.tokens["a"]
    assert tokens[:6] == script and text(tokens[6:]) == b"abc" and tokens[-1] == EOS
    assert masked_plans(runner) == [False] * 6 + [True] * 4


def test_a_tool_opener_takes_the_answers_place_and_releases_the_grammar():
    script = [TOOL, 300, 301, 302]
    c = constraint(tool_open_token_ids=(TOOL,))
    got, runner = run_one(request("a", max_tokens=4, eos_token_ids=(EOS,), constraint=c), script)
    assert got.tokens["a"] == script and got.final["a"].finish_reason == "length"
    assert masked_plans(runner) == [True, False, False, False]


def test_the_tool_opener_is_allowed_only_at_the_answers_start():
    spec = constraint(tool_open_token_ids=(TOOL,))
    state = ConstraintState(spec, matcher(spec.grammar))
    first = state.token_mask()
    assert allowed(first, TOOL) and allowed(first, BYTE0 + ord("a")) and not allowed(first, BYTE0 + ord("b"))
    state.observe(BYTE0 + ord("a"))
    second = state.token_mask()
    assert not allowed(second, TOOL) and allowed(second, BYTE0 + ord("b"))
    assert [t for t in range(VOCAB) if allowed(second, t)] == [BYTE0 + ord("b")]


def test_a_runner_that_ignores_the_mask_fails_the_request():
    got, _ = run_one(request("a", max_tokens=8, eos_token_ids=(EOS,), constraint=constraint()), [300],
                     ignore_masks=True)
    final = got.final["a"]
    assert final.finish_reason == "error" and "refused token 300" in final.error


@pytest.mark.parametrize("num_pages", [6, 64])
def test_preemption_keeps_the_grammar_state(num_pages):
    """Two constrained requests in a pool too small for both: the one preempted resumes mid-grammar."""
    lark = 'start: "x"{12} "!"'
    reqs = [request(f"r{i}", prompt_len=8, seed=i, max_tokens=20, eos_token_ids=(EOS,),
                    constraint=constraint(lark)) for i in range(2)]
    core, _, owner = make_constrained_core(num_pages=num_pages, page_size=4, max_concurrency=2)
    for r in reqs:
        core.add_request(r)
    got = run_until_idle(core)
    for r in reqs:
        assert text(got.tokens[r.req_id]) == b"x" * 12 + b"!" and got.tokens[r.req_id][-1] == EOS
    if num_pages == 6:
        assert core.scheduler.num_preemptions > 0


def test_an_abort_frees_the_grammar_state():
    core, _, owner = make_constrained_core()
    core.add_request(request("a", max_tokens=16, eos_token_ids=(EOS,), constraint=constraint()))
    core.add_request(request("w", max_tokens=16, eos_token_ids=(EOS,), constraint=constraint()))
    core.step()
    assert len(owner) == 2
    assert core.abort("a").finish_reason == "abort" and core.abort("w").finish_reason == "abort"
    assert len(owner) == 0


def test_a_grammar_the_owner_cannot_compile_is_refused_at_admission():
    def refuse(grammar):
        from helios.frontend.sampling import InvalidRequest
        raise InvalidRequest("invalid lark grammar: no start rule")

    core, _ = make_core(constraints=GrammarConstraints(refuse))
    with pytest.raises(ValueError, match="invalid lark grammar: no start rule"):
        core.add_request(request("a", constraint=constraint()))
    assert not core.has_unfinished_requests()


def test_an_engine_without_an_owner_refuses_a_constraint():
    core, _ = make_core()
    with pytest.raises(ValueError, match="structured output is not available"):
        core.add_request(request("a", constraint=constraint()))
