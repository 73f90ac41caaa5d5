"""Every engine boundary message is plain data: it round-trips through msgpack unchanged, so the engine could
run in another process (requests, aborts, step outputs, the step contract and the published metrics)."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from helios.engine import messages
from helios.engine.engine_core import EngineMetrics
from helios.engine.messages import (
    AbortRequest,
    ConstraintSpec,
    EngineOutput,
    EngineRequest,
    FrontendStats,
    Histogram,
    ModelRunnerOutput,
    NewRequestData,
    PositionLogprobs,
    ReasoningBudget,
    RequestResult,
    RunnerStats,
    SamplingParams,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprob,
)

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=7, max_tokens=32, eos_token_ids=(2,),
                          stop_token_sequences=((5, 6),), logprobs=2, logprob_token_ids=(3, 4),
                          logit_bias=((9, -1.5),))
LOGPROBS = PositionLogprobs(token=TokenLogprob(11, -0.25, 1), alternatives=[TokenLogprob(12, -1.5, 2)])

SAMPLES = [
    SAMPLING,
    ReasoningBudget(max_reasoning_tokens=8, close_token_id=5, starts_in_reasoning=True, tool_open_token_ids=(6,)),
    ConstraintSpec(grammar='{"grammars": [{"lark_grammar": "start: \\"a\\""}]}', starts_in_reasoning=True,
                   close_token_id=5, tool_open_token_ids=(6, 7)),
    EngineRequest(req_id="r", prompt_token_ids=[1, 2, 3], sampling=SAMPLING,
                  reasoning_budget=ReasoningBudget(max_reasoning_tokens=4, close_token_id=5, starts_in_reasoning=False),
                  constraint=ConstraintSpec(grammar="g")),
    AbortRequest(req_id="r"),
    TokenLogprob(11, -0.25, 1),
    LOGPROBS,
    EngineOutput(req_id="r", new_token_ids=[11], logprobs=[LOGPROBS], prompt_logprobs=[LOGPROBS], finished=True,
                 finish_reason="stop", stop_token=[5, 6], num_prompt_tokens=3, num_cached_tokens=2),
    EngineOutput(req_id="r", finished=True, finish_reason="error", error="the output constraint refused token 9",
                 stop_token=2),
    NewRequestData(req_id="r", prompt_token_ids=[1, 2], sampling=SAMPLING, output_token_ids=[11]),
    ScheduledRequest(req_id="r", token_ids=[3], num_computed_tokens=2, block_ids=[0, 4], sample=True,
                     forced_token_id=None, token_mask=b"\x01\x00\xff\x7f"),
    SchedulerOutput(new_requests=[NewRequestData(req_id="r", prompt_token_ids=[1], sampling=SAMPLING)],
                    scheduled=[ScheduledRequest(req_id="r", token_ids=[1], num_computed_tokens=0, block_ids=[0],
                                                sample=True, token_mask=b"\x00\x01\x02\x03")],
                    finished_req_ids=["q"], num_scheduled_tokens=1, copy_out=[(1, 2)], copy_in=[(2, 3)],
                    spill=[(0, b"\x12" * 16)], disk_drop=[b"\x34" * 16], load=[(b"\x56" * 16, 1)]),
    RequestResult(req_id="r", sampled_token_id=11, logprobs=LOGPROBS, prompt_logprobs=[LOGPROBS]),
    ModelRunnerOutput(results=[RequestResult(req_id="r", sampled_token_id=None)]),
    RunnerStats(graph_launches={"graph": 3, "eager": 1}, replay_gpu_ns=12345),
    Histogram(bounds=[16.0, 64.0], counts=[1, 0, 2], sum=300.0, count=3),
    FrontendStats(http_requests=3, admission_slots=8, admission_in_use=2, first_response=[(1.5, 0.25), (0.5, 0.125)]),
]


def _boundary_structs() -> set[type]:
    return {obj for _, obj in inspect.getmembers(messages, inspect.isclass)
            if issubclass(obj, msgspec.Struct) and obj.__module__ == messages.__name__}


def test_every_boundary_message_has_a_sample():
    assert _boundary_structs() <= {type(s) for s in SAMPLES}


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_through_msgpack(message):
    wire = msgspec.msgpack.encode(message)
    assert msgspec.msgpack.decode(wire, type=type(message)) == message


def test_engine_metrics_round_trip():
    metrics = EngineMetrics(prefill_tokens=1, generated_tokens=2, completed=3, failed=4, active=5, pending=6,
                            free_pages=7, total_pages=8, page_tokens=16, host_bytes_in=9,
                            graph_launches={"graph": 2}, replay_gpu_ns=5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(metrics), type=EngineMetrics) == metrics
