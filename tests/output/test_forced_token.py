"""A forced token (the reasoning close the engine injects at the thinking budget) through the output side:
no logprob entry, counted as generated, consumed by the reasoning parser as the delimiter, not as reasoning."""

from __future__ import annotations

from helios.core.manifest import ReasoningSyntax
from helios.engine.messages import EngineOutput, PositionLogprobs, SamplingParams, TokenLogprob
from helios.output.events import ReasoningDelta, TextDelta
from helios.output.parsers import build
from helios.output.processor import OutputProcessor

TABLE = [b"<eos>", b"<think>", b"</think>", b"Hm", b" so", b"Yes", b"."]
EOS, OPEN, CLOSE = 0, 1, 2
SYNTAX = ReasoningSyntax(open="<think>", close="</think>", open_token_id=OPEN, close_token_id=CLOSE,
                         starts_in_reasoning=True)


def _out(ids, *, is_forced=False, finished=False):
    # NOTE: the forced output carries a record too: the processor must drop it whatever the engine sends
    records = [PositionLogprobs(TokenLogprob(t, -0.25, 1), []) for t in ids]
    return EngineOutput(req_id="r", new_token_ids=ids, logprobs=records, is_forced=is_forced, finished=finished,
                        finish_reason="length" if finished else None, num_prompt_tokens=4)


def test_forced_close_has_no_logprob_entry_but_counts_and_closes_reasoning():
    processor = OutputProcessor(TABLE, frozenset({EOS}), SamplingParams(logprobs=0, eos_token_ids=(EOS,)))
    parser = build(None, "think", SYNTAX)
    outputs = [_out([3]), _out([4]), _out([CLOSE], is_forced=True), _out([5]), _out([6], finished=True)]
    entries, events = [], []
    for out in outputs:
        delta = processor.process(out)
        entries += delta.entries
        for token_id, text in delta.tokens:
            events += parser.feed(token_id, text)
    events += parser.finish(truncated=True)
    assert [e.token_id for e in entries] == [3, 4, 5, 6]  # every sampled token, not the forced close
    assert processor.num_generated == 5  # usage counts it
    assert parser.num_reasoning_tokens == 2  # the close is a delimiter, not reasoning
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    answer = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert (reasoning, answer) == ("Hm so", "Yes.")
