"""DeepSeek V4 and V4.1 native prompt encoders: DeepSeek ships these chat formats as Python scripts, not Jinja.

Owns the text of both formats (BOS, role markers, thinking markers, the tool block, DSML tool calls, tool results,
history reasoning dropped, the reasoning-effort prefix) behind ChatTemplate's interface (`render`, `kwargs`,
`reads_field`), so ignition probes an encoder and the frontend renders with it as with a Jinja template. Refusals
are `EncoderRefusal` (a TemplateError naming the request field). Imports helios.core.chat_template only; no torch.

Sources (facts only; the code is ours): V4 follows the release reference `encoding/encoding_dsv4.py` as shipped
with DeepSeek-V4-Flash-Vision-Exp (the deepseek4 recipe's basis), whose effort table is low "" / high "Absolute
maximum" / max "Beyond maximum"; xhigh renders as max (vLLM's normalization of that table). V4.1 follows the release
reference `encoding_dsv41.py` (as adapted in sglang): a <｜System｜> token, spaced DSML tag names (`<｜DSML｜ calls>`,
` invoke`, ` parameter`), a numeric "Reasoning Effort: N (range 1-100, ...)" prefix, a later system message that
opens an assistant turn, tool-call arguments that must be JSON objects. NOTE: V4.1's named levels follow the spec
(low=50, high=75, xhigh=75, max=100); the reference script maps them 25/50/75/100.

Deliberate differences from the scripts: no quick-instruction tasks, latest_reminder or images (helios sends none);
tool results arrive already in call order (helios.frontend.chat.order_tool_results); V4 refuses a system message
after the first (the script glues its text to the previous turn without a marker), so the probe records no inline
system role and the frontend sends such messages as <system>-wrapped user turns; add_generation_prompt=False omits
the final assistant header (probing and internal renders only: the frontend refuses it on requests).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from helios.core.chat_template import TemplateError

NativeKind = Literal["deepseek_v4", "deepseek_v41"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"  # V4.1 only
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_RESULT = "<tool_result>{}</tool_result>"
BLOCK_SEPARATOR = "\n\n"  # between a user turn's text and tool-result blocks, and before the tools / calls blocks
THINKING_KWARGS = ("thinking", "enable_thinking")  # either switches thinking; both omitted: thinking on
EFFORT_KWARG = "reasoning_effort"
DEFAULT_EFFORT = "high"  # spec: both encoders default to thinking enabled and high effort

_V4_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_V4_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose"
    " the problem into its most fundamental components, trace every causal chain to its root, and resolve the"
    " underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain"
    " that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
V4_EFFORT_PREFIXES = {"low": "", "high": _V4_HIGH, "xhigh": _V4_MAX, "max": _V4_MAX}
V41_EFFORT_SCORES = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
V41_EFFORT_RANGE = (1, 100)
V41_EFFORT_PREFIX = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

_TOOLS_BLOCK = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{calls_open}" \
block like the following:

{calls_open}
{invoke} name="$TOOL_NAME">
{param} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{param_name}>
...
</{invoke_name}>
{invoke} name="$TOOL_NAME2">
...
</{invoke_name}>
</{calls_name}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {open}), you MUST output your complete reasoning inside {open}...{close} \
BEFORE any tool calls or final response.

Otherwise, output directly after {close} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class EncoderRefusal(TemplateError):
    """A request the native encoder does not accept; `param` names the request field (the 400's param)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message, raised=True)
        self.param = param


def to_json(value: Any) -> str:
    """The scripts' JSON: json.dumps with non-ASCII kept and default separators."""
    return json.dumps(value, ensure_ascii=False)


class DeepseekV4Encoding:
    """DeepSeek V4's format; DeepseekV41Encoding overrides the parts V4.1 changed."""

    kind: NativeKind = "deepseek_v4"
    answer_open = answer_release = ""  # the answer follows the single-token reasoning close directly
    calls_tag, invoke_tag, param_tag = "tool_calls", "invoke", "parameter"
    inline_system = False  # V4: a system message only leads
    bos_token, eos_token = BOS, EOS
    reasoning_delimiters = (THINK_OPEN, THINK_CLOSE)

    @property
    def kwargs(self) -> list[str]:
        """The chat_template_kwargs the encoder reads (what the probe records, and the scorer switches off)."""
        return sorted((*THINKING_KWARGS, EFFORT_KWARG))

    def reads_field(self, name: str) -> bool:
        return False  # no message field beyond the neutral ones (a failed tool result travels as text)

    def render(self, messages: list[Mapping[str, Any]], tools: list[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool | str = False,
               documents: list[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text of a conversation (plain message dicts, the frontend's lowered shape)."""
        if continue_final_message:
            raise EncoderRefusal("the native DeepSeek encoder does not continue an assistant message",
                                 "continue_final_message")
        if documents:
            raise EncoderRefusal("the native DeepSeek encoder takes no documents")
        thinking, effort = self.options(kwargs)
        turns = self._turns(messages, tools)
        if turns[-1]["role"] == "assistant":
            raise EncoderRefusal("the native DeepSeek encoder does not continue a final assistant message; "
                                 "end the conversation with a user or tool message")
        if not self._opens_reply(len(turns) - 1, turns[-1]):
            raise EncoderRefusal("the conversation must end with a user or tool message")
        # NOTE: the script keeps history reasoning whenever tools are declared, and otherwise drops it before the
        # last user turn (tool results count as user turns once merged)
        keep_history = thinking and bool(tools)
        last_user = max((i for i, t in enumerate(turns) if self._opens_reply(i, t)), default=-1)
        text = BOS + self._lead(turns[0], thinking, effort)
        for i, turn in enumerate(turns):
            text += self._turn(i, turn, tools if i == 0 else None, thinking and (keep_history or i > last_user))
            text += self._header(i, turns, add_generation_prompt, thinking and (keep_history or i >= last_user))
        return text

    def _header(self, index: int, turns: list[dict], add_generation_prompt: bool, open_thinking: bool) -> str:
        """The assistant header after a turn a reply follows, when an assistant turn (or the reply) comes next."""
        last = index + 1 == len(turns)
        if not self._opens_reply(index, turns[index]) or (last and not add_generation_prompt):
            return ""
        if not last and turns[index + 1]["role"] != "assistant":
            return ""
        return ASSISTANT + (THINK_OPEN if open_thinking else THINK_CLOSE)

    # --- options -----------------------------------------------------------------------------------------

    def options(self, kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
        """(thinking, effort) from the render kwargs; the encoder's own checks of their explicit values."""
        if "drop_thinking" in kwargs:
            raise EncoderRefusal("drop_thinking is not supported by the native DeepSeek encoder (history reasoning "
                                 "is dropped before the last user turn unless tools are declared, as DeepSeek's "
                                 "encoder does)", "chat_template_kwargs")
        given = {k: kwargs[k] for k in THINKING_KWARGS if kwargs.get(k) is not None}
        for key, value in given.items():
            if not isinstance(value, bool):
                raise EncoderRefusal(f"chat_template_kwargs.{key} must be true or false; got {value!r}",
                                     "chat_template_kwargs")
        if len(set(given.values())) > 1:
            raise EncoderRefusal("chat_template_kwargs.thinking and enable_thinking disagree", "chat_template_kwargs")
        thinking = next(iter(given.values()), True)
        return thinking, self.check_effort(kwargs.get(EFFORT_KWARG))

    def check_effort(self, value: Any) -> Any:
        """V4: a named level only (numeric effort is V4.1's); None selects the default."""
        if value is None:
            return DEFAULT_EFFORT
        if not isinstance(value, str) or value not in V4_EFFORT_PREFIXES:
            raise EncoderRefusal(f"DeepSeek V4 accepts reasoning_effort {', '.join(V4_EFFORT_PREFIXES)}; got "
                                 f"{value!r}", "reasoning_effort")
        return value

    def effort_prefix(self, effort: Any) -> str:
        return V4_EFFORT_PREFIXES[effort]

    # --- turns -------------------------------------------------------------------------------------------

    def _turns(self, messages: list[Mapping[str, Any]], tools: list[Mapping[str, Any]] | None) -> list[dict]:
        """Messages as the script's turns: tool results merged into user turns (consecutive user and tool
        messages become one turn of blocks), the tools on a leading system turn (an empty one when none leads)."""
        if not messages:
            raise EncoderRefusal("messages must be a nonempty array")
        turns: list[dict] = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role in ("user", "tool"):
                block = TOOL_RESULT.format(_text(m.get("content"))) if role == "tool" else _text(m.get("content"))
                if turns and turns[-1]["role"] == "user":
                    turns[-1]["blocks"].append(block)
                else:
                    turns.append({"role": "user", "blocks": [block]})
            elif role == "system":
                if i > 0 and not self.inline_system:
                    raise EncoderRefusal("DeepSeek V4 has no marker for a system message after the first")
                turns.append({"role": "system", "content": _text(m.get("content"))})
            elif role == "assistant":
                turns.append(dict(m))
            else:
                raise EncoderRefusal(f"the native DeepSeek encoder has no role {role!r}")
        if tools and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": ""})
        return turns

    def _opens_reply(self, index: int, turn: Mapping[str, Any]) -> bool:
        """A turn an assistant reply follows (the script's 'user' positions)."""
        return turn["role"] == "user"

    def _lead(self, turn: Mapping[str, Any], thinking: bool, effort: Any) -> str:
        """What precedes the first turn: the effort prefix in thinking mode."""
        return self.effort_prefix(effort) if thinking else ""

    def _turn(self, index: int, turn: Mapping[str, Any], tools: list[Mapping[str, Any]] | None,
              with_reasoning: bool) -> str:
        role = turn["role"]
        if role == "system":
            return self._system_marker(index) + turn["content"] + (BLOCK_SEPARATOR + self.tools_block(tools)
                                                                   if tools else "")
        if role == "user":
            return USER + BLOCK_SEPARATOR.join(turn["blocks"])
        reasoning = _text(turn.get("reasoning_content")) + THINK_CLOSE if with_reasoning else ""
        calls = turn.get("tool_calls") or []
        block = BLOCK_SEPARATOR + self.calls_block(calls) if calls else ""
        return reasoning + _text(turn.get("content")) + block + EOS

    def _system_marker(self, index: int) -> str:
        return ""

    # --- DSML --------------------------------------------------------------------------------------------

    def _tag(self, name: str) -> str:
        return f"{DSML}{name}"

    def tools_block(self, tools: list[Mapping[str, Any]]) -> str:
        """The tool instructions and schemas appended to the leading system turn."""
        schemas = "\n".join(to_json(t["function"] if "function" in t else t) for t in tools)
        return _TOOLS_BLOCK.format(
            calls_open=f"<{self._tag(self.calls_tag)}>", calls_name=self._tag(self.calls_tag),
            invoke=f"<{self._tag(self.invoke_tag)}", invoke_name=self._tag(self.invoke_tag),
            param=f"<{self._tag(self.param_tag)}", param_name=self._tag(self.param_tag),
            open=THINK_OPEN, close=THINK_CLOSE, schemas=schemas)

    def calls_block(self, calls: list[Mapping[str, Any]]) -> str:
        """An assistant turn's tool calls in DSML."""
        invokes = []
        for call in calls:
            fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
            params = [self._parameter(k, v) for k, v in self.arguments(fn.get("arguments")).items()]
            invoke = self._tag(self.invoke_tag)
            invokes.append(f'<{invoke} name="{fn.get("name")}">\n' + "\n".join(params) + f"\n</{invoke}>")
        calls_tag = self._tag(self.calls_tag)
        return f"<{calls_tag}>\n" + "\n".join(invokes) + f"\n</{calls_tag}>"

    def arguments(self, raw: Any) -> Mapping[str, Any]:
        """V4: JSON-object arguments as their members; any other text is one `arguments` string."""
        parsed = _parse_object(raw)
        return parsed if parsed is not None else {"arguments": raw if isinstance(raw, str) else to_json(raw)}

    def _parameter(self, key: str, value: Any) -> str:
        tag = self._tag(self.param_tag)
        is_str = isinstance(value, str)
        text = value if is_str else to_json(value)
        return f'<{tag} name="{key}" string="{"true" if is_str else "false"}">{text}</{tag}>'


class DeepseekV41Encoding(DeepseekV4Encoding):
    """DeepSeek V4.1: the <｜System｜> token, spaced DSML tags, numeric effort, inline system turns."""

    kind: NativeKind = "deepseek_v41"
    calls_tag, invoke_tag, param_tag = " calls", " invoke", " parameter"
    inline_system = True

    def check_effort(self, value: Any) -> int:
        """An integer score in 1..100 (never a bool or float) or a named level's score; None selects the default."""
        if value is None:
            value = DEFAULT_EFFORT
        if isinstance(value, str) and value in V41_EFFORT_SCORES:
            return V41_EFFORT_SCORES[value]
        lo, hi = V41_EFFORT_RANGE
        if type(value) is not int or not lo <= value <= hi:
            raise EncoderRefusal(f"DeepSeek V4.1 accepts reasoning_effort as an integer from {lo} through {hi} or "
                                 f"one of {', '.join(V41_EFFORT_SCORES)}; got {value!r}", "reasoning_effort")
        return value

    def effort_prefix(self, effort: Any) -> str:
        return V41_EFFORT_PREFIX.format(effort)

    def _opens_reply(self, index: int, turn: Mapping[str, Any]) -> bool:
        return turn["role"] == "user" or (turn["role"] == "system" and index > 0)

    def _lead(self, turn: Mapping[str, Any], thinking: bool, effort: Any) -> str:
        """The system token hosts the effort prefix and a leading system turn's text."""
        prefix = self.effort_prefix(effort) if thinking else ""
        return (SYSTEM if prefix or turn["role"] == "system" else "") + prefix

    def _system_marker(self, index: int) -> str:
        return SYSTEM if index > 0 else ""  # index 0's token is emitted with the effort prefix (_lead)

    def arguments(self, raw: Any) -> Mapping[str, Any]:
        parsed = _parse_object(raw)
        if parsed is None:
            raise EncoderRefusal("DeepSeek V4.1 needs each replayed tool call's arguments to be a JSON object")
        return parsed


ENCODERS: dict[str, type[DeepseekV4Encoding]] = {"deepseek_v4": DeepseekV4Encoding,
                                                  "deepseek_v41": DeepseekV41Encoding}


def native_encoder(kind: str) -> DeepseekV4Encoding:
    """The encoder a core's template kind names."""
    try:
        return ENCODERS[kind]()
    except KeyError:
        raise TemplateError(f"unknown native template kind {kind!r}") from None


def _text(value: Any) -> str:
    """A message field as text: None is empty; text blocks (Anthropic shape) join with blank lines."""
    if value is None:
        return ""
    if isinstance(value, list):
        return BLOCK_SEPARATOR.join(b.get("text", "") if isinstance(b, Mapping) else str(b) for b in value)
    return str(value)


def _parse_object(raw: Any) -> Mapping[str, Any] | None:
    if isinstance(raw, Mapping):
        return raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return None
