"""One generation request's lifetime on the server: its choices (children), their engine streams, aborts.

Shared by every protocol: submitting a group (queue-full -> 503, unavailable -> 503, unrunnable -> 400),
merging the children's output streams in arrival order, and aborting every unfinished child when the
consumer goes away (a dropped connection) or a stop string ends a choice early. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from helios.engine.messages import EngineRequest, PositionLogprobs
from helios.engine.async_engine import QueueFull
from helios.frontend.context import ModelContext
from helios.frontend.prepare import Choice
from helios.output.choice import ChoiceOutput, OutputSpec
from helios.output.processor import OutputDelta, OutputProcessor, TokenEntry, finite
from helios.output.termination import Cause, termination_cause
from helios.server.errors import ApiError, bad_request, server_error, unavailable
from helios.server.runtime import Runtime


@dataclass
class Child:
    """One choice: its engine request, its output pipeline and what it has produced so far."""

    index: int
    request: EngineRequest
    processor: OutputProcessor
    text: str = ""
    entries: list[TokenEntry] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: object = None
    error: str | None = None
    has_started: bool = False  # the first generated token arrived
    tokens: list[tuple[int, str]] = field(default_factory=list)  # (token_id, text) pairs for the output parsers
    output_spec: OutputSpec | None = None  # how this choice's output is parsed (None: text)
    token_ids: list[int] = field(default_factory=list)  # every generated id, hidden stop tokens included
    token_times: list[float] = field(default_factory=list)  # per id: seconds from admission to its arrival here

    @classmethod
    def of(cls, choice: Choice) -> Child:
        return cls(choice.index, choice.request, choice.processor, output_spec=choice.output_spec)

    @property
    def req_id(self) -> str:
        return self.request.req_id

    def absorb(self, delta: OutputDelta, elapsed: float = 0.0) -> None:
        self.token_ids += delta.token_ids
        self.token_times += [elapsed] * len(delta.token_ids)
        self.text += delta.text
        self.entries += delta.entries
        self.tokens += delta.tokens
        if delta.prompt_logprobs:
            self.prompt_logprobs += delta.prompt_logprobs
        if delta.finished:
            self.finish_reason, self.stop_reason, self.error = delta.finish_reason, delta.stop_reason, delta.error


class OneChoice(msgspec.Struct, kw_only=True):
    """A prepared request of one choice (Messages, Responses): what the app submits and the encoders read."""

    req: Any  # the protocol's decoded request Struct (it has `stream`)
    prompt_ids: list[int]
    child: Child

    @property
    def stream(self) -> bool:
        return self.req.stream

    @property
    def children(self) -> list[Child]:
        return [self.child]


def failure(child: Child) -> ApiError | None:
    """The error a finished child stands for (None for stop/length)."""
    if child.finish_reason == "error":
        return server_error(f"generation failed: {child.error or 'execution error'}")
    if child.finish_reason == "abort":
        return unavailable("the request was aborted (the runtime is shutting down)")
    return None


def output_failure(out: ChoiceOutput) -> ApiError | None:
    """Output that broke tool_choice or could not be parsed: HTTP 500 buffered, a terminal event streamed."""
    message = out.failure_message()
    return server_error(message) if message is not None else None


class Generation:
    """Submit a group of children and iterate their deltas; closing the iterator aborts the rest."""

    def __init__(self, runtime: Runtime, children: list[Child]):
        self.runtime = runtime
        self.children = children
        self.admitted_at = time.monotonic()
        self._streams: list[AsyncIterator] = []
        self._first_text_seen = False

    async def submit(self) -> None:
        engine = self.runtime.engine
        # NOTE: every choice is handed over at once, so the engine admits the group in one round (in order)
        results = await asyncio.gather(*(engine.submit(c.request) for c in self.children), return_exceptions=True)
        refusal = next((r for r in results if isinstance(r, BaseException)), None)
        if refusal is None:
            self._streams = list(results)
            return
        for child, r in zip(self.children, results):  # the group is refused whole: its admitted choices go
            if not isinstance(r, BaseException):
                engine.abort(child.req_id)
        try:
            raise refusal
        except QueueFull as e:
            raise unavailable(f"the model request queue is full: {e}") from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except Exception as e:  # EngineUnavailable and anything else the engine refuses with
            raise unavailable(f"the model runtime is unavailable: {e}") from None

    def abort_all(self) -> None:
        for child in self.children[: len(self._streams)]:
            if child.finish_reason is None:
                self.runtime.engine.abort(child.req_id)

    def _note_first_text(self, delta: OutputDelta) -> None:
        if not self._first_text_seen and delta.text:
            self._first_text_seen = True
            self.runtime.http_metrics.observe_first_response(time.monotonic() - self.admitted_at)

    async def deltas(self) -> AsyncIterator[tuple[Child, OutputDelta]]:
        if len(self._streams) == 1:  # one choice (the common case): no merge, no task, no second queue
            async with contextlib.aclosing(self._one_delta_stream()) as items:
                async for item in items:
                    yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(child: Child, stream: AsyncIterator) -> None:
            try:
                async for out in stream:
                    delta = child.processor.process(out)
                    await queue.put((child, delta))
                    if delta.finished:
                        break  # a stop string may end the choice before the engine does
            except asyncio.CancelledError:
                raise
            except Exception as e:  # output processing failed: the choice fails, the server stays up
                delta = OutputDelta(finished=True, finish_reason="error", error=f"{type(e).__name__}: {e}")
                await queue.put((child, delta))
            finally:
                await stream.aclose()  # NOTE: closing an unfinished engine stream aborts the request
                queue.put_nowait((child, None))

        tasks = [asyncio.ensure_future(pump(c, s)) for c, s in zip(self.children, self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                child, delta = await queue.get()
                if delta is None:
                    remaining -= 1
                    if child.finish_reason is None:  # the stream ended without a terminal record
                        yield self._absorb(child, child.processor.finish_by_client())
                    continue
                yield self._absorb(child, delta)
        finally:
            for t in tasks:
                t.cancel()
            self.abort_all()

    async def _one_delta_stream(self) -> AsyncIterator[tuple[Child, OutputDelta]]:
        child, stream = self.children[0], self._streams[0]
        try:
            try:
                async for out in stream:
                    delta = child.processor.process(out)
                    yield self._absorb(child, delta)
                    if delta.finished:
                        return  # a stop string may end the choice before the engine does
            except Exception as e:  # output processing failed: the choice fails, the server stays up
                delta = OutputDelta(finished=True, finish_reason="error", error=f"{type(e).__name__}: {e}")
                yield self._absorb(child, delta)
                return
            if child.finish_reason is None:  # the stream ended without a terminal record
                yield self._absorb(child, child.processor.finish_by_client())
        finally:
            await stream.aclose()  # NOTE: closing an unfinished engine stream aborts the request
            self.abort_all()

    def _absorb(self, child: Child, delta: OutputDelta) -> tuple[Child, OutputDelta]:
        if delta.num_new_tokens:
            child.has_started = True
        self._note_first_text(delta)
        child.absorb(delta, round(time.monotonic() - self.admitted_at, 6))
        return child, delta

    async def run(self) -> list[Child]:
        """Buffered: drain every child."""
        async for _ in self.deltas():
            pass
        return self.children


async def parsed_output(gen: Generation, child: Child) -> ChoiceOutput:
    """Buffered, one choice: every delta through its parsers; a failed choice or output raises its ApiError."""
    out = ChoiceOutput(child.output_spec)
    async for _, delta in gen.deltas():
        out.add(delta)
    if (err := failure(child) or output_failure(out)) is not None:
        raise err
    out.close()
    return out


def token_string(ctx: ModelContext, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else ctx.tokenizer.token_text(token_id)


def encode_prompt_logprobs(ctx: ModelContext, records: list[PositionLogprobs], k: int) -> list[dict | None]:
    """[null, {id: {logprob, rank, decoded_token}}, ...]: the actual token plus up to k alternatives."""
    tok = ctx.tokenizer
    out: list[dict | None] = [None]
    for rec in records:
        entry = {}
        for t in [rec.token, *rec.alternatives[:k]]:
            key = str(t.token_id)
            if key not in entry:
                entry[key] = {"logprob": finite(t.logprob), "rank": t.rank, "decoded_token": tok.token_text(t.token_id)}
        out.append(entry)
    return out


def usage(num_prompt: int, num_completion: int, num_cached: int, reasoning: bool, num_reasoning: int = 0) -> dict:
    body = {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
    if reasoning:
        body["completion_tokens_details"] = {"reasoning_tokens": num_reasoning}
    return body


# --- one terminal cause, one table: each protocol's finish reason ---------------------------------------

FINISH_REASONS: dict[str, dict[str, str]] = {
    "chat": {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "length": "length",
             "tool_calls": "tool_calls"},
    "completions": {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "length": "length",
                    "tool_calls": "stop"},
    "messages": {"eos": "end_turn", "stop_token": "end_turn", "stop_string": "stop_sequence", "length": "max_tokens",
                 "tool_calls": "tool_use"},
    "responses": {"eos": "completed", "stop_token": "completed", "stop_string": "completed", "length": "incomplete",
                  "tool_calls": "completed"},
}


def cause(child: Child, num_tool_calls: int = 0) -> Cause:
    return termination_cause(child.finish_reason, child.stop_reason, child.request.sampling.eos_token_ids,
                             num_tool_calls)


def finish_reason(child: Child, protocol: str, num_tool_calls: int = 0) -> str:
    """The protocol's finish reason for a child that ended normally (failures go through `failure`)."""
    c = cause(child, num_tool_calls)
    return FINISH_REASONS[protocol].get(c, FINISH_REASONS[protocol]["eos"])


def reported_stop_reason(child: Child) -> str | int | None:
    """What stopped a choice, as the OpenAI routes report it: the stop string, or the stop token id (None for
    EOS, for a token sequence and for any other finish)."""
    reason = child.stop_reason
    if child.finish_reason != "stop" or isinstance(reason, list) or reason in child.request.sampling.eos_token_ids:
        return None
    return reason


class TokenUsage(msgspec.Struct, frozen=True):
    """Native counts every protocol encodes: prompt (cached included), cached, generated, reasoning."""

    num_prompt: int
    num_cached: int
    num_generated: int
    num_reasoning: int = 0


def child_usage(child: Child | None, num_prompt: int, num_reasoning: int = 0) -> TokenUsage:
    if child is None:
        return TokenUsage(num_prompt, 0, 0)
    return TokenUsage(num_prompt, child.processor.num_cached_tokens, child.processor.num_generated, num_reasoning)


def encode_token_entry(ctx: ModelContext, e: TokenEntry, as_ids: bool) -> dict:
    """The Chat token shape {token, logprob, bytes, top_logprobs}, shared by the protocols that use it."""
    table = ctx.tokenizer.token_bytes
    return {
        "token": token_string(ctx, e.token_id, as_ids),
        "logprob": e.logprob,
        "bytes": list(e.token_bytes),
        "top_logprobs": [
            {"token": token_string(ctx, t.token_id, as_ids), "logprob": finite(t.logprob),
             "bytes": list(table[t.token_id]) if 0 <= t.token_id < len(table) else []}
            for t in e.top
        ],
    }
