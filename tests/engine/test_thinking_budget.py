"""The thinking-token budget in the engine (fake runner): the reasoning close is forced exactly at the cap,
never after reasoning closed, never when output starts in content, never without output capacity."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.engine.engine_core import EngineCore
from helios.engine.messages import ModelRunnerOutput, ReasoningBudget, RequestResult
from helios.engine.reasoning_budget import ReasoningBudgetState
from tests.engine.fakes import FakeRunner, make_core, reference_tokens, request, run_until_idle

CLOSE = 5  # the fake model never samples ids below 10 on its own
TOOL = 6
EOS = 2


def budget(n: int, *, starts_in_reasoning: bool = True, tool_open_token_ids=()) -> ReasoningBudget:
    return ReasoningBudget(max_reasoning_tokens=n, close_token_id=CLOSE, starts_in_reasoning=starts_in_reasoning,
                           tool_open_token_ids=tuple(tool_open_token_ids))


def run_one(req, script=None, **config):
    core, runner = make_core(script={req.req_id: script} if script else None, **config)
    core.add_request(req)
    return run_until_idle(core), core, runner


def forced_plans(runner: FakeRunner) -> list[tuple[str, int]]:
    return [(s.req_id, s.forced_token_id) for p in runner.plans for s in p.scheduled if s.forced_token_id is not None]


def test_close_is_forced_exactly_at_the_budget_and_generation_continues():
    req = request("a", max_tokens=10, logprobs=0, reasoning_budget=budget(3))
    got, core, runner = run_one(req)
    tokens = got.tokens["a"]
    assert len(tokens) == 10 and tokens[3] == CLOSE and CLOSE not in tokens[:3] + tokens[4:]
    assert forced_plans(runner) == [("a", CLOSE)]
    # the forced token has its own output, flagged, without a logprob record; every sampled one has one
    outs = [o for o in got.outputs["a"] if o.new_token_ids]
    assert [o.is_forced for o in outs] == [False] * 3 + [True] + [False] * 6
    assert outs[3].logprobs is None and all(o.logprobs is not None for i, o in enumerate(outs) if i != 3)
    # it counts within the output limit and as a generated token
    assert got.final["a"].finish_reason == "length"
    m = core.metrics()
    assert (m.generated_tokens, m.reasoning_budget_cuts) == (10, 1)
    # the tokens after the close follow the model given the forced context
    context = list(req.prompt_token_ids) + tokens[:4]
    from tests.engine.fakes import context_token

    for t in tokens[4:]:
        assert t == context_token(context)
        context.append(t)


def test_no_cut_when_reasoning_closed_earlier():
    script = [11, CLOSE, 12, 13, 14, 15]
    got, core, runner = run_one(request("a", max_tokens=8, reasoning_budget=budget(3)), script)
    assert got.tokens["a"][:6] == script and got.tokens["a"].count(CLOSE) == 1
    assert forced_plans(runner) == [] and core.metrics().reasoning_budget_cuts == 0


def test_the_model_closing_on_the_last_budgeted_token_is_not_a_cut():
    script = [11, 12, CLOSE]
    got, core, runner = run_one(request("a", max_tokens=6, reasoning_budget=budget(3)), script)
    assert got.tokens["a"][:3] == script and forced_plans(runner) == []
    assert core.metrics().reasoning_budget_cuts == 0


def test_no_cut_when_output_starts_in_content():
    req = request("a", max_tokens=8, reasoning_budget=budget(2, starts_in_reasoning=False))
    got, core, runner = run_one(req)
    assert got.tokens["a"] == reference_tokens(request("a", max_tokens=8))
    assert forced_plans(runner) == [] and core.metrics().reasoning_budget_cuts == 0


def test_no_cut_without_output_capacity():
    # the budget equals the output limit: the request ends with "length" and nothing is forced
    got, core, runner = run_one(request("a", max_tokens=3, reasoning_budget=budget(3)))
    assert len(got.tokens["a"]) == 3 and CLOSE not in got.tokens["a"] and forced_plans(runner) == []
    assert got.final["a"].finish_reason == "length"
    # one token of capacity left: the forced close is the final token, and the request ends with "length"
    got, core, runner = run_one(request("b", max_tokens=4, reasoning_budget=budget(3)))
    assert got.tokens["b"][-1] == CLOSE and len(got.tokens["b"]) == 4
    assert got.final["b"].finish_reason == "length" and core.metrics().reasoning_budget_cuts == 1


def test_no_cut_when_the_context_is_full():
    req = request("a", prompt_len=8, max_tokens=50, reasoning_budget=budget(4))
    got, _, runner = run_one(req, max_model_len=12)  # 4 output tokens fit: the last is the 4th reasoning token
    assert len(got.tokens["a"]) == 4 and forced_plans(runner) == []
    assert got.final["a"].finish_reason == "length"


def test_eos_and_stop_tokens_end_normally_at_the_budget():
    got, core, runner = run_one(request("a", max_tokens=8, eos_token_ids=(EOS,), reasoning_budget=budget(3)),
                                [11, 12, EOS])
    assert got.tokens["a"] == [11, 12, EOS] and got.final["a"].finish_reason == "stop"
    assert forced_plans(runner) == [] and core.metrics().reasoning_budget_cuts == 0
    # a stop token sequence completed by the last budgeted token wins over the cut too
    got, core, runner = run_one(
        request("b", max_tokens=8, stop_token_sequences=((12, 13),), reasoning_budget=budget(3)), [11, 12, 13])
    assert got.final["b"].finish_reason == "stop" and forced_plans(runner) == []


def test_an_undecided_tool_opener_in_reasoning_prevents_the_cut():
    got, core, runner = run_one(request("a", max_tokens=8, reasoning_budget=budget(3, tool_open_token_ids=[TOOL])),
                                [11, TOOL, 12, 13, 14])
    assert got.tokens["a"][:5] == [11, TOOL, 12, 13, 14] and CLOSE not in got.tokens["a"]
    assert forced_plans(runner) == [] and core.metrics().reasoning_budget_cuts == 0


def test_the_cut_only_touches_its_own_request_in_a_batch():
    core, runner = make_core()
    core.add_request(request("capped", max_tokens=8, reasoning_budget=budget(2)))
    core.add_request(request("free", max_tokens=8))
    got = run_until_idle(core)
    assert got.tokens["free"] == reference_tokens(request("free", max_tokens=8))
    assert got.tokens["capped"][2] == CLOSE and forced_plans(runner) == [("capped", CLOSE)]
    assert core.metrics().reasoning_budget_cuts == 1


def test_preemption_keeps_the_cut_and_the_tokens():
    """Pages for one request only: the two requests preempt each other around the cut; each gets the
    tokens it gets alone, the close exactly once at the budget, and the cut is counted once per request."""
    reqs = [request(f"r{i}", prompt_len=6, seed=i, max_tokens=14, reasoning_budget=budget(5)) for i in range(2)]
    alone = {r.req_id: reference_tokens(r) for r in reqs}
    core, runner = make_core(num_pages=6, page_size=4, max_num_batched_tokens=8, prefill_chunk_size=8)
    for r in reqs:
        core.add_request(r)
    got = run_until_idle(core)
    assert core.scheduler.num_preemptions > 0
    for r in reqs:
        assert got.tokens[r.req_id] == alone[r.req_id]
        assert got.tokens[r.req_id][5] == CLOSE and got.tokens[r.req_id].count(CLOSE) == 1
    assert core.metrics().reasoning_budget_cuts == 2


class IgnoringRunner(FakeRunner):
    """A runner that samples where it was told to force: the engine must not accept its token."""

    def execute(self, plan):
        out = super().execute(plan)
        forced = {s.req_id for s in plan.scheduled if s.forced_token_id is not None}
        return ModelRunnerOutput(results=[
            RequestResult(req_id=r.req_id, sampled_token_id=99) if r.req_id in forced else r for r in out.results
        ])


def test_a_runner_that_ignores_the_forced_token_fails_the_request():
    from helios.engine.config import SchedulerConfig

    cfg = SchedulerConfig(max_concurrency=4, max_num_batched_tokens=64, prefill_chunk_size=16, page_size=4,
                          num_pages=64)
    core = EngineCore(cfg, IgnoringRunner(cfg.page_size))
    core.add_request(request("a", max_tokens=8, reasoning_budget=budget(2)))
    got = run_until_idle(core)
    final = got.final["a"]
    assert final.finish_reason == "error" and "forced token" in final.error
    assert len(got.tokens["a"]) == 2 and core.metrics().reasoning_budget_cuts == 0


def test_state_counts_reasoning_tokens_and_closes_once():
    state = ReasoningBudgetState(budget(2))
    assert state.forced_token_id() is None
    state.observe(11)
    state.observe(12)
    assert state.num_reasoning_tokens == 2 and state.forced_token_id() == CLOSE
    state.observe(CLOSE)
    assert not state.is_open and state.forced_token_id() is None
    state.observe(13)  # answer tokens are not reasoning
    assert state.num_reasoning_tokens == 2


def expected_tokens(req, script: list[int]) -> list[int]:
    """The spec's rule replayed on one request alone: the fake model's tokens (scripted where given), with
    the close forced at the budget while reasoning is unambiguously open and the output limit not reached."""
    from tests.engine.fakes import context_token

    cap = req.reasoning_budget
    context, out = list(req.prompt_token_ids), []
    is_open, num_reasoning = cap.starts_in_reasoning, 0
    while len(out) < req.sampling.max_tokens:
        if is_open and num_reasoning >= cap.max_reasoning_tokens:
            token = cap.close_token_id
        else:
            token = script[len(out)] if len(out) < len(script) else context_token(context)
        out.append(token)
        context.append(token)
        if token in req.sampling.eos_token_ids:
            break
        if is_open:
            if token == cap.close_token_id or token in cap.tool_open_token_ids:
                is_open = False
            else:
                num_reasoning += 1
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 12), st.booleans(),
                             st.lists(st.sampled_from([11, 12, 13, CLOSE, TOOL, EOS]), max_size=10)),
                   min_size=1, max_size=4),
    # NOTE: at least 5 pages of 4 slots, so one request (6 prompt + 12 output) fits the pool alone: the
    # page-capacity limit is not part of the rule replayed here; fewer pages than requests still preempt
    num_pages=st.integers(5, 12),
)
def test_random_budgets_match_the_rule_under_batching_and_preemption(specs, num_pages):
    core, runner = make_core(num_pages=num_pages, page_size=4, max_concurrency=3, max_num_batched_tokens=8,
                             prefill_chunk_size=5, script={})
    reqs = []
    for i, (cap, max_tokens, starts, script) in enumerate(specs):
        req = request(f"r{i}", prompt_len=6, seed=i, max_tokens=max_tokens, eos_token_ids=(EOS,),
                      reasoning_budget=budget(cap, starts_in_reasoning=starts, tool_open_token_ids=[TOOL]))
        runner.script[req.req_id] = script
        reqs.append((req, script))
        core.add_request(req)
    got = run_until_idle(core)
    for req, script in reqs:
        assert got.tokens[req.req_id] == expected_tokens(req, script), req.req_id
        outs = [o for o in got.outputs[req.req_id] if o.new_token_ids]
        assert all(o.logprobs is None for o in outs if o.is_forced)
    num_forced = sum(o.is_forced for outs in got.outputs.values() for o in outs)
    assert core.metrics().reasoning_budget_cuts == num_forced == len(forced_plans(runner))
