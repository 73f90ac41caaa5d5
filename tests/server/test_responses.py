"""POST /v1/responses (stateless): the official OpenAI SDK and raw HTTP against a real `helios serve`, the
lowering on the real core, and failure paths on a scripted fake engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import openai
import pytest

from helios.server.protocols import openai_responses as orsp
from tests.frontend.conftest import byte_level_tok, tokenizer  # noqa: F401 (fixtures)
from tests.server.conftest import fake_protocol_client
from tests.server.test_app_fake import _out

ALIAS = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
LIFECYCLE_HEAD = ["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added"]
LIFECYCLE_TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _error(resp: httpx.Response, status: int, type_: str = "invalid_request_error") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == type_ and set(err) == {"type", "message", "param", "code"}
    return err


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# --- the official SDK ---------------------------------------------------------------------------------


def test_sdk_create_buffered(client):
    r = client.responses.create(model="anything", input=QUESTION, max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.model == ALIAS and r.id.startswith("resp_")
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    assert "Paris" in r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and [p.type for p in item.content] == ["output_text"]
    u = r.usage
    assert u.input_tokens > 10 and u.total_tokens == u.input_tokens + u.output_tokens
    # the default system prompt's first page may be cached by earlier chats: reuse is in whole 16-token pages
    cached = u.input_tokens_details.cached_tokens
    assert cached % 16 == 0 and cached < u.input_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert r.store is False and r.truncation == "disabled"


def test_sdk_stream_lifecycle_matches_buffered(client):
    kw = dict(model=ALIAS, input=QUESTION, max_output_tokens=12, extra_body={"seed": 9})
    buffered = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    terminal = f"response.{buffered.status}"
    assert types == [*LIFECYCLE_HEAD, *["response.output_text.delta"] * num_deltas, *LIFECYCLE_TAIL, terminal]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == events[-4].text == done.output_text == buffered.output_text
    assert done.output[0].id == item_id and done.usage.output_tokens == buffered.usage.output_tokens


def test_incomplete_at_max_output_tokens(client):
    r = client.responses.create(model=ALIAS, input=QUESTION, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3
    events = list(client.responses.create(model=ALIAS, input=QUESTION, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_sdk_input_items_and_instructions(client, http):
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Find the capital."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "France"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Paris"},
        {"role": "user", "content": "Answer in one word."},
    ]
    r = client.responses.create(model=ALIAS, input=items, instructions="Be brief.", max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.instructions == "Be brief."
    plain = client.responses.create(model=ALIAS, input=items, max_output_tokens=4)
    assert r.usage.input_tokens != plain.usage.input_tokens


def test_logprobs_include(client, http):
    kw = dict(model=ALIAS, input=QUESTION, max_output_tokens=5, temperature=0, top_logprobs=3,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens  # no hidden tokens at an output limit
    assert "".join(e.token for e in part.logprobs) == part.text
    for e in part.logprobs:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob <= 0 and bytes(e.bytes).decode() == e.token
    streamed = []
    for ev in client.responses.create(stream=True, **kw):
        if ev.type == "response.output_text.delta":
            streamed += ev.logprobs
        if ev.type == "response.output_text.done":
            assert [x.token for x in ev.logprobs] == [x.token for x in part.logprobs]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in part.logprobs]
    without = client.responses.create(model=ALIAS, input=QUESTION, max_output_tokens=5, top_logprobs=3)
    assert without.output[0].content[0].logprobs == []  # other include values / no include: no entries
    ids = http.post("/v1/responses", json={**kw, "return_tokens_as_token_ids": True}).json()
    assert ids["output"][0]["content"][0]["logprobs"][0]["token"].startswith("token_id:")


@pytest.mark.parametrize("body,param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"), ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 9000}, "max_output_tokens"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"), ({"text": "json"}, "text"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"reasoning": {"effort": 3}}, "reasoning"), ({"thinking_token_budget": 5}, "thinking_token_budget"),
    ({"input": []}, "input"), ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input"),
    ({"input": [{"type": "reasoning", "encrypted_content": "opaque", "summary": []}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"logprob_token_ids": [1]}, "logprob_token_ids"),
])
def test_rejections(http, body, param):
    err = _error(http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 2, **body}), 400)
    assert err["param"] == param, err


def test_store_false_and_disabled_truncation_accepted(http):
    r = http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 1, "store": False,
                                         "truncation": "disabled", "background": False, "include": ["other"]})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"]


def test_auth_uses_bearer(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        _error(c.post("/v1/responses", json={"input": "x"}), 401, "authentication_error")
        _error(c.post("/v1/responses", json={"input": "x"}, headers={"x-api-key": server.api_key}), 401,
               "authentication_error")


# --- lowering on the real core ---------------------------------------------------------------------------


def _prompt(runtime, body: dict) -> str:
    prep = orsp.prepare(msgspec.json.encode({"max_output_tokens": 4, **body}), runtime.model)
    return runtime.tokenizer.decode(prep.prompt_ids)


def test_instructions_lead_and_string_input(core_runtime):
    text = _prompt(core_runtime, {"input": "hi", "instructions": "Be brief."})
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # developer instructions merge with the system text into one leading system message, in request order,
    # each section labelled with its role
    text = _prompt(core_runtime, {"instructions": "A", "input": [
        {"role": "user", "content": "hi"}, {"role": "developer", "content": "B"}]})
    assert text.startswith("<|im_start|>system\n<system>A</system>\n\n<developer>B</developer><|im_end|>\n"
                           "<|im_start|>user\nhi<|im_end|>")


def test_function_calls_join_their_assistant_turn(core_runtime):
    req = msgspec.json.decode(json.dumps({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "r1"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "r2"},
    ]}), type=orsp.ResponsesRequest)
    messages = orsp.to_conversation(req)
    assert [(m.role, m.content) for m in messages] == [("user", "q"), ("assistant", "checking"), ("tool", "r1"),
                                                       ("tool", "r2")]
    assert messages[1].reasoning == "think" and [c["id"] for c in messages[1].tool_calls] == ["c1", "c2"]
    assert [m.tool_call_id for m in messages[2:]] == ["c1", "c2"]


# --- failure paths on a scripted fake engine -------------------------------------------------------------


def test_generation_failure_ends_in_response_failed(tokenizer):
    ids = tokenizer.encode("hello")

    def script(req):
        return [_out(req, ids[:1]), _out(req, [], finished=True, reason="error", error="boom")]

    async def main():
        c, _ = fake_protocol_client(tokenizer, script)
        async with c:
            r = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 5})
            s = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 5, "stream": True})
        return r, s

    r, s = asyncio.run(main())
    _error(r, 500, "server_error")
    assert s.status_code == 200
    events = _events(s.text)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.failed"
    assert "response.completed" not in names and "[DONE]" not in s.text
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "generation failed: boom"
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))


def test_sdk_stream_surfaces_failure(tokenizer):
    def script(req):
        return [_out(req, [], finished=True, reason="error", error="boom")]

    async def main():
        c, _ = fake_protocol_client(tokenizer, script)
        async with openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=c, max_retries=0) as oc:
            stream = await oc.responses.create(model="m", input="hi", max_output_tokens=5, stream=True)
            return [e.type async for e in stream]

    assert asyncio.run(main()) == ["response.created", "response.in_progress", "response.failed"]
