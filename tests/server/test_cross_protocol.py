"""One conversation through Chat Completions, Messages and Responses: the same neutral messages, the same
prompt token ids, the same usage and output on the real server; one terminal cause, one finish-reason table."""

from __future__ import annotations

import json

import msgspec
import pytest

from helios.output.termination import termination_cause
from helios.server.generation import FINISH_REASONS
from helios.server.protocols import anthropic_messages, openai_chat, openai_responses
from tests.server.conftest import ANTHROPIC_VERSION, API_KEY

SYSTEM = "You are terse."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy one."},
    {"role": "user", "content": "And of Italy? Use the tool."},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"country": "Italy"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Rome"},
    {"role": "user", "content": "So?"},
]
MESSAGES = {"system": SYSTEM, "messages": [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Easy one.", "signature": anthropic_messages.thinking_signature("Easy one.")},
        {"type": "text", "text": "Paris."}]},
    {"role": "user", "content": [{"type": "text", "text": "And of Italy? Use the tool."}]},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"country": "Italy"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Rome"},
                                 {"type": "text", "text": "So?"}]},
]}
RESPONSES = {"instructions": SYSTEM, "input": [
    {"role": "user", "content": "What is the capital of France?"},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Easy one."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And of Italy? Use the tool."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
    {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"country": "Italy"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Rome"},
    {"role": "user", "content": "So?"},
]}


def _lowered(runtime) -> dict[str, list[int]]:
    chat_ids = openai_chat.prepare(msgspec.json.encode({"messages": CHAT, "max_tokens": 4}), runtime.model).prompt_ids
    messages = anthropic_messages.prepare(msgspec.json.encode({**MESSAGES, "max_tokens": 4}), runtime.model)
    responses = openai_responses.prepare(msgspec.json.encode({**RESPONSES, "max_output_tokens": 4}), runtime.model)
    return {"chat": chat_ids, "messages": messages.prompt_ids, "responses": responses.prompt_ids}


def test_lowering_gives_identical_token_ids(core_runtime):
    ids = _lowered(core_runtime)
    assert ids["chat"] == ids["messages"] == ids["responses"]
    text = core_runtime.tokenizer.decode(ids["chat"])
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    assert "<|im_start|>tool\nRome<|im_end|>\n<|im_start|>user\nSo?<|im_end|>\n<|im_start|>assistant\n" in text


def test_neutral_messages_agree(core_runtime):
    m_req = msgspec.json.decode(json.dumps({**MESSAGES, "max_tokens": 1}), type=anthropic_messages.MessagesRequest)
    r_req = msgspec.json.decode(json.dumps(RESPONSES), type=openai_responses.ResponsesRequest)
    from_messages, _ = anthropic_messages.to_conversation(m_req)
    from_responses = openai_responses.to_conversation(r_req)
    assert from_messages == from_responses
    chat_like = [(m["role"], m["content"], m.get("reasoning_content"), m.get("tool_calls"), m.get("tool_call_id"))
                 for m in CHAT]
    assert [(m.role, m.content, m.reasoning, m.tool_calls, m.tool_call_id) for m in from_messages] == chat_like


def test_replay_through_three_routes(http, anthropic_client, client):
    """Same prompt tokens (usage), same seeded output on the real server."""
    kw = {"seed": 5}
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, **kw}).json()
    msg = anthropic_client.messages.create(model="m", max_tokens=8, extra_body=kw, **MESSAGES)
    count = anthropic_client.messages.count_tokens(model="m", **MESSAGES).input_tokens
    resp = client.responses.create(model="m", max_output_tokens=8, extra_body=kw, **RESPONSES)
    num_prompt = chat["usage"]["prompt_tokens"]
    assert num_prompt == msg.usage.input_tokens + msg.usage.cache_read_input_tokens == count
    assert num_prompt == resp.usage.input_tokens
    text = chat["choices"][0]["message"]["content"]
    assert text == msg.content[0].text == resp.output_text
    assert chat["usage"]["completion_tokens"] == msg.usage.output_tokens == resp.usage.output_tokens


@pytest.mark.parametrize("limit,expected", [
    (3, ("length", "max_tokens", "incomplete")),
    (200, ("stop", "end_turn", "completed")),
])
def test_finish_reasons_from_one_cause(http, limit, expected):
    q = "Say hi."
    headers = {"anthropic-version": ANTHROPIC_VERSION, "x-api-key": API_KEY}
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": q}],
                                                   "max_tokens": limit, "temperature": 0}).json()
    msg = http.post("/v1/messages", headers=headers, json={"messages": [{"role": "user", "content": q}],
                                                           "max_tokens": limit, "temperature": 0}).json()
    resp = http.post("/v1/responses", json={"input": q, "max_output_tokens": limit, "temperature": 0}).json()
    assert (chat["choices"][0]["finish_reason"], msg["stop_reason"], resp["status"]) == expected
    if expected[0] == "length":
        assert resp["incomplete_details"] == {"reason": "max_output_tokens"}


def test_string_stop_from_one_cause(http):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    headers = {"anthropic-version": ANTHROPIC_VERSION, "x-api-key": API_KEY}
    chat = http.post("/v1/chat/completions", json={"messages": q, "max_tokens": 20, "temperature": 0,
                                                   "stop": [" Paris"]}).json()
    msg = http.post("/v1/messages", headers=headers, json={"messages": q, "max_tokens": 20, "temperature": 0,
                                                           "stop_sequences": [" Paris"]}).json()
    resp = http.post("/v1/responses", json={"input": q[0]["content"], "max_output_tokens": 20, "temperature": 0,
                                            "stop": [" Paris"]}).json()
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["choices"][0]["stop_reason"] == " Paris"
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", " Paris")
    assert resp["status"] == "completed"
    text = chat["choices"][0]["message"]["content"]
    assert text == msg["content"][0]["text"] == resp["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("finish,stop,calls,cause", [
    ("length", None, 0, "length"), ("length", None, 2, "length"), ("stop", " x", 0, "stop_string"),
    ("stop", " x", 1, "stop_string"), ("stop", 2, 0, "eos"), ("stop", None, 0, "eos"), ("stop", 7, 0, "stop_token"),
    ("stop", [7, 8], 0, "stop_token"), ("stop", 2, 1, "tool_calls"), ("abort", None, 0, "abort"),
    ("error", None, 0, "error"),
])
def test_termination_cause(finish, stop, calls, cause):
    assert termination_cause(finish, stop, (2,), calls) == cause


def test_finish_reason_table():
    by_cause = {c: tuple(FINISH_REASONS[p][c] for p in ("chat", "completions", "messages", "responses"))
                for c in ("eos", "stop_token", "stop_string", "length", "tool_calls")}
    assert by_cause == {
        "eos": ("stop", "stop", "end_turn", "completed"),
        "stop_token": ("stop", "stop", "end_turn", "completed"),
        "stop_string": ("stop", "stop", "stop_sequence", "completed"),
        "length": ("length", "length", "max_tokens", "incomplete"),
        "tool_calls": ("tool_calls", "stop", "tool_use", "completed"),
    }


def _call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_parallel_tool_results_follow_call_order(core_runtime):
    chat = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a"), _call("b")]},
            {"role": "tool", "tool_call_id": "a", "content": "ra"},
            {"role": "tool", "tool_call_id": "b", "content": "rb"}]
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "f", "input": {}}
                                                  for i in ("a", "b")]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "rb"},
                                             {"type": "tool_result", "tool_use_id": "a", "content": "ra"}]}]
    chat_ids = openai_chat.prepare(msgspec.json.encode({"messages": chat, "max_tokens": 1}), core_runtime.model).prompt_ids
    m_ids = anthropic_messages.prepare(msgspec.json.encode({"messages": messages, "max_tokens": 1}),
                                       core_runtime.model).prompt_ids
    assert chat_ids == m_ids


def test_order_tool_results_rules():
    from helios.frontend.chat import ChatMessage, order_tool_results

    def tool(cid, text=None):
        return ChatMessage(role="tool", content=text or cid, tool_call_id=cid)

    asst = ChatMessage(role="assistant", content="", tool_calls=[_call("a"), _call("b"), _call("c")])
    note = ChatMessage(role="user", content="note")
    got = order_tool_results([asst, tool("c"), note, tool("a"), tool("b")])
    assert [(m.role, m.content) for m in got] == [("assistant", ""), ("tool", "a"), ("user", "note"), ("tool", "b"),
                                                  ("tool", "c")]
    for group in ([tool("c"), tool("a")], [tool("c"), tool("a"), tool("x")], [tool("c"), tool("c"), tool("a")]):
        assert order_tool_results([asst, *group]) == [asst, *group]  # missing, unknown, duplicate: as supplied
    later = ChatMessage(role="assistant", content="x")
    assert order_tool_results([asst, tool("c"), tool("b"), later, tool("a")]) == [asst, tool("c"), tool("b"), later,
                                                                                  tool("a")]
