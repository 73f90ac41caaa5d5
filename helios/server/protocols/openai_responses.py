"""POST /v1/responses, stateless: the OpenAI Responses protocol (buffered response object and named SSE).

decode (input items and instructions into frontend's neutral GenerationRequest: ChatMessages, SamplingFields,
ToolPlan, OutputFormat) -> helios.frontend.prepare -> encode (the ordered output blocks of helios.output as output
items with stable ids, buffered or as the SSE lifecycle). Stored state is not
kept: store: true, previous_response_id, conversation, background and automatic truncation are rejected.
No torch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from helios.frontend.chat import ChatMessage, join_text_blocks, tool_call
from helios.frontend.effort import effort_template_kwargs, named_effort
from helios.frontend.prepare import Conversation, GenerationRequest, prepare as prepare_request
from helios.frontend.reasoning import check_thinking_token_budget
from helios.frontend import structured
from helios.frontend.context import ModelContext
from helios.frontend.sampling import InvalidRequest, SamplingRequest, sampling_fields, stop_strings
from helios.frontend.tools import DeclaredTool, ToolPlan, custom_tool, function_tool, namespaced, plan_tools
from helios.output.accumulator import BlockEvent, OutputBlock
from helios.output.choice import ChoiceOutput
from helios.output.custom_tools import INPUT, custom_input
from helios.server.errors import ApiError, bad_request, decode_body, from_invalid
from helios.server.generation import (Child, Generation, OneChoice, child_usage, encode_token_entry, failure,
                                      finish_reason, output_failure, parsed_output)
from helios.server.http import sse_named
from helios.server.runtime import Runtime

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INPUT_TEXT = ("input_text", "text")
_OUTPUT_TEXT = ("output_text", "refusal", "text")
_PARAMS = {"messages": "input"}  # the frontend names Chat's conversation field


class Part(Struct, kw_only=True):
    type: str
    text: str | None = None
    refusal: str | None = None


class Item(Struct, kw_only=True):
    """One input item; `type` defaults to message (the easy {"role", "content"} form)."""

    type: str = "message"
    id: str | None = None
    role: str | None = None
    content: str | list[Part] | None = None
    status: str | None = None
    call_id: str | None = None  # function_call / function_call_output / custom_tool_call(_output)
    name: str | None = None
    namespace: str | None = None  # a call to a tool declared in a namespace
    arguments: str | None = None
    input: str | None = None  # custom_tool_call
    output: str | list[Part] | None = None
    summary: list[Part] | None = None  # reasoning
    encrypted_content: str | None = None


class ResponsesRequest(SamplingRequest, kw_only=True):
    """Responses' body; the shared sampling fields (top_k, seed, min_p, penalties, token stops, ignore_eos
    are native extensions here) come from SamplingRequest."""

    input: str | list[Item]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: dict | None = None
    text: dict | None = None
    metadata: dict | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict | None = None
    # native extensions
    stop: str | list[str] | None = None
    logprob_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool = False
    thinking_token_budget: int | None = None
    prompt_logprobs: Any | UnsetType = UNSET  # rejected: Responses has no prompt scoring


class Prepared(OneChoice, kw_only=True):
    req: ResponsesRequest
    plan: ToolPlan  # restores namespaces and custom tools on output items
    response_id: str
    created_at: int

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.req.include or [])


# --- decode -------------------------------------------------------------------------------------------------


def _parts_text(content: str | list[Part] | None, allowed: tuple[str, ...], where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for p in content:
        if p.type in allowed:
            texts.append(p.text if p.text is not None else p.refusal or "")
        elif p.type == "input_image":
            raise bad_request("this core is text-only: input_image needs a vision core", "input")
        else:
            raise bad_request(f"unsupported content part type {p.type!r} in {where}", "input")
    return join_text_blocks(texts)


def to_conversation(req: ResponsesRequest) -> list[ChatMessage]:
    """Instructions and input items -> neutral ChatMessages (function calls join their assistant turn)."""
    out: list[ChatMessage] = []
    if req.instructions:
        out.append(ChatMessage(role="system", content=req.instructions))
    items = [Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    reasoning: list[str] = []  # readable reasoning items wait for the assistant turn they precede
    for item in items:
        if item.type == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"unsupported message role {item.role!r}", "input")
            if item.role == "assistant":
                out.append(ChatMessage(role="assistant", content=_parts_text(item.content, _OUTPUT_TEXT, "assistant"),
                                       reasoning=join_text_blocks(reasoning) if reasoning else None))
                reasoning = []
            else:
                out.append(ChatMessage(role=item.role, content=_parts_text(item.content, _INPUT_TEXT, item.role)))
        elif item.type in ("function_call", "custom_tool_call"):
            if not item.call_id or not item.name:
                raise bad_request(f"{item.type} items need a call_id and a name", "input")
            # NOTE: the template sees what the model saw: namespace__name, a custom input as {"input": text}
            name = DeclaredTool(item.name, namespace=item.namespace).presented
            arguments = (item.arguments or "{}" if item.type == "function_call"
                         else msgspec.json.encode({INPUT: item.input or ""}).decode())
            call = tool_call(item.call_id, name, arguments)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and not reasoning:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call],
                                       reasoning=join_text_blocks(reasoning) if reasoning else None))
                reasoning = []
        elif item.type in ("function_call_output", "custom_tool_call_output"):
            if not item.call_id:
                raise bad_request(f"{item.type} items need a call_id", "input")
            out.append(ChatMessage(role="tool", content=_parts_text(item.output, _INPUT_TEXT, item.type),
                                   tool_call_id=item.call_id))
        elif item.type == "reasoning":
            text = _parts_text(item.content, ("reasoning_text",), "reasoning") if item.content else ""
            if not text and item.encrypted_content:
                raise bad_request("opaque encrypted-only reasoning cannot be replayed; send readable reasoning_text",
                                  "input")
            if text:
                reasoning.append(text)
        else:
            raise bad_request(f"unsupported input item type {item.type!r} (stateless Responses)", "input")
    return out


def _check_request(req: ResponsesRequest, ctx: ModelContext) -> None:
    if req.store:
        raise bad_request("store: true is not supported; Responses are stateless here", "store")
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported; send the whole conversation", "previous_response_id")
    if req.conversation is not None:
        raise bad_request("conversation is not supported; send the whole conversation", "conversation")
    if req.background:
        raise bad_request("background execution is not supported", "background")
    if req.truncation not in (None, "disabled"):
        raise bad_request("automatic truncation is not supported; use truncation: disabled", "truncation")
    if req.prompt_logprobs is not UNSET:
        raise bad_request("prompt_logprobs is not supported on /v1/responses", "prompt_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request("top_logprobs must be in [0, 20]", "top_logprobs")
    if req.text is not None and not isinstance(req.text, dict):
        raise bad_request("text must be an object", "text")
    check_thinking_token_budget(ctx, req.thinking_token_budget)
    if isinstance(req.input, list) and not req.input:
        raise bad_request("input must be a string or a nonempty array of items", "input")


def _tool_plan(req: ResponsesRequest, ctx: ModelContext) -> ToolPlan:
    """Responses' spelling: tools [{"type": "function", name, description, parameters, strict} | {"type":
    "custom", name, description, format} | {"type": "namespace", name, description, tools: [function |
    custom]}]; tool_choice "auto" | "none" | "required" | {"type": "function" | "custom", "name": N} (a
    namespaced tool is named namespace__name); parallel_tool_calls."""
    tools, declared = [], []
    for t in req.tools or []:
        for tool, origin in _declare(t, None):
            tools.append(tool)
            declared.append(origin)
    choice, named, named_kind = req.tool_choice, None, None
    if choice is None:
        mode = "auto"
    elif choice in ("auto", "none", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        mode, named, named_kind = "named", choice.get("name"), choice["type"]
    else:
        raise bad_request("tool_choice must be \"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\" | \"custom\", \"name\": ...}", "tool_choice")
    return plan_tools(ctx, tools, mode, named, req.parallel_tool_calls is not False, declared=declared,
                      named_kind=named_kind)


def _declare(t: Any, namespace: dict | None) -> list[tuple[dict, DeclaredTool]]:
    """One declared tool -> (presented function, declaration) pairs; a namespace yields its members."""
    kind = t.get("type") if isinstance(t, dict) else None
    ns_name, ns_description = (namespace["name"], namespace.get("description")) if namespace else (None, None)
    if kind == "function":
        tool = function_tool(t.get("name"), t.get("description"), t.get("parameters"), t.get("strict"), "tools")
        return [namespaced(tool, ns_name, ns_description)] if namespace else [(tool, DeclaredTool(t["name"]))]
    if kind == "custom":
        return [custom_tool(t.get("name"), t.get("description"), t.get("format"), "tools", ns_name, ns_description)]
    if kind == "namespace" and namespace is None:
        if not isinstance(t.get("name"), str) or not t["name"] or not isinstance(t.get("tools"), list):
            raise bad_request("a namespace tool needs a nonempty name and a tools array", "tools")
        if t.get("description") is not None and not isinstance(t["description"], str):
            raise bad_request(f"the description of namespace {t['name']!r} must be a string", "tools")
        return [pair for member in t["tools"] for pair in _declare(member, t)]
    where = f" inside namespace {ns_name!r}" if namespace else ""
    raise bad_request(f"unsupported tool type {kind!r}{where}; function, custom and namespace tools are supported",
                      "tools")


def decode(body: bytes, ctx: ModelContext) -> tuple[ResponsesRequest, GenerationRequest]:
    """The body -> the neutral request (Responses' own checks and spellings on the way)."""
    req = decode_body(body, ResponsesRequest)
    _check_request(req, ctx)
    plan = _tool_plan(req, ctx)
    messages = to_conversation(req)
    fmt = structured.responses_text_format((req.text or {}).get("format"))
    effort = named_effort((req.reasoning or {}).get("effort"), "reasoning", "reasoning.effort")
    conversation = Conversation(messages, template_kwargs=effort_template_kwargs(None, effort, ctx.manifest.recipe))
    wants = LOGPROBS_INCLUDE in (req.include or [])
    fields = sampling_fields(req, stop=stop_strings(req.stop), logprobs=(req.top_logprobs or 0) if wants else None,
                             logprob_token_ids=req.logprob_token_ids)
    return req, GenerationRequest(conversation, fields, req.max_output_tokens, max_tokens_param="max_output_tokens",
                                  plan=plan, fmt=fmt, thinking_budget=req.thinking_token_budget)


def prepare(body: bytes, ctx: ModelContext) -> Prepared:
    hex_id = uuid.uuid4().hex
    try:
        req, neutral = decode(body, ctx)
        prep = prepare_request(ctx, neutral, f"resp_{hex_id}")
    except InvalidRequest as e:
        e.param = _PARAMS.get(e.param, e.param)
        raise from_invalid(e) from None
    return Prepared(req=req, prompt_ids=prep.prompt_ids, child=Child.of(prep.choices[0]), plan=neutral.plan,
                    response_id=f"resp_{hex_id}", created_at=int(time.time()))


# --- encode -------------------------------------------------------------------------------------------------


class _Items:
    """Stable item ids by block index, shared by the buffered and streamed encodings."""

    PREFIX = {"text": "msg", "reasoning": "rs", "tool_call": "fc", "custom": "ctc"}

    def __init__(self, response_id: str, plan: ToolPlan):
        self._base = response_id.removeprefix("resp_")
        self._ids: dict[int, str] = {}
        self.plan = plan

    def kind(self, block: OutputBlock) -> str:
        """The block's kind, a call to a custom tool apart."""
        custom = block.kind == "tool_call" and self.plan.origin(block.name or "").kind == "custom"
        return "custom" if custom else block.kind

    def id(self, index: int, block: OutputBlock) -> str:
        if index not in self._ids:
            self._ids[index] = f"{self.PREFIX[self.kind(block)]}_{self._base[:20]}{index:04d}"
        return self._ids[index]


def _logprobs(ctx: ModelContext, prep: Prepared, entries) -> list[dict]:
    if not prep.wants_logprobs:
        return []
    return [encode_token_entry(ctx, e, prep.req.return_tokens_as_token_ids) for e in entries]


def _part(ctx: ModelContext, prep: Prepared, block: OutputBlock, full: bool) -> dict:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": block.text if full else ""}
    return {"type": "output_text", "text": block.text if full else "", "annotations": [],
            "logprobs": _logprobs(ctx, prep, block.entries) if full else []}


def _item(ctx: ModelContext, prep: Prepared, items: _Items, index: int, block: OutputBlock, status: str) -> dict:
    """An output item: in progress (as output_item.added announces it) or finished with its content."""
    item_id, done = items.id(index, block), status != "in_progress"
    if block.kind == "tool_call":
        origin = items.plan.origin(block.name or "")  # NOTE: namespace__name regains its namespace here
        if origin.kind == "custom":
            item = {"type": "custom_tool_call", "id": item_id, "call_id": block.call_id, "name": origin.name,
                    "input": custom_input(block.text) if done else "", "status": status}
        else:
            item = {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": origin.name,
                    "arguments": block.text if done else "", "status": status}
        if origin.namespace is not None:
            item["namespace"] = origin.namespace
        return item
    content = [_part(ctx, prep, block, True)] if done else []
    if block.kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _usage(prep: Prepared, num_reasoning: int = 0) -> dict:
    u = child_usage(prep.child, len(prep.prompt_ids), num_reasoning)
    return {"input_tokens": u.num_prompt, "input_tokens_details": {"cached_tokens": u.num_cached},
            "output_tokens": u.num_generated, "output_tokens_details": {"reasoning_tokens": u.num_reasoning},
            "total_tokens": u.num_prompt + u.num_generated}


def _response(runtime: Runtime, prep: Prepared, status: str, output: list[dict], error: dict | None = None,
              num_reasoning: int = 0) -> dict:
    req, sampling = prep.req, prep.child.request.sampling
    return {
        "id": prep.response_id, "object": "response", "created_at": prep.created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": runtime.serving.model_id, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": False, "temperature": sampling.temperature,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
        "top_logprobs": req.top_logprobs or 0, "top_p": sampling.top_p, "truncation": "disabled",
        "usage": _usage(prep, num_reasoning) if status in ("completed", "incomplete") else None,
        "user": req.user, "metadata": req.metadata or {},
    }


def _status(prep: Prepared, acc: ChoiceOutput) -> str:
    return finish_reason(prep.child, "responses", acc.num_tool_calls)  # completed | incomplete


async def buffered(runtime: Runtime, prep: Prepared, gen: Generation) -> dict:
    acc = await parsed_output(gen, prep.child)
    status, items = _status(prep, acc), _Items(prep.response_id, prep.plan)
    output = [_item(runtime.model, prep, items, i, b, status) for i, b in enumerate(acc.blocks)]
    return _response(runtime, prep, status, output, num_reasoning=acc.num_reasoning_tokens)


class _Stream:
    """The SSE lifecycle with one increasing sequence_number across every event."""

    def __init__(self, runtime: Runtime, prep: Prepared):
        self.runtime, self.prep = runtime, prep
        self.items = _Items(prep.response_id, prep.plan)
        self.seq = 0

    def event(self, name: str, body: dict) -> bytes:
        frame = sse_named(name, msgspec.json.encode({"type": name, "sequence_number": self.seq, **body}))
        self.seq += 1
        return frame

    def _item_event(self, name: str, ev: BlockEvent, status: str) -> bytes:
        item = _item(self.runtime.model, self.prep, self.items, ev.index, ev.block, status)
        return self.event(name, {"output_index": ev.index, "item": item})

    def block(self, ev: BlockEvent, status: str = "completed") -> list[bytes]:
        """The events of one block event: item added/done, content part added/done, text or argument deltas."""
        ctx, prep, b = self.runtime.model, self.prep, ev.block
        ref = {"item_id": self.items.id(ev.index, b), "output_index": ev.index}
        if ev.kind == "start":
            out = [self._item_event("response.output_item.added", ev, "in_progress")]
            if b.kind != "tool_call":
                out.append(self.event("response.content_part.added",
                                      {**ref, "content_index": 0, "part": _part(ctx, prep, b, False)}))
            return out
        if b.kind == "tool_call" and self.items.kind(b) == "custom":
            # NOTE: a call is published whole (one delta with all its arguments), so the delta decodes alone
            if ev.kind == "delta":
                return [self.event("response.custom_tool_call_input.delta", {**ref, "delta": custom_input(ev.text)})]
            return [self.event("response.custom_tool_call_input.done", {**ref, "input": custom_input(b.text)}),
                    self._item_event("response.output_item.done", ev, status)]
        if b.kind == "tool_call":
            if ev.kind == "delta":
                return [self.event("response.function_call_arguments.delta", {**ref, "delta": ev.text})]
            return [self.event("response.function_call_arguments.done", {**ref, "arguments": b.text}),
                    self._item_event("response.output_item.done", ev, status)]
        ref["content_index"] = 0
        name = "reasoning_text" if b.kind == "reasoning" else "output_text"
        if ev.kind == "delta":
            if not ev.text:
                return []
            body = {**ref, "delta": ev.text}
            if b.kind == "text":
                body["logprobs"] = _logprobs(ctx, prep, ev.entries)
            return [self.event(f"response.{name}.delta", body)]
        done = {**ref, "text": b.text}
        if b.kind == "text":
            done["logprobs"] = _logprobs(ctx, prep, b.entries)
        return [self.event(f"response.{name}.done", done),
                self.event("response.content_part.done", {**ref, "part": _part(ctx, prep, b, True)}),
                self._item_event("response.output_item.done", ev, status)]


async def stream_events(runtime: Runtime, prep: Prepared, gen: Generation):
    """response.created and response.in_progress go out at once; output events follow the blocks; the
    stream ends in response.completed, response.incomplete (output limit) or response.failed. No [DONE]."""
    s = _Stream(runtime, prep)
    acc = ChoiceOutput(prep.child.output_spec)
    yield s.event("response.created", {"response": _response(runtime, prep, "in_progress", [])})
    yield s.event("response.in_progress", {"response": _response(runtime, prep, "in_progress", [])})
    async for child, delta in gen.deltas():
        if (err := failure(child)) is not None:
            yield failed_event(s, runtime, prep, acc, err)
            return
        for ev in acc.add(delta):
            for frame in s.block(ev):
                yield frame
        if (err := output_failure(acc)) is not None:
            yield failed_event(s, runtime, prep, acc, err)
            return
        if delta.finished:
            status = _status(prep, acc)
            for ev in acc.close():
                for frame in s.block(ev, status):
                    yield frame
            output = [_item(runtime.model, prep, s.items, i, b, status) for i, b in enumerate(acc.blocks)]
            yield s.event(f"response.{status}", {"response": _response(runtime, prep, status, output,
                                                                          num_reasoning=acc.num_reasoning_tokens)})
            return


def failed_event(s: _Stream, runtime: Runtime, prep: Prepared, acc: ChoiceOutput,
                 err: ApiError) -> bytes:
    output = [_item(runtime.model, prep, s.items, i, b, "incomplete") for i, b in enumerate(acc.blocks)]
    error = {"code": "server_error", "message": err.message}
    return s.event("response.failed", {"response": _response(runtime, prep, "failed", output, error)})
