"""Conversation -> prompt text (the core's prepared chat template) -> prompt token ids.

Owns the neutral chat message type and the lowering rules of the spec's "Conversation and tool semantics":
developer instructions merge with system text into one leading system message; a later system message
becomes a user message wrapped in <system>...</system> when the template cannot render it inline.
Replayed tool calls reach the template with JSON-object arguments as objects (transformers' shape), a tool error
as the template's own `is_error` field when it reads one, else as a visible "Error: " prefix; a leading
Claude Code attribution line is dropped (see `drop_attribution`). Rendering goes through
helios.core.chat_template (sandboxed Jinja), or the native encoder a core's template kind names
(helios.core.native_encoding: DeepSeek V4 / V4.1, Kimi K3; they refuse add_generation_prompt=false on requests).
No torch.
"""

from __future__ import annotations

import json
import re
from typing import Any

from msgspec import Struct

from helios.core.chat_template import RENDER_VARIABLES, ChatTemplate, TemplateError
from helios.core.manifest import TemplateCaps
from helios.core.native_encoding import native_encoder
from helios.frontend.sampling import InvalidRequest
from helios.frontend.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_BLOCK_SEPARATOR = "\n\n"  # text blocks of one message (Messages, Responses) join with blank lines
ERROR_PREFIX = "Error: "  # a failed tool result's text, for templates without an error field of their own
# Claude Code's first system block: "x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;" (some versions
# add a per-request "cch=..."). It is billing metadata for Anthropic's API, not an instruction to the model.
_ATTRIBUTION = re.compile(r"x-anthropic-billing-header:[^\n]*(?:\n\n|\n|$)")


def join_text_blocks(texts: list[str]) -> str:
    return TEXT_BLOCK_SEPARATOR.join(texts)


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A neutral assistant tool call in the template's (HF) message shape; arguments is the JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
_RESERVED_KWARGS = RENDER_VARIABLES | {"continue_final_message", "bos_token", "eos_token"}


class ChatMessage(Struct, kw_only=True):
    """One neutral conversation message (text only for now; images are rejected at the protocol)."""

    role: str
    content: str | None = None
    reasoning: str | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    is_error: bool = False  # a tool result that reports a failure (Messages tool_result is_error)


class ChatPrompt(Struct, frozen=True):
    text: str
    token_ids: list[int]
    token_ends: list[int] = []  # the character offset where each token ends (helios/frontend/boundaries.py)


def order_tool_results(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Parallel tool results whose unique ids match the preceding assistant's calls move into call order.

    The group is every tool message up to the next assistant message; other messages keep their positions.
    Missing, duplicate or unknown ids leave the group as supplied; results never cross an assistant message."""
    out = list(messages)
    for i, m in enumerate(messages):
        if m.role != "assistant" or not m.tool_calls:
            continue
        call_ids = [c.get("id") for c in m.tool_calls if isinstance(c, dict)]
        positions = []
        for j in range(i + 1, len(messages)):
            if messages[j].role == "assistant":
                break
            if messages[j].role == "tool":
                positions.append(j)
        ids = [messages[j].tool_call_id for j in positions]
        if len(positions) < 2 or sorted(ids, key=str) != sorted(call_ids, key=str) or len(set(ids)) != len(ids):
            continue
        rank = {cid: k for k, cid in enumerate(call_ids)}
        for j, src in zip(positions, sorted(positions, key=lambda p: rank[messages[p].tool_call_id])):
            out[j] = messages[src]
    return out


def drop_attribution(text: str) -> str:
    """System text without a leading Claude Code attribution line.

    NOTE: the line opens the prompt, so a per-request hash in it (cch=...) would make every follow-up miss the
    prefix cache on the whole conversation. It is dropped rather than moved after the reusable part: it tells the
    model nothing, and any place in the prompt still breaks reuse of what follows it."""
    match = _ATTRIBUTION.match(text)
    return text[match.end():] if match else text


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """Calls whose arguments text parses as a JSON object carry the object, as transformers-style templates
    expect (they apply tojson: a string would be encoded twice); any other arguments stay as sent."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        arguments = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return out


def lower_messages(messages: list[ChatMessage], caps: TemplateCaps, error_field: bool = False,
                   object_arguments: bool = True) -> list[dict[str, Any]]:
    """Apply the system/developer rules and produce the template's plain message dicts. error_field: the
    template reads a message's `is_error` (else a failed tool result's text gets ERROR_PREFIX);
    object_arguments: tool-call arguments that are a JSON object travel as the object."""
    if messages and messages[0].role == "system" and messages[0].content:
        messages = [ChatMessage(role="system", content=drop_attribution(messages[0].content)), *messages[1:]]
    if any(m.role not in ROLES for m in messages):
        bad = next(m.role for m in messages if m.role not in ROLES)
        raise InvalidRequest(f"unsupported message role {bad!r}", "messages")
    has_developer = any(m.role == "developer" for m in messages)
    out: list[dict[str, Any]] = []
    lead: list[str] = []
    rest = messages
    if has_developer:
        # NOTE: all system and developer instructions become one leading system message, in request order,
        # each section keeping its role label (the same textual cue as an inline system message's)
        lead = [f"<{m.role}>{m.content}</{m.role}>" for m in messages
                if m.role in ("system", "developer") and m.content]
        rest = [m for m in messages if m.role not in ("system", "developer")]
    elif messages and messages[0].role == "system":
        lead = [messages[0].content or ""]
        rest = messages[1:]
    lead_text = "\n\n".join(t for t in lead if t)
    if lead_text:
        out.append({"role": "system", "content": lead_text})
    for m in rest:
        if m.role == "system":
            text = m.content or ""
            if not text:
                continue
            if caps.inline_system:
                out.append({"role": "system", "content": text})
            else:
                out.append({"role": "user", "content": f"<system>{text}</system>"})
            continue
        content = m.content if m.content is not None else ""
        if m.is_error and not error_field:
            content = ERROR_PREFIX + content
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.is_error and error_field:
            msg["is_error"] = True
        if m.reasoning is not None:
            msg["reasoning_content"] = m.reasoning
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = template_tool_calls(m.tool_calls) if object_arguments else m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


class ChatRenderer:
    """The core's template bound to its tokenizer specials (or the native encoder its caps name); render()
    returns text and ids."""

    def __init__(self, source: str | None, caps: TemplateCaps, tokenizer: Tokenizer):
        self.caps = caps
        self.tokenizer = tokenizer
        self._template: Any = None
        if caps.kind != "jinja":
            self._template = native_encoder(caps.kind)
        elif source:
            self._template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
        self._error_field = self._template is not None and self._template.reads_field("is_error")

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[ChatMessage], **options: Any) -> ChatPrompt:
        """The prompt text (render_text, the same keyword options) and its token ids and token ends."""
        if self.caps.kind != "jinja" and not options.get("add_generation_prompt", True):
            # NOTE: the encoder renders without the header for probes and boundaries; a request may not (spec)
            raise InvalidRequest("this core's native prompt encoder requires add_generation_prompt: true",
                                 "add_generation_prompt")
        text = self.render_text(messages, **options)
        # NOTE: the rendered text already carries the template's specials (BOS included), as in HF.
        ids, ends = self.tokenizer.encode_with_ends(text)
        return ChatPrompt(text=text, token_ids=ids, token_ends=ends)

    def render_text(
        self,
        messages: list[ChatMessage],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The rendered prompt text alone (render() without the tokenization)."""
        if self._template is None:
            raise InvalidRequest("this core has no chat template; use /v1/completions", "messages")
        if not messages:
            raise InvalidRequest("messages must be a nonempty array", "messages")
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequest(
                    "continue_final_message requires add_generation_prompt: false", "continue_final_message"
                )
            if messages[-1].role != "assistant":
                raise InvalidRequest(
                    "continue_final_message requires a final assistant message", "continue_final_message"
                )
        if tools and not self.caps.tools:
            raise InvalidRequest("this model's chat template does not support tools", "tools")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_KWARGS)
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {reserved[0]!r}", "chat_template_kwargs")
        ordered = order_tool_results(messages)
        render = dict(tools=tools or None, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, **kwargs)
        try:
            text = self._template.render(lower_messages(ordered, self.caps, self._error_field), **render)
        except TemplateError as e:
            # NOTE: a template that joins arguments as text (DeepSeek V3's `+ arguments +`) fails on an object;
            # it gets the text the client sent instead
            if e.raised or not any(m.tool_calls for m in ordered):
                raise InvalidRequest(str(e), getattr(e, "param", "messages")) from None
            try:
                text = self._template.render(lower_messages(ordered, self.caps, self._error_field, False), **render)
            except TemplateError:
                raise InvalidRequest(str(e), "messages") from None
        return text
