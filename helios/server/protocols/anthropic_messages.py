"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages protocol (buffered and named SSE).

decode (the body into typed Structs, lowered into frontend's neutral GenerationRequest: ChatMessages,
SamplingFields, ToolPlan, OutputFormat, thinking budget) -> helios.frontend.prepare -> encode (the ordered output
blocks of helios.output as a message object, or as message_start / content_block_* / message_delta /
message_stop events). Errors use the Messages shape (errors.encode_for). Thinking blocks carry a local
flare-thinking-v1: marker over their text. No torch.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import uuid
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from helios.frontend.chat import ChatMessage, join_text_blocks, tool_call
from helios.frontend.effort import effort_template_kwargs, messages_effort
from helios.frontend.prepare import (Conversation, GenerationRequest, prepare as prepare_request, render,
                                     with_cache_hints)
from helios.frontend.reasoning import check_thinking_token_budget
from helios.frontend import structured
from helios.frontend.context import ModelContext
from helios.frontend.sampling import InvalidRequest, SamplingRequest, sampling_fields
from helios.frontend.tools import ToolPlan, function_tool, plan_tools
from helios.output.accumulator import BlockEvent, OutputBlock
from helios.output.choice import ChoiceOutput
from helios.server.errors import ApiError, bad_request, decode_body, from_invalid
from helios.server.generation import (Child, Generation, OneChoice, child_usage, failure, finish_reason,
                                      output_failure, parsed_output)
from helios.server.http import sse_named
from helios.server.runtime import Runtime

ANTHROPIC_VERSION = "2023-06-01"
_VERSION_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
THINKING_MARKER = "flare-thinking-v1:"
MAX_CACHE_HINTS = 4
_REJECTED = ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "logprob_token_ids", "prompt_logprobs")
_HINTED = ("text", "image", "tool_result")  # user blocks whose cache_control marks a candidate boundary


class Block(Struct, kw_only=True):
    """One content block; which fields matter depends on `type`."""

    type: str
    text: str | None = None
    cache_control: dict | None = None
    source: Any = None  # image / document
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(Struct, kw_only=True):
    role: str
    content: str | list[Block]


class Thinking(Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None


class MessagesRequest(SamplingRequest, kw_only=True):
    """Messages' body; the shared sampling fields (top_k, seed, min_p, penalties, token stops, ignore_eos
    are native extensions here, as on the OpenAI routes) come from SamplingRequest."""

    messages: list[Message]
    model: str | None = None
    max_tokens: int | None = None  # required on /v1/messages, unused by count_tokens
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: Thinking | None = None
    context_management: dict | None = None
    output_config: dict | None = None
    output_format: dict | None = None  # structured outputs' earlier spelling of output_config.format
    service_tier: str | None = None
    thinking_token_budget: int | None = None  # native extension
    # rejected on this route (spec: "Generation log probabilities"); UNSET tells absence from null
    logprobs: Any | UnsetType = UNSET
    top_logprobs: Any | UnsetType = UNSET
    return_tokens_as_token_ids: Any | UnsetType = UNSET
    logprob_token_ids: Any | UnsetType = UNSET
    prompt_logprobs: Any | UnsetType = UNSET


class Prepared(OneChoice, kw_only=True):
    req: MessagesRequest
    cache_boundaries: list[int]  # candidate prefix-checkpoint boundaries (prompt token positions)


def thinking_signature(text: str) -> str:
    """The deterministic local marker of a thinking block: a round-trip check, not authentication."""
    return THINKING_MARKER + hashlib.sha256(text.encode("utf-8")).hexdigest()


# --- decode -------------------------------------------------------------------------------------------------


def _system_text(system: str | list[Block] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for b in system:
        if b.type != "text" or b.text is None:
            raise bad_request(f"system blocks must be text blocks, not {b.type!r}")
        texts.append(b.text)
    return join_text_blocks(texts)


def _result_text(block: Block) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for b in content:
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "image":
            raise bad_request("this core is text-only: image blocks (in a tool_result) need a vision core")
        else:
            raise bad_request(f"unsupported tool_result content block type {b.type!r}")
    return join_text_blocks(texts)


def _check_thinking_block(block: Block) -> str:
    text = block.thinking or ""
    sig = block.signature or ""
    # NOTE: readable thinking from other providers replays as is; only our own marker is checked
    if sig.startswith(THINKING_MARKER) and sig != thinking_signature(text):
        raise bad_request("a thinking block's flare-thinking-v1 signature does not match its text")
    return text


def _user_turn(blocks: list[Block], out: list[ChatMessage], hints: list[str]) -> None:
    """Text blocks join into one user message; each tool_result becomes a tool message at its position."""
    texts: list[str] = []
    for b in blocks:
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "image":
            raise bad_request("this core is text-only: image blocks need a vision core")
        elif b.type == "tool_result":
            if texts:
                out.append(ChatMessage(role="user", content=join_text_blocks(texts)))
                texts = []
            out.append(ChatMessage(role="tool", content=_result_text(b), tool_call_id=b.tool_use_id,
                                   is_error=bool(b.is_error)))
        else:
            raise bad_request(f"unsupported user content block type {b.type!r}")
        if b.cache_control is not None and b.type in _HINTED and len(hints) < MAX_CACHE_HINTS:
            hints.append(out[-1].content if b.type == "tool_result" else join_text_blocks(texts))
    if texts or not blocks:
        out.append(ChatMessage(role="user", content=join_text_blocks(texts)))


def _assistant_turn(blocks: list[Block]) -> ChatMessage:
    texts, reasoning, calls = [], [], []
    for b in blocks:
        if b.type == "text":
            texts.append(b.text or "")
        elif b.type == "thinking":
            reasoning.append(_check_thinking_block(b))
        elif b.type == "redacted_thinking":
            raise bad_request("redacted_thinking blocks are opaque and cannot be replayed to this model")
        elif b.type == "tool_use":
            if not b.id or not b.name:
                raise bad_request("tool_use blocks need an id and a name")
            calls.append(tool_call(b.id, b.name, json.dumps(b.input if b.input is not None else {})))
        else:
            raise bad_request(f"unsupported assistant content block type {b.type!r}")
    return ChatMessage(role="assistant", content=join_text_blocks(texts),
                       reasoning=join_text_blocks(reasoning) if reasoning else None, tool_calls=calls or None)


def to_conversation(req: MessagesRequest) -> tuple[list[ChatMessage], list[str]]:
    """Messages -> neutral ChatMessages, plus each cache hint as its message's content up to the hinted block."""
    out: list[ChatMessage] = []
    system = _system_text(req.system)
    if system:
        out.append(ChatMessage(role="system", content=system))
    hints: list[str] = []
    for m in req.messages:
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "system":  # inline system text in the history
            out.append(ChatMessage(role="system", content=_system_text(blocks)))
        elif m.role == "user":
            _user_turn(blocks, out, hints)
        elif m.role == "assistant":
            out.append(_assistant_turn(blocks))
        else:
            raise bad_request(f"unsupported message role {m.role!r}; use user or assistant")
    return out, hints


def _check_request(req: MessagesRequest, ctx: ModelContext) -> None:
    for name in _REJECTED:
        if getattr(req, name) is not UNSET:
            raise bad_request(f"{name} is not supported on /v1/messages")
    if not req.messages:
        raise bad_request("messages must be a nonempty array")
    if req.thinking is not None:
        if req.thinking.type not in ("enabled", "disabled", "adaptive"):
            raise bad_request(f"unsupported thinking type {req.thinking.type!r}")
        budget = req.thinking.budget_tokens
        if budget is not None and budget < 1:
            raise bad_request("thinking.budget_tokens must be a positive integer")
        if budget is not None and req.thinking_token_budget is not None and budget != req.thinking_token_budget:
            raise bad_request("thinking.budget_tokens and thinking_token_budget must match")
    check_thinking_token_budget(ctx, req.thinking_token_budget, None)
    for edit in (req.context_management or {}).get("edits") or []:
        keep = edit.get("keep") if isinstance(edit, dict) else None
        if not (isinstance(edit, dict) and edit.get("type") == "clear_thinking_20251015"
                and keep in ("all", {"type": "all"})):
            raise bad_request("context_management accepts only clear_thinking_20251015 with keep: \"all\"; "
                              "active context edits are not supported")
    choice = req.tool_choice
    if choice is not None:
        kind = choice.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise bad_request(f"unsupported tool_choice type {kind!r}")
        if kind == "tool" and choice.get("name") not in {t.get("name") for t in req.tools or []}:
            raise bad_request("tool_choice names a tool that is not declared in tools")


_CHOICE_MODES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


def _tool_plan(req: MessagesRequest, ctx: ModelContext) -> ToolPlan:
    """Messages' spelling: tools [{name, description, input_schema}] (type custom or absent); tool_choice
    {"type": auto | any | tool | none, "name", "disable_parallel_tool_use"}; any is required mode."""
    tools = []
    for t in req.tools or []:
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"unsupported tool type {kind!r}; only client tools with an input_schema are supported")
        tools.append(function_tool(t.get("name"), t.get("description"), t.get("input_schema"), t.get("strict"),
                                   None))
    choice = req.tool_choice or {}
    mode = _CHOICE_MODES.get(choice.get("type", "auto"), "auto")
    parallel = choice.get("disable_parallel_tool_use") is not True
    return plan_tools(ctx, tools, mode, choice.get("name") if mode == "named" else None, parallel, None,
                      None)


def _call_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _boundaries(ctx: ModelContext, text: str, hints: list[str]) -> list[int]:
    """Token positions just after each hinted block, found in order in the rendered prompt (advisory:
    a hint whose text the template does not render verbatim is dropped)."""
    out, cursor = [], 0
    for content in hints:
        pos = text.find(content, cursor) if content else -1
        if pos < 0:
            continue
        cursor = pos + len(content)
        out.append(len(ctx.tokenizer.encode(text[:cursor], add_special_tokens=False)))
    return out


def decode(body: bytes, ctx: ModelContext) -> tuple[MessagesRequest, GenerationRequest, list[str]]:
    """The body -> the neutral request, plus the cache hints (Messages' own checks and spellings on the way)."""
    req = decode_body(body, MessagesRequest)
    _check_request(req, ctx)
    plan = _tool_plan(req, ctx)
    # output_config.format or output_format: {"type": "json_schema", "schema": {...}} (one of them)
    fmt = structured.one_format(
        structured.messages_output_format((req.output_config or {}).get("format"), "output_config.format"),
        structured.messages_output_format(req.output_format))
    messages, hints = to_conversation(req)
    # NOTE: a final assistant message is a prefill: the template continues it instead of opening a turn
    prefill = messages[-1].role == "assistant"
    if prefill and not ctx.manifest.template.continuation:
        raise bad_request("this core's template cannot continue an assistant prefill")
    thinking = req.thinking or Thinking(type="disabled")
    effort = messages_effort((req.output_config or {}).get("effort"), thinking.type, thinking.budget_tokens)
    conversation = Conversation(messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                                template_kwargs=effort_template_kwargs(None, effort, ctx.manifest.recipe))
    fields = sampling_fields(req, stop=list(req.stop_sequences or []))
    return req, GenerationRequest(conversation, fields, req.max_tokens, plan=plan, fmt=fmt,
                                  thinking_budget=_thinking_budget(req), new_call_id=_call_id), hints


def _thinking_budget(req: MessagesRequest) -> int | None:
    """The request's explicit reasoning cap: thinking_token_budget, else an enabled or adaptive
    thinking.budget_tokens (both present must match; checked in _check_request)."""
    if req.thinking_token_budget is not None:
        return req.thinking_token_budget
    if req.thinking is not None and req.thinking.type in ("enabled", "adaptive"):
        return req.thinking.budget_tokens
    return None


def prepare(body: bytes, ctx: ModelContext) -> Prepared:
    """Blocking frontend work (decode, lower, template, tokenize, sampling) on the frontend pool."""
    try:
        req, neutral, hints = decode(body, ctx)
        if req.max_tokens is None:
            raise bad_request("max_tokens is required")
        prep = prepare_request(ctx, neutral, f"msg_{uuid.uuid4().hex[:24]}")
    except InvalidRequest as e:
        raise from_invalid(e) from None
    boundaries = _boundaries(ctx, prep.prompt_text or "", hints)
    child = Child.of(with_cache_hints(ctx, prep.choices[0], boundaries))  # candidates of a hybrid model's checkpoints
    return Prepared(req=req, prompt_ids=prep.prompt_ids, child=child, cache_boundaries=boundaries)


def count_tokens(body: bytes, ctx: ModelContext) -> dict:
    """{"input_tokens": N}: the whole prepared prompt, i.e. input_tokens + cache_read_input_tokens."""
    try:
        _, neutral, _ = decode(body, ctx)
        prompt = render(ctx, neutral)
    except InvalidRequest as e:
        raise from_invalid(e) from None
    return {"input_tokens": len(prompt.token_ids)}


def check_version(headers: dict[str, str]) -> None:
    """anthropic-version: 2023-06-01 or any later date of the same YYYY-MM-DD form (the official SDKs send their
    own newer date); each is served with 2023-06-01 semantics. Missing, malformed or earlier: 400."""
    version = headers.get("anthropic-version")
    if version is None:
        raise bad_request(f"the anthropic-version header is missing; use {ANTHROPIC_VERSION} or later")
    if not _is_supported_version(version.strip()):
        raise bad_request(f"the anthropic-version header {version!r} is not supported; use {ANTHROPIC_VERSION} "
                          "or a later YYYY-MM-DD date")


def _is_supported_version(version: str) -> bool:
    if not _VERSION_DATE.fullmatch(version):
        return False
    try:
        date = datetime.date.fromisoformat(version)
    except ValueError:  # 2024-02-30: the form, not a date
        return False
    return date >= datetime.date.fromisoformat(ANTHROPIC_VERSION)


# --- encode -------------------------------------------------------------------------------------------------


def _message_id(prep: Prepared) -> str:
    return prep.child.req_id.rsplit("-", 1)[0]


def _usage(prep: Prepared, final: bool) -> dict:
    u = child_usage(prep.child if final else None, len(prep.prompt_ids))
    # NOTE: cache_read + input = the whole prompt (the count_tokens result); cache writes are not measured
    return {"input_tokens": u.num_prompt - u.num_cached, "output_tokens": u.num_generated,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.num_cached}


def _stop(prep: Prepared, acc: ChoiceOutput) -> tuple[str, str | None]:
    reason = finish_reason(prep.child, "messages", acc.num_tool_calls)
    return reason, prep.child.stop_reason if reason == "stop_sequence" else None


def _block_json(block: OutputBlock, full: bool) -> dict:
    """A content block: complete (buffered) or as content_block_start announces it (empty)."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if full else "",
                "signature": thinking_signature(block.text) if full else ""}
    if block.kind == "tool_call":
        return {"type": "tool_use", "id": block.call_id, "name": block.name,
                "input": json.loads(block.text or "{}") if full else {}}
    return {"type": "text", "text": block.text if full else ""}


def _message(runtime: Runtime, prep: Prepared, content: list, stop: tuple[str | None, str | None], final: bool):
    return {"id": _message_id(prep), "type": "message", "role": "assistant", "model": runtime.serving.model_id,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": _usage(prep, final)}


async def buffered(runtime: Runtime, prep: Prepared, gen: Generation) -> dict:
    acc = await parsed_output(gen, prep.child)
    return _message(runtime, prep, [_block_json(b, True) for b in acc.blocks], _stop(prep, acc), True)


def _event(name: str, body: dict) -> bytes:
    return sse_named(name, msgspec.json.encode({"type": name, **body}))


def _block_events(ev: BlockEvent) -> list[bytes]:
    if ev.kind == "start":
        return [_event("content_block_start", {"index": ev.index, "content_block": _block_json(ev.block, False)})]
    if ev.kind == "stop":
        out = []
        if ev.block.kind == "reasoning":
            out.append(_event("content_block_delta", {"index": ev.index, "delta": {
                "type": "signature_delta", "signature": thinking_signature(ev.block.text)}}))
        return out + [_event("content_block_stop", {"index": ev.index})]
    if not ev.text:
        return []
    kind = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking"),
            "tool_call": ("input_json_delta", "partial_json")}[ev.block.kind]
    return [_event("content_block_delta", {"index": ev.index, "delta": {"type": kind[0], kind[1]: ev.text}})]


def error_event(err: ApiError) -> bytes:
    return sse_named("error", err.encode_anthropic())


async def stream_events(runtime: Runtime, prep: Prepared, gen: Generation):
    """Named SSE events. message_start waits for the first generated token (as Chat's role chunk does),
    reporting the whole prompt as input with zero cache reads; message_delta carries the final usage."""
    acc = ChoiceOutput(prep.child.output_spec)
    started = False
    async for child, delta in gen.deltas():
        if (err := failure(child)) is not None:
            yield error_event(err)
            return
        if not started and (child.has_started or delta.finished):
            started = True
            yield _event("message_start", {"message": _message(runtime, prep, [], (None, None), False)})
            yield _event("ping", {})
        for ev in acc.add(delta):
            for frame in _block_events(ev):
                yield frame
        if (err := output_failure(acc)) is not None:
            yield error_event(err)
            return
        if delta.finished:
            for ev in acc.close():
                for frame in _block_events(ev):
                    yield frame
            reason, sequence = _stop(prep, acc)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": _usage(prep, True)})
            yield _event("message_stop", {})
            return
