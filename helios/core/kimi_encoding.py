"""Kimi K3's native prompt encoder: K3 ships its chat format ("XTML") as a Python script, not a Jinja template.

Owns the XTML literals (control tokens, element tags, attribute escaping: helios/output/parsers/xtml.py parses with
the same ones) and the prompt text behind ChatTemplate's interface (`render`, `kwargs`, `reads_field`), so
ignition probes it and the frontend renders with it as with a Jinja template or the DeepSeek encoders. Refusals are
EncoderRefusal (a TemplateError naming the request field). Imports helios.core.deepseek_encoding (EncoderRefusal)
only; no torch.

Sources (facts only; the code is ours). The reference is the checkpoint's `encoding_k3.py` (moonshotai/Kimi-K3,
rev f831ab6), which we could not read itself; its rules come from public descriptions and ports of it that agree:
a format survey quoting a render of `encoding_k3.build_chat_segments` (element order, the generation prompt, typed
arguments, 1-based call indices, the json fallback, `&amp;`/`&quot;` escaping, the special tokens and
`<|end_of_msg|>` as generation_config's EOS); NVIDIA Dynamo's Rust port (KimiK3Formatter: the tool-declare and
thinking-effort system messages verbatim, system/user `name` attributes, tool results as role="tool" tool="NAME"
index="N" with the name from the matching call, the empty think channel, effort values low/high/max, default max);
a Python RL renderer port (the same bodies, sorted compact tool JSON, `json.dumps` default separators for
non-string values); sglang's KimiK3Detector and rtp-llm's KimiK3Renderer (the output side). Where they disagree:
- Generation prompt: the survey, the RL port and rtp-llm's renderer say encoding_k3.py ends it with
  `<|open|>think<|sep|>` (thinking) -- we follow that; Dynamo omits the channel opener because Moonshot's hosted API
  counts 3 fewer prompt tokens. The output parser accepts both (a think opener in reasoning is consumed).
- Attribute escaping: `&amp;`/`&quot;` (survey, Dynamo, sglang, rtp-llm); one port escapes `"` as `\\"`.
- Whitespace-only history reasoning renders an empty think channel (Dynamo); unverified against the script.
Unverified against the script as well: history argument elements in the order the call's arguments give them, and
a tool result's index counting the results since the last assistant turn (both ports do so).
The spec overrides the script in one place: K3 always thinks. thinking / enable_thinking are ignored without an
error (the script would drop the think channel and the effort message), history reasoning is always kept, and the
generation prompt always opens think. Effort is `reasoning_effort` (what helios' frontend passes, resolved to the
recipe's low/high/max) or K3's own `thinking_effort` kwarg, which wins; default max.
Not rendered (helios sends none, or handles it elsewhere): images, Kimi's partial mode (continue_final_message is
refused), tools declared on a system message, the tool_choice / response_format system messages (the frontend adds
its own instructions). NOTE: the script encodes message text with specials disallowed, so a user writing
`<|open|>` stays text; helios tokenizes the whole rendered text as it does for Jinja templates, so such text
becomes the control token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from helios.core.deepseek_encoding import EncoderRefusal

KIND = "kimi_k3"
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
CONTROL_TOKENS = (END_OF_MSG, OPEN, CLOSE, SEP)  # the released tokenizer's ids 163586..163589
EFFORT_KWARG, NATIVE_EFFORT_KWARG = "reasoning_effort", "thinking_effort"
EFFORT_LEVELS = ("low", "high", "max")
DEFAULT_EFFORT = "max"

TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
# NOTE: the script's text names `medium`, which it does not accept; reproduced as written
THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                   "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                   "Now the system is invoked with `thinking_effort={}`.")


def escape_attr(value: Any) -> str:
    """& first, so an escaped quote is not escaped twice."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(name: str, attrs: tuple[tuple[str, Any], ...] = ()) -> str:
    return OPEN + name + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs) + SEP


def close_tag(name: str) -> str:
    return CLOSE + name + SEP


THINK_OPEN, THINK_CLOSE = open_tag("think"), close_tag("think")
RESPONSE_OPEN, RESPONSE_CLOSE = open_tag("response"), close_tag("response")
TOOLS_OPEN, TOOLS_CLOSE = open_tag("tools"), close_tag("tools")
MESSAGE_CLOSE = close_tag("message")
CALL_OPEN, CALL_CLOSE = OPEN + "call", close_tag("call")
ARGUMENT_CLOSE, JSON_CLOSE = close_tag("argument"), close_tag("json")
GENERATION_PROMPT = open_tag("message", (("role", "assistant"),)) + THINK_OPEN


def message(attrs: tuple[tuple[str, Any], ...], body: str) -> str:
    """One whole message: <|open|>message attrs<|sep|>body<|close|>message<|sep|><|end_of_msg|>."""
    return open_tag("message", attrs) + body + MESSAGE_CLOSE + END_OF_MSG


def xtml_type(value: Any) -> str:
    """The `type` attribute of an argument value (bool before number: a bool is an int in Python)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, Mapping) else "array"


def xtml_value(value: Any) -> str:
    """A string verbatim; anything else as the script's json.dumps (default separators, non-ASCII kept)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class KimiK3Encoding:
    """Kimi K3's XTML prompt format."""

    kind = KIND
    bos_token, eos_token = None, END_OF_MSG
    reasoning_delimiters = (THINK_OPEN, THINK_CLOSE)
    # structured output (helios/frontend/structured.py): the answer is the response channel's text, so the grammar
    # starts after its opener; the channel's `<|close|>` as the answer's first token (an empty response, the tools
    # channel next) releases the grammar when tools are parsed
    answer_open, answer_release = RESPONSE_OPEN, CLOSE

    @property
    def kwargs(self) -> list[str]:
        """The chat_template_kwargs the encoder reads (none switches thinking off: K3 always thinks)."""
        return sorted((EFFORT_KWARG, NATIVE_EFFORT_KWARG))

    def reads_field(self, name: str) -> bool:
        return False  # a failed tool result travels as text

    def render(self, messages: list[Mapping[str, Any]], tools: list[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool | str = False,
               documents: list[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text of a conversation (plain message dicts, the frontend's lowered shape)."""
        if continue_final_message:
            raise EncoderRefusal("the native Kimi K3 encoder does not continue an assistant message",
                                 "continue_final_message")
        if documents:
            raise EncoderRefusal("the native Kimi K3 encoder takes no documents")
        if not messages:
            raise EncoderRefusal("messages must be a nonempty array")
        effort = self.effort(kwargs)
        text = message((("role", "system"), ("type", "tool-declare")), self.tools_json(tools)) if tools else ""
        text += message((("role", "system"), ("type", "thinking-effort")), THINKING_EFFORT.format(effort))
        calls: list[Mapping[str, Any]] = []  # the last assistant's calls, which tool results answer in order
        results = 0
        for m in messages:
            role = m.get("role")
            if role == "assistant":
                calls, results = _calls(m), 0
                text += message(_named("assistant", m), self.assistant_body(m))
            elif role == "tool":
                results += 1
                text += message((("role", "tool"), ("tool", _result_name(m, calls, results)), ("index", results)),
                                _text(m.get("content")))
            elif role in ("system", "developer", "user"):
                text += message(_named("user" if role == "user" else "system", m), _text(m.get("content")))
            else:
                raise EncoderRefusal(f"the native Kimi K3 encoder has no role {role!r}")
        return text + (GENERATION_PROMPT if add_generation_prompt else "")

    def effort(self, kwargs: Mapping[str, Any]) -> str:
        """K3's thinking_effort when given, else reasoning_effort, else max; each one of low/high/max."""
        key = NATIVE_EFFORT_KWARG if kwargs.get(NATIVE_EFFORT_KWARG) is not None else EFFORT_KWARG
        value = kwargs.get(key)
        if value is None:
            return DEFAULT_EFFORT
        if not isinstance(value, str) or value not in EFFORT_LEVELS:
            raise EncoderRefusal(f"Kimi K3 accepts {key} {', '.join(EFFORT_LEVELS)}; got {value!r}",
                                 "reasoning_effort" if key == EFFORT_KWARG else "chat_template_kwargs")
        return value

    @staticmethod
    def tools_json(tools: list[Mapping[str, Any]]) -> str:
        """The tool-declare body: the tools as given, compact JSON with sorted keys."""
        return TOOL_DECLARE.format(json.dumps(tools, separators=(",", ":"), ensure_ascii=False, sort_keys=True))

    def assistant_body(self, m: Mapping[str, Any]) -> str:
        """think (always, reasoning kept), response, then the tools channel when the turn called tools."""
        reasoning = _text(m.get("reasoning_content") or m.get("reasoning"))
        body = THINK_OPEN + (reasoning if reasoning.strip() else "") + THINK_CLOSE
        body += RESPONSE_OPEN + _text(m.get("content")) + RESPONSE_CLOSE
        calls = _calls(m)
        return body + (TOOLS_OPEN + "".join(self.call(c, i) for i, c in enumerate(calls, 1)) + TOOLS_CLOSE
                       if calls else "")

    @staticmethod
    def call(call: Mapping[str, Any], index: int) -> str:
        """One history call: typed argument elements, or a json element when the arguments are no JSON object."""
        fn = _function(call)
        args = _arguments(fn.get("arguments"))
        if isinstance(args, str):
            body = open_tag("json", (("type", "object"),)) + args + JSON_CLOSE
        else:
            body = "".join(open_tag("argument", (("key", k), ("type", xtml_type(v)))) + xtml_value(v) + ARGUMENT_CLOSE
                           for k, v in args.items())
        return open_tag("call", (("tool", fn.get("name") or ""), ("index", index))) + body + CALL_CLOSE


def _named(role: str, m: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    name = m.get("name")
    return (("role", role), ("name", name)) if isinstance(name, str) and name else (("role", role),)


def _function(call: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = call.get("function")
    return fn if isinstance(fn, Mapping) else call


def _calls(m: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [c for c in m.get("tool_calls") or [] if isinstance(c, Mapping)]


def _result_name(m: Mapping[str, Any], calls: list[Mapping[str, Any]], index: int) -> str:
    """A tool result's tool: its own name, else the call its id answers, else the call at its position."""
    if isinstance(m.get("name"), str) and m["name"]:
        return m["name"]
    by_id = [c for c in calls if c.get("id") is not None and c.get("id") == m.get("tool_call_id")]
    call = by_id[0] if by_id else calls[index - 1] if index <= len(calls) else None
    name = _function(call).get("name") if call is not None else None
    if not isinstance(name, str) or not name:
        raise EncoderRefusal("a Kimi K3 tool result needs a name or a preceding assistant tool call it answers")
    return name


def _arguments(raw: Any) -> Mapping[str, Any] | str:
    """A call's arguments as an object, or the text the json element holds (any text that is no JSON object)."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, Mapping):
        return raw
    if not isinstance(raw, str):
        return json.dumps(raw, ensure_ascii=False)
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def _text(value: Any) -> str:
    """A message field as text: None is empty; text blocks (Anthropic shape) concatenate, as the script's parts."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "".join(b.get("text", "") if isinstance(b, Mapping) else str(b) for b in value)
    return str(value)
