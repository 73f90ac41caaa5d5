"""Replayed tool history through a real template: Qwen2.5-Coder-0.5B-Instruct's (Hermes JSON, `tojson` on arguments).

The core is exported from the GGUF (recipe qwen25) and served; Chat's return_token_ids hands back the prompt ids,
decoded here with the core's tokenizer. A replayed call's arguments must appear once-encoded (an object, not a
JSON string inside JSON); a Messages tool_result with is_error must reach the prompt visibly ("Error: ", as
this template has no error field of its own), so it no longer renders like a success.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

ARGS = '{"city": "Paris", "days": 2}'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
FAILURE = "city not found: Parisx"


@pytest.fixture(scope="module")
def qwen(qwen25_served):
    """(url, core directory) of the served Qwen2.5-Coder core."""
    return qwen25_served


def _decode(core, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(core / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def _chat_prompt_ids(url: str, messages: list[dict]) -> list[int]:
    body = {"model": "qwen", "messages": messages, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


def _chat_prompt(url: str, core, messages: list[dict]) -> str:
    return _decode(core, _chat_prompt_ids(url, messages))


def _messages_input_tokens(url: str, is_error: bool | None) -> int:
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": FAILURE}
    if is_error is not None:
        result["is_error"] = is_error
    body = {"model": "qwen", "max_tokens": 1, "tools": [
        {"name": "get_weather", "description": "Get the weather forecast for a city",
         "input_schema": TOOLS[0]["function"]["parameters"]}],
        "messages": [
            {"role": "user", "content": "Weather in Parisx?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Parisx"}}]},
            {"role": "user", "content": [result]}]}
    r = httpx.post(url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"]  # the whole prompt


def test_replayed_call_arguments_encoded_once(qwen):
    url, core = qwen
    prompt = _chat_prompt(url, core, [
        {"role": "user", "content": "Weather in Paris for two days?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in prompt, prompt
    assert '\\"city\\"' not in prompt, prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt, prompt


def test_unparsable_arguments_stay_a_string(qwen):
    url, core = qwen
    prompt = _chat_prompt(url, core, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assert '"arguments": "{city: Paris"' in prompt, prompt


def test_tool_error_is_visible(qwen):
    """The Messages error renders as the Chat tool message "Error: <text>" does, and differs from a success."""
    url, core = qwen
    failed, succeeded = _messages_input_tokens(url, True), _messages_input_tokens(url, None)
    assert _messages_input_tokens(url, False) == succeeded
    ids = _chat_prompt_ids(url, [
        {"role": "user", "content": "Weather in Parisx?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function",
                                                           "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Parisx"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: " + FAILURE},
    ])
    assert f"<tool_response>\nError: {FAILURE}\n</tool_response>" in _decode(core, ids)
    assert failed == len(ids) > succeeded


# --- the lowering rules on their own (no server) -------------------------------------------------------------------


class _Chars:
    """A tokenizer stand-in: the renderer's tests read the text only."""

    bos_token = eos_token = None

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def encode_with_ends(self, text):  # each byte a token, ending where its character ends
        ends = [i + 1 for i, ch in enumerate(text) for _ in ch.encode()]
        return self.encode(text), ends


def _render(source: str, messages) -> str:
    from helios.core.manifest import TemplateCaps
    from helios.frontend.chat import ChatRenderer

    caps = TemplateCaps(present=True, tools=True, inline_system=True)
    return ChatRenderer(source, caps, _Chars()).render(messages, add_generation_prompt=False).text


def _replayed(arguments: str, result_error: bool = False):
    from helios.frontend.chat import ChatMessage

    return [ChatMessage(role="user", content="Weather?"),
            ChatMessage(role="assistant", content="", tool_calls=[
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]),
            ChatMessage(role="tool", content=FAILURE, tool_call_id="c1", is_error=result_error)]

CALLS = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}"
RESULTS = "{% if m.role == 'tool' %}[{{ m.content }}]{% endif %}{% endfor %}"


def test_object_arguments_and_error_prefix():
    text = _render(CALLS + RESULTS, _replayed(ARGS, result_error=True))
    assert text == f'{ARGS}[Error: {FAILURE}]'


def test_template_error_field_is_used_instead_of_the_prefix():
    source = CALLS + "{% if m.role == 'tool' %}[{{ 'failed: ' if m.is_error }}{{ m.content }}]{% endif %}{% endfor %}"
    assert _render(source, _replayed(ARGS, result_error=True)) == f'{ARGS}[failed: {FAILURE}]'
    assert _render(source, _replayed(ARGS)) == f'{ARGS}[{FAILURE}]'


def test_text_joining_template_gets_the_text():
    """DeepSeek V3's template concatenates arguments as text: an object fails there, so it gets the string."""
    source = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ 'args: ' + c.function.arguments }}" \
             "{% endfor %}{% endfor %}"
    assert _render(source, _replayed(ARGS)) == f"args: {ARGS}"


def test_only_a_leading_attribution_line_is_dropped():
    from helios.frontend.chat import ChatMessage

    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    line = "x-anthropic-billing-header: cc_version=2.1.296.d1c; cc_entrypoint=cli; cch=5e1a9;"
    lead = [ChatMessage(role="system", content=line + "\n\nYou are a coding agent."),
            ChatMessage(role="user", content=line)]
    assert _render(source, lead) == f"<system>You are a coding agent.<user>{line}"
    plain = [ChatMessage(role="system", content="Rules.\n" + line), ChatMessage(role="user", content="Hi")]
    assert _render(source, plain) == f"<system>Rules.\n{line}<user>Hi"
