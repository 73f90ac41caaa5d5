"""POST /v1/chat/completions: the OpenAI Chat Completions protocol (buffered and SSE).

decode (the body into typed Structs, lowered into frontend's neutral GenerationRequest: ChatMessages,
SamplingFields, ToolPlan, OutputFormat) -> helios.frontend.prepare -> encode (chat.completion objects or
chat.completion.chunk events). Every refusal becomes an ApiError here, in `prepare`. No torch.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import Struct

from helios.frontend.chat import ChatMessage, join_text_blocks
from helios.frontend.effort import effort_template_kwargs, native_effort
from helios.frontend.prepare import Conversation, GenerationRequest, prepare as prepare_request
from helios.frontend.reasoning import check_thinking_token_budget
from helios.frontend import structured
from helios.frontend.context import ModelContext
from helios.frontend.sampling import InvalidRequest, SamplingFields, SamplingRequest, sampling_fields, stop_strings
from helios.frontend.tools import ToolPlan, function_tool, plan_tools
from helios.output.choice import ChoiceOutput, parsed
from helios.output.processor import OutputDelta, TokenEntry
from helios.server.errors import bad_request, decode_body, from_invalid
from helios.server.generation import (Child, Generation, encode_prompt_logprobs, encode_token_entry, failure,
                                      finish_reason, output_failure, reported_stop_reason, usage)
from helios.server.http import SSE_DONE, sse_event
from helios.server.runtime import Runtime

MAX_N = 128


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: Any = None


class Message(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: list[Message]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False  # prompt_token_ids, and token_ids per choice (every generated id)
    return_token_timestamps: bool = False  # token_timestamps per choice: seconds from admission, per token id
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    structured_outputs: Any = None  # native extension: json | json_object | regex | grammar | choice
    logit_bias: dict[str, float] | None = None
    thinking_token_budget: int | None = None
    reasoning_effort: Any = None
    user: str | None = None


# --- decode -------------------------------------------------------------------------------------------------


def _content_text(m: Message) -> str | None:
    if m.content is None or isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type in ("text", "input_text") and part.text is not None:
            texts.append(part.text)
        elif part.type in ("image_url", "input_image", "image"):
            raise bad_request("this core is text-only: image content is not supported", "messages")
        else:
            raise bad_request(f"unsupported content part type {part.type!r}", "messages")
    return join_text_blocks(texts)  # one rule for every protocol's text blocks


def _sampling_fields(req: ChatCompletionRequest) -> SamplingFields:
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request("top_logprobs must be in [0, 20]", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    return sampling_fields(
        req, stop=stop_strings(req.stop), logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        logprob_token_ids=req.logprob_token_ids, prompt_logprobs=req.prompt_logprobs, logit_bias=req.logit_bias,
    )


def _check_unsupported(req: ChatCompletionRequest, ctx: ModelContext) -> None:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}]", "n")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs cannot be combined with stream: true", "prompt_logprobs")
    check_thinking_token_budget(ctx, req.thinking_token_budget)


def _tool_plan(req: ChatCompletionRequest, ctx: ModelContext) -> ToolPlan:
    """Chat's spelling: tools [{"type": "function", "function": {...}}]; tool_choice "auto" | "none" |
    "required" | {"type": "function", "function": {"name": N}}; parallel_tool_calls."""
    tools = []
    for t in req.tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request("only function tools ({\"type\": \"function\", \"function\": {...}}) are supported",
                              "tools")
        tools.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), fn.get("strict"),
                                   "tools"))
    choice, named = req.tool_choice, None
    if choice is None:
        mode = "auto"
    elif choice in ("auto", "none", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        mode, named = "named", choice["function"].get("name")
    else:
        raise bad_request("tool_choice must be \"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return plan_tools(ctx, tools, mode, named, req.parallel_tool_calls is not False)


@dataclass
class ChatPrepared:
    req: ChatCompletionRequest
    children: list[Child]
    prompt_ids: list[int]

    @property
    def stream(self) -> bool:
        return self.req.stream


def decode(body: bytes, ctx: ModelContext) -> tuple[ChatCompletionRequest, GenerationRequest]:
    """The body -> the neutral request (Chat's own checks and spellings on the way)."""
    req = decode_body(body, ChatCompletionRequest)
    _check_unsupported(req, ctx)
    plan = _tool_plan(req, ctx)
    fmt = structured.one_format(structured.chat_response_format(req.response_format),
                                structured.native_structured_outputs(req.structured_outputs))
    messages = [
        ChatMessage(role=m.role, content=_content_text(m), reasoning=m.reasoning_content or m.reasoning,
                    name=m.name, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id)
        for m in req.messages
    ]
    recipe = ctx.manifest.recipe
    effort = native_effort(req.reasoning_effort, recipe, "reasoning_effort")
    conversation = Conversation(messages, req.add_generation_prompt, req.continue_final_message,
                                effort_template_kwargs(req.chat_template_kwargs, effort, recipe))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return req, GenerationRequest(conversation, _sampling_fields(req), requested, n=req.n, plan=plan, fmt=fmt,
                                  thinking_budget=req.thinking_token_budget,
                                  skip_special_tokens=req.skip_special_tokens)


def prepare(body: bytes, ctx: ModelContext) -> ChatPrepared:
    """Blocking frontend work (decode, template, tokenize, sampling): runs on the frontend pool."""
    try:
        req, neutral = decode(body, ctx)
        prep = prepare_request(ctx, neutral, f"chatcmpl-{uuid.uuid4().hex}")
    except InvalidRequest as e:
        raise from_invalid(e) from None
    return ChatPrepared(req, [Child.of(c) for c in prep.choices], prep.prompt_ids)


# --- encode -------------------------------------------------------------------------------------------------


def _logprobs(ctx: ModelContext, req: ChatCompletionRequest, entries: list[TokenEntry]) -> dict | None:
    if not req.logprobs:
        return None
    return {"content": [encode_token_entry(ctx, e, req.return_tokens_as_token_ids) for e in entries]}


def _finish(child: Child, num_tool_calls: int = 0) -> str:
    return finish_reason(child, "chat", num_tool_calls)


def _usage(children: list[Child], num_prompt: int, outputs: dict[int, ChoiceOutput] | None = None) -> dict:
    num_completion = sum(c.processor.num_generated for c in children)
    cached = children[0].processor.num_cached_tokens if children else 0
    num_reasoning = sum(o.num_reasoning_tokens for o in (outputs or {}).values())
    return usage(num_prompt, num_completion, cached, reasoning=True, num_reasoning=num_reasoning)


def _parsed(child: Child) -> ChoiceOutput:
    """A buffered choice's whole output through its parsers, as one delta."""
    return parsed(child.output_spec, OutputDelta(tokens=child.tokens, entries=child.entries, finished=True,
                                                 finish_reason=child.finish_reason, stop_reason=child.stop_reason))


def _tool_call_json(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def buffered(runtime: Runtime, prep: ChatPrepared, gen: Generation) -> dict:
    """The chat.completion object once every choice finished."""
    await gen.run()
    req, children, num_prompt = prep.req, prep.children, len(prep.prompt_ids)
    for child in children:
        if (err := failure(child)) is not None:
            raise err
    outputs = {c.index: _parsed(c) for c in children if c.output_spec is not None}
    for out in outputs.values():
        if (err := output_failure(out)) is not None:
            raise err
    choices = []
    for c in children:
        message = {"role": "assistant", "content": c.text, "reasoning_content": None, "tool_calls": []}
        num_calls = 0
        if (out := outputs.get(c.index)) is not None:
            calls = out.tool_calls
            num_calls = len(calls)
            message = {"role": "assistant", "content": out.text if out.text or not calls else None,
                       "reasoning_content": out.reasoning, "tool_calls": [_tool_call_json(t) for t in calls]}
        choice = {
            "index": c.index,
            "message": message,
            "logprobs": _logprobs(runtime.model, req, c.entries),
            "finish_reason": _finish(c, num_calls),
            "stop_reason": reported_stop_reason(c),
        }
        choices.append(_observed(req, choice, c.token_ids, c.token_times))
    body = {
        "id": children[0].req_id.rsplit("-", 1)[0],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": runtime.serving.model_id,
        "choices": choices,
        "usage": _usage(children, num_prompt, outputs),
    }
    if req.prompt_logprobs is not None:
        records = children[0].prompt_logprobs
        body["prompt_logprobs"] = encode_prompt_logprobs(runtime.model, records, req.prompt_logprobs)
    if req.return_token_ids:
        body["prompt_token_ids"] = list(children[0].request.prompt_token_ids)
    return body


def _observed(req: ChatCompletionRequest, choice: dict, token_ids: list[int], times: list[float]) -> dict:
    """The token observation extensions on one choice (buffered) or one chunk's choice (streamed)."""
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    if req.return_token_timestamps:
        choice["token_timestamps"] = times
    return choice


async def stream_events(runtime: Runtime, prep: ChatPrepared, gen: Generation):
    """chat.completion.chunk SSE events; a failure ends the stream with an error event and no [DONE]."""
    req, num_prompt = prep.req, len(prep.prompt_ids)
    opts = req.stream_options or StreamOptions()
    include_usage, continuous = opts.include_usage, opts.include_usage and opts.continuous_usage_stats
    base = {"id": gen.children[0].req_id.rsplit("-", 1)[0], "object": "chat.completion.chunk",
            "created": int(time.time()), "model": runtime.serving.model_id}
    announced: set[int] = set()
    outputs = {c.index: ChoiceOutput(c.output_spec) for c in gen.children if c.output_spec is not None}
    observing = req.return_token_ids or req.return_token_timestamps
    # ids (and times) of tokens not yet on a chunk, per choice: each goes on the next chunk of its choice
    pending: dict[int, tuple[list[int], list[float]]] = {c.index: ([], []) for c in gen.children}
    first = [True]

    def chunk(choices: list[dict]) -> bytes:
        body = {**base, "choices": choices}
        if first[0] and req.return_token_ids:
            body["prompt_token_ids"] = list(gen.children[0].request.prompt_token_ids)
        first[0] = False
        if observing:
            for choice in choices:
                ids, times = pending[choice["index"]]
                _observed(req, choice, list(ids), list(times))
                ids.clear()
                times.clear()
        if continuous:
            body["usage"] = _usage(gen.children, num_prompt, outputs)
        elif include_usage:
            body["usage"] = None
        elif req.return_token_ids and any(c["finish_reason"] is not None for c in choices):
            body["usage"] = _usage(gen.children, num_prompt, outputs)  # no usage chunk follows: the terminal one
        return sse_event(msgspec.json.encode(body))

    async for child, delta in gen.deltas():
        if (err := failure(child)) is not None:
            yield sse_event(err.encode())
            return
        if delta.token_ids:
            ids, times = pending[child.index]
            ids += delta.token_ids
            times += child.token_times[len(child.token_times) - len(delta.token_ids):]
        if child.has_started and child.index not in announced:
            announced.add(child.index)
            yield chunk([{"index": child.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        if child.index not in announced:
            continue
        if (out := outputs.get(child.index)) is not None:
            for frame in _parsed_chunks(runtime.model, req, child, delta, out, chunk):
                yield frame
            if (err := output_failure(out)) is not None:
                yield sse_event(err.encode())
                return
            continue
        if delta.text or delta.entries or delta.finished:
            choice = {"index": child.index, "delta": {"content": delta.text} if delta.text else {},
                      "logprobs": _logprobs(runtime.model, req, delta.entries), "finish_reason": None}
            if delta.finished:
                choice["finish_reason"] = _finish(child)
            yield chunk([choice])
    if include_usage:
        yield sse_event(msgspec.json.encode({**base, "choices": [], "usage": _usage(gen.children, num_prompt,
                                                                                       outputs)}))
    yield SSE_DONE


def _parsed_chunks(ctx: ModelContext, req: ChatCompletionRequest, child: Child, delta: OutputDelta,
                   out: ChoiceOutput, chunk):
    """The chunks of one parsed delta: content, reasoning_content and whole tool calls (index, id, name,
    arguments) in output order; the finish chunk once the choice ended without a parse failure."""
    for ev in out.add(delta):
        if ev.kind != "delta":
            continue
        if ev.block.kind == "tool_call":
            call = out.tool_call(ev.index)
            body = {"tool_calls": [{"index": call.index, **_tool_call_json(call)}]}
        elif ev.block.kind == "reasoning":
            body = {"reasoning_content": ev.text}
        else:
            body = {"content": ev.text}
        yield chunk([{"index": child.index, "delta": body, "logprobs": _logprobs(ctx, req, ev.entries),
                      "finish_reason": None}])
    if delta.finished and out.error is None:
        out.close()
        yield chunk([{"index": child.index, "delta": {}, "logprobs": None,
                      "finish_reason": _finish(child, out.num_tool_calls)}])

