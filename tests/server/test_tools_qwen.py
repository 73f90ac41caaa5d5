"""End to end with a real model that calls tools: Qwen2.5-Coder-0.5B-Instruct behind one `helios serve`.

The core is exported once per session from the GGUF (recipe qwen25: the hermes tool parser); the official
openai and anthropic SDKs ask for the weather in Paris with a declared get_weather(city) tool at temperature 0
(clamped to the recipe's minimum, seeded: deterministic) and get a parsed call in each protocol's shape.

NOTE: this checkpoint's <tool_call> / </tool_call> embedding rows are untrained (their norms equal the unused
rows'), so the model never generates those tokens and the template's instruction, which names them, reads
as noise to it. It does write the tags in ordinary pieces when asked for "an XML element named tool_call";
the hermes parser matches the tag text either way. SYSTEM below is the prompt found to do so at temperature 0
(the answer reads ```xml\n<tool_call>\n    {"name": "get_weather", ...}\n</tool_call>\n```).
"""

from __future__ import annotations

import json

import pytest


pytestmark = pytest.mark.slow

SYSTEM = ("Never use markdown. To use a tool, reply with one XML element named tool_call that wraps the JSON call. "
          "For Tokyo the reply is an XML element named tool_call wrapping "
          '{"name": "get_weather", "arguments": {"city": "Tokyo"}}.')
QUESTION = "What is the weather in Paris? Use the tool."
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
          "required": ["city"]}
DESCRIPTION = "Get the current weather for a city"
CHAT_TOOLS = [{"type": "function",
               "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS}}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def qwen_server(qwen25_served):
    from ignition.recipes.table import ALL_RECIPES

    assert next(r for r in ALL_RECIPES if r.name == "qwen25").tool_parser == "hermes"
    return qwen25_served[0]


@pytest.fixture(scope="module")
def openai_client(qwen_server):
    from openai import OpenAI

    with OpenAI(base_url=qwen_server + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


CHAT = dict(model="qwen", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            tools=CHAT_TOOLS, temperature=0, max_tokens=MAX_TOKENS)


def _check_arguments(arguments: str) -> None:
    assert "Paris" in json.loads(arguments)["city"]


def test_chat_buffered(openai_client):
    from openai.types.chat import ChatCompletionMessageToolCall

    r = openai_client.chat.completions.create(**CHAT)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls
    assert isinstance(call, ChatCompletionMessageToolCall) and call.type == "function" and call.id
    assert call.function.name == "get_weather"
    _check_arguments(call.function.arguments)


def test_chat_streaming(openai_client):
    chunks = list(openai_client.chat.completions.create(**CHAT, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id
    assert calls[0].function.name == "get_weather"
    _check_arguments(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_messages(qwen_server):
    import anthropic
    from anthropic.types import ToolUseBlock

    with anthropic.Anthropic(base_url=qwen_server, api_key="unused", max_retries=0, timeout=120) as c:
        # NOTE: the pinned SDK's create() has no temperature argument; the server still reads the field
        r = c.messages.create(model="qwen", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
                              tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMS}],
                              max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use", r.content
    [tool] = [b for b in r.content if isinstance(b, ToolUseBlock)]
    assert tool.name == "get_weather" and "Paris" in tool.input["city"]


def test_responses(openai_client):
    r = openai_client.responses.create(
        model="qwen", instructions=SYSTEM, input=QUESTION, temperature=0, max_output_tokens=MAX_TOKENS,
        tools=[{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS,
                "strict": False}])
    assert r.status == "completed"
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    _check_arguments(call.arguments)


def test_responses_streaming(openai_client):
    events = list(openai_client.responses.create(
        model="qwen", instructions=SYSTEM, input=QUESTION, temperature=0, max_output_tokens=MAX_TOKENS, stream=True,
        tools=[{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS,
                "strict": False}]))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == 1 and added[0].item.name == "get_weather" and len(done) == 1
    _check_arguments(done[0].arguments)
    assert events[-1].type == "response.completed"


# --- Responses custom tools: a regex grammar, validated on the exact input the model wrote ---------------

CUSTOM_SYSTEM = ("Never use markdown. To use a tool, reply with one XML element named tool_call that wraps the JSON "
                 "call. For 555-0000 the reply is an XML element named tool_call wrapping "
                 '{"name": "%s", "arguments": {"input": "555-0000"}}.')
LOOKUP = {"type": "custom", "name": "lookup", "description": "Look up who owns a phone number",
          "format": {"type": "grammar", "syntax": "regex", "definition": r"\d{3}-\d{4}"}}


def _lookup(number: str) -> str:
    return f"Who owns the phone number {number}? Use the tool."


def test_responses_custom_tool_call(openai_client):
    from openai.types.responses import ResponseCustomToolCall

    r = openai_client.responses.create(model="qwen", instructions=CUSTOM_SYSTEM % "lookup", input=_lookup("555-1234"),
                                       tools=[LOOKUP], temperature=0, max_output_tokens=MAX_TOKENS)
    assert r.status == "completed"
    [call] = [item for item in r.output if item.type == "custom_tool_call"]
    assert isinstance(call, ResponseCustomToolCall) and call.name == "lookup" and call.namespace is None
    assert call.input == "555-1234" and call.call_id and call.id.startswith("ctc_")


def test_responses_custom_tool_input_outside_its_grammar_fails(openai_client):
    import openai

    # the model copies the number it was given; 12-34 is not \d{3}-\d{4}, so no call may be emitted
    with pytest.raises(openai.InternalServerError) as e:
        openai_client.responses.create(model="qwen", instructions=CUSTOM_SYSTEM % "lookup", input=_lookup("12-34"),
                                       tools=[LOOKUP], temperature=0, max_output_tokens=MAX_TOKENS)
    assert "does not match its regex grammar: byte 2" in e.value.message


def test_responses_namespaced_custom_tool_streaming(openai_client):
    namespace = {"type": "namespace", "name": "phone", "description": "The phone book", "tools": [LOOKUP]}
    events = list(openai_client.responses.create(
        model="qwen", instructions=CUSTOM_SYSTEM % "phone__lookup", input=_lookup("555-1234"), tools=[namespace],
        temperature=0, max_output_tokens=MAX_TOKENS, stream=True))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "custom_tool_call"]
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert len(added) == 1 and added[0].item.name == "lookup" and added[0].item.namespace == "phone"
    assert len(done) == 1 and done[0].input == "555-1234" and done[0].item_id == added[0].item.id
    assert events[-1].type == "response.completed"
    [call] = [item for item in events[-1].response.output if item.type == "custom_tool_call"]
    assert (call.name, call.namespace, call.input) == ("lookup", "phone", "555-1234")
