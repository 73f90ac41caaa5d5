"""POST /v1/messages and /v1/messages/count_tokens: the official Anthropic SDK and raw HTTP against a real
`helios serve`, plus the lowering (prepare) on the real core and failure paths on a scripted fake engine."""

from __future__ import annotations

import asyncio
import gzip
import json

import anthropic
import httpx
import msgspec
import pytest

from helios.engine.scheduler import QueueFull
from helios.server.errors import ApiError
from helios.server.protocols import anthropic_messages as am
from tests.frontend.conftest import byte_level_tok, tokenizer  # noqa: F401 (fixtures)
from tests.server.conftest import ANTHROPIC_VERSION, API_KEY, fake_protocol_client
from tests.server.test_app_fake import _out

ALIAS = "smollm2-135m-instruct"
Q = [{"role": "user", "content": "What is the capital of France?"}]
HEADERS = {"anthropic-version": ANTHROPIC_VERSION, "x-api-key": API_KEY}


def _post(http, body: dict, path: str = "/v1/messages", headers: dict | None = None) -> httpx.Response:
    return http.post(path, json=body, headers=HEADERS if headers is None else headers)


def _anthropic_error(resp: httpx.Response, status: int, type_: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == type_
    return body["error"]["message"]


def _events(text: str) -> list[tuple[str, dict]]:
    out = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines() if not line.startswith(":"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# --- the official SDK ---------------------------------------------------------------------------------


def test_sdk_create(anthropic_client):
    m = anthropic_client.messages.create(model="anything", max_tokens=12, messages=Q, extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.model == ALIAS and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens > 10 and u.output_tokens > 0  # cache reads: whatever ran before
    # the default system prompt's first page may be cached by earlier chats: reads are whole 16-token pages
    assert u.cache_read_input_tokens % 16 == 0 and u.cache_creation_input_tokens == 0


def test_sdk_max_tokens_and_stop_sequence(anthropic_client):
    m = anthropic_client.messages.create(model=ALIAS, max_tokens=3, messages=Q, extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    m = anthropic_client.messages.create(model=ALIAS, max_tokens=20, messages=Q, stop_sequences=[" Paris", "zzz"],
                                         extra_body={"temperature": 0})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " Paris"
    assert "Paris" not in m.content[0].text


def test_sdk_stream_matches_create(anthropic_client):
    kw = dict(model=ALIAS, max_tokens=16, messages=Q, extra_body={"seed": 7})
    buffered = anthropic_client.messages.create(**kw)
    with anthropic_client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == buffered.content[0].text == final.content[0].text
    assert final.stop_reason == buffered.stop_reason
    # input_tokens leaves out cache reads, which differ once the first request cached the prompt's pages
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total == buffered.usage.input_tokens + buffered.usage.cache_read_input_tokens
    assert final.usage.output_tokens == buffered.usage.output_tokens


def test_sdk_count_tokens_equals_real_usage(anthropic_client):
    system = "You are terse."
    count = anthropic_client.messages.count_tokens(model=ALIAS, messages=Q, system=system)
    m = anthropic_client.messages.create(model=ALIAS, max_tokens=2, messages=Q, system=system)
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_sdk_prefill_continues(anthropic_client):
    m = anthropic_client.messages.create(
        model=ALIAS, max_tokens=4, extra_body={"temperature": 0},
        messages=[*Q, {"role": "assistant", "content": "The capital of France is"}])
    assert "Paris" in m.content[0].text and not m.content[0].text.startswith("The capital")


def test_sdk_errors_are_typed(anthropic_client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=ALIAS, max_tokens=2, messages=Q, extra_body={"logprobs": True})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=ALIAS, max_tokens=2, messages=Q)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "missing or invalid API key"}}


# --- raw HTTP: event sequence, headers, rejections -----------------------------------------------------


def test_stream_event_sequence(http):
    body = {"model": ALIAS, "max_tokens": 6, "messages": Q, "stream": True, "temperature": 0}
    count = _post(http, body, "/v1/messages/count_tokens").json()["input_tokens"]
    r = _post(http, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    events = _events(r.text)
    names = [n for n, _ in events]
    assert all(data["type"] == name for name, data in events)
    num_deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert num_deltas >= 1
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == ALIAS
    assert start["usage"] == {"input_tokens": count, "output_tokens": 0, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for n, d in events if n == "content_block_delta")
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    cached = final["usage"]["cache_read_input_tokens"]  # earlier chats may have cached the system prompt's page
    assert cached % 16 == 0 and cached < count
    assert final["usage"] == {"input_tokens": count - cached, "output_tokens": 6, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": cached}


def test_stream_stop_sequence_reports_exact_string(http):
    r = _post(http, {"max_tokens": 20, "messages": Q, "stream": True, "temperature": 0, "stop_sequences": [" Paris"]})
    events = _events(r.text)
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " Paris"}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert "Paris" not in text


def test_anthropic_version_required(http):
    """Missing, malformed, impossible or earlier than 2023-06-01: 400 on both routes."""
    body = {"max_tokens": 2, "messages": Q}
    for headers in ({"x-api-key": API_KEY}, *({"x-api-key": API_KEY, "anthropic-version": v}
                                               for v in ("2023-05-31", "2023-6-1", "latest", "2024-02-30", ""))):
        assert "anthropic-version" in _anthropic_error(_post(http, body, headers=headers), 400, "invalid_request_error")
        assert "anthropic-version" in _anthropic_error(_post(http, body, "/v1/messages/count_tokens", headers), 400,
                                                       "invalid_request_error")


def test_later_anthropic_versions_are_served(http):
    """Any later date of the same form is served with 2023-06-01 semantics (the SDKs send their own date)."""
    body = {"max_tokens": 2, "messages": Q, "temperature": 0}
    for version in ("2023-06-01", "2026-10-21", "2031-01-01"):
        headers = {"x-api-key": API_KEY, "anthropic-version": version}
        r = _post(http, body, headers=headers)
        assert r.status_code == 200, (version, r.text)
        assert r.json()["type"] == "message"
        assert _post(http, body, "/v1/messages/count_tokens", headers).json()["input_tokens"] > 0


def test_stock_sdk_without_extra_headers(server):
    """The official SDK as a user runs it: its own anthropic-version, no default_headers."""
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as client:
        msg = client.messages.create(model="x", max_tokens=3, messages=Q)
        assert msg.type == "message" and msg.usage.output_tokens >= 1
        assert client.messages.count_tokens(model="x", messages=Q).input_tokens > 0


def test_x_api_key_and_bearer(server):
    body = {"max_tokens": 1, "messages": Q}
    v = {"anthropic-version": ANTHROPIC_VERSION}
    bearer, wrong = f"Bearer {API_KEY}", "Bearer nope"
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for headers, status in (({"x-api-key": API_KEY}, 200), ({"authorization": bearer}, 200),
                                ({"x-api-key": API_KEY, "authorization": bearer}, 200),
                                ({"x-api-key": API_KEY, "authorization": wrong}, 401),
                                ({"x-api-key": "nope", "authorization": bearer}, 401),
                                ({}, 401), ({"x-api-key": "nope"}, 401)):
            r = c.post("/v1/messages", json=body, headers={**v, **headers})
            if status == 200:
                assert r.status_code == 200, (headers, r.text)
            else:
                _anthropic_error(r, 401, "authentication_error")
        # x-api-key is an Anthropic-route header: the OpenAI routes still want the bearer key
        r = c.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 1}, headers={"x-api-key": API_KEY})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("field,value", [
    ("logprobs", True), ("logprobs", False), ("top_logprobs", 2), ("return_tokens_as_token_ids", True),
    ("logprob_token_ids", [1, 2]), ("prompt_logprobs", 1),
])
def test_logprob_fields_rejected(http, field, value):
    msg = _anthropic_error(_post(http, {"max_tokens": 2, "messages": Q, field: value}), 400, "invalid_request_error")
    assert field in msg


@pytest.mark.parametrize("body,needle", [
    ({"messages": Q}, "max_tokens"),
    ({"max_tokens": 0, "messages": Q}, "max_tokens"),
    ({"max_tokens": 9000, "messages": Q}, "context length"),
    ({"max_tokens": 2, "messages": []}, "messages"),
    ({"max_tokens": 2, "messages": "hi"}, "messages"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "text-only"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
        "content": [{"type": "image", "source": {}}]}]}]}, "text-only"),
    ({"max_tokens": 2, "messages": Q, "stop_sequences": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"max_tokens": 2, "messages": Q, "stop_sequences": ["x" * 4097]}, "4096"),
    ({"max_tokens": 2, "messages": Q, "stop_sequences": [""]}, "nonempty"),
    ({"max_tokens": 2, "messages": Q, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ({"max_tokens": 2, "messages": Q, "tool_choice": {"type": "tool", "name": "f"}}, "not declared"),
    ({"max_tokens": 2, "messages": Q, "thinking_token_budget": 100}, "thinking_token_budget"),
    ({"max_tokens": 2, "messages": Q, "thinking": {"type": "enabled", "budget_tokens": 2000},
      "thinking_token_budget": 1000}, "must match"),
    ({"max_tokens": 2, "messages": Q, "thinking": {"type": "sometimes"}}, "thinking"),
    ({"max_tokens": 2, "messages": Q, "output_config": {"effort": 3}}, "effort"),
    ({"max_tokens": 2, "messages": Q, "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100}}]}}, "context"),
    ({"max_tokens": 2, "messages": Q, "context_management": {"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}}, "context"),
    ({"max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"max_tokens": 2, "messages": [*Q, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "opaque"}]}]}, "redacted"),
    ({"max_tokens": 2, "messages": [*Q, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "a", "signature": am.thinking_signature("b")}]}]}, "signature"),
])
def test_rejections(http, body, needle):
    assert needle in _anthropic_error(_post(http, body), 400, "invalid_request_error")


def test_encodings_and_body_limits_in_messages_shape(http):
    body = json.dumps({"max_tokens": 1, "messages": Q}).encode()
    headers = {**HEADERS, "content-type": "application/json"}
    r = http.post("/v1/messages", content=gzip.compress(body), headers={**headers, "content-encoding": "gzip"})
    assert r.status_code == 200, r.text
    bomb = gzip.compress(b"{" + b" " * (40 << 20) + b"}")
    r = http.post("/v1/messages", content=bomb, headers={**headers, "content-encoding": "gzip"})
    _anthropic_error(r, 413, "request_too_large")
    r = http.post("/v1/messages/count_tokens", content=body, headers={**headers, "content-encoding": "compress"})
    _anthropic_error(r, 415, "invalid_request_error")
    _anthropic_error(http.post("/v1/messages/nope", json={}, headers=HEADERS), 404, "not_found_error")


def test_count_tokens_rejects_like_messages(http):
    _anthropic_error(_post(http, {"messages": Q, "top_logprobs": 1}, "/v1/messages/count_tokens"), 400,
                     "invalid_request_error")
    _anthropic_error(_post(http, {"messages": []}, "/v1/messages/count_tokens"), 400, "invalid_request_error")
    _anthropic_error(http.get("/v1/messages", headers=HEADERS), 405, "invalid_request_error")


def test_accepted_controls(http):
    """Advisory or neutral controls are accepted and change nothing in the prompt."""
    base = {"max_tokens": 1, "messages": Q}
    count = _post(http, base, "/v1/messages/count_tokens").json()["input_tokens"]
    for extra in ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, {"thinking": {"type": "disabled"}},
                  {"thinking": {"type": "adaptive"}}, {"output_config": {"effort": "high"}},
                  {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
                  {"metadata": {"user_id": "u"}}, {"cache_control": {"type": "ephemeral"}},
                  {"tool_choice": {"type": "auto"}}, {"service_tier": "auto"}):
        r = _post(http, {**base, **extra})
        assert r.status_code == 200, (extra, r.text)
        u = r.json()["usage"]
        assert u["input_tokens"] + u["cache_read_input_tokens"] == count, extra  # input_tokens excludes cache reads


def test_history_blocks(http):
    """Thinking (ours and foreign), tool_use / tool_result, inline system text and cache_control are replayed."""
    thought = "The user wants a city."
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look up the capital of France.",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": thought, "signature": am.thinking_signature(thought)},
            {"type": "thinking", "thinking": "foreign", "signature": "EqQBCkgIARABGAIiQ..."},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "France"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Paris", "is_error": False},
            {"type": "text", "text": "Answer in one word."}]},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Well?"},
    ]
    r = _post(http, {"max_tokens": 3, "messages": messages, "system": [{"type": "text", "text": "You help."}]})
    assert r.status_code == 200, r.text


# --- lowering on the real core (no engine) --------------------------------------------------------------


def _prepare(runtime, body: dict):
    return am.prepare(msgspec.json.encode({"max_tokens": 4, **body}), runtime.model)


def test_system_forms_and_empty_system(core_runtime):
    as_string = _prepare(core_runtime, {"messages": Q, "system": "A\n\nB"}).prompt_ids
    as_blocks = _prepare(core_runtime, {"messages": Q, "system": [{"type": "text", "text": "A"},
                                                                   {"type": "text", "text": "B"}]}).prompt_ids
    assert as_string == as_blocks
    text = core_runtime.tokenizer.decode(as_string)
    assert text.startswith("<|im_start|>system\nA\n\nB<|im_end|>")
    # an empty system produces no prompt text: the template's own default system message stays
    default = core_runtime.tokenizer.decode(_prepare(core_runtime, {"messages": Q, "system": ""}).prompt_ids)
    assert default == core_runtime.tokenizer.decode(_prepare(core_runtime, {"messages": Q}).prompt_ids)
    assert "SmolLM" in default


def test_prefill_renders_continuation(core_runtime):
    prep = _prepare(core_runtime, {"messages": [*Q, {"role": "assistant", "content": "The capital is"}]})
    text = core_runtime.tokenizer.decode(prep.prompt_ids)
    assert text.endswith("<|im_start|>assistant\nThe capital is")


def test_tool_history_lowering(core_runtime):
    req = msgspec.json.decode(json.dumps({"max_tokens": 1, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "text", "text": "before"},
                                     {"type": "tool_result", "tool_use_id": "t1", "content": [
                                         {"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}]},
    ]}), type=am.MessagesRequest)
    messages, _ = am.to_conversation(req)
    assert [(m.role, m.content) for m in messages] == [("assistant", ""), ("user", "before"), ("tool", "r1\n\nr2")]
    assert messages[0].tool_calls == [{"id": "t1", "type": "function",
                                       "function": {"name": "f", "arguments": '{"a": 1}'}}]
    assert messages[2].tool_call_id == "t1"


def test_cache_control_hints_are_candidate_boundaries(core_runtime):
    def user(text, hint=True):
        block = {"type": "text", "text": text}
        return {"role": "user", "content": [{**block, "cache_control": {"type": "ephemeral"}} if hint else block]}

    turns = [user("one"), {"role": "assistant", "content": "a"}, user("two"), {"role": "assistant", "content": "b"},
             user("three", hint=False), {"role": "assistant", "content": "c"}, user("four"),
             {"role": "assistant", "content": "d"}, user("five"), {"role": "assistant", "content": "e"}, user("six")]
    hinted = _prepare(core_runtime, {"messages": turns})
    plain = _prepare(core_runtime, {"messages": [
        {**t, "content": [{k: v for k, v in t["content"][0].items() if k != "cache_control"}]}
        if isinstance(t["content"], list) else t for t in turns]})
    assert hinted.prompt_ids == plain.prompt_ids  # markers change nothing in the prompt
    assert plain.cache_boundaries == []
    tok = core_runtime.tokenizer
    bounds = hinted.cache_boundaries
    assert len(bounds) == 4 and bounds == sorted(bounds)  # only the first four hinted blocks count
    for pos, word in zip(bounds, ("one", "two", "four", "five")):
        assert tok.decode(hinted.prompt_ids[:pos]).endswith(word)
    # cache_control on an assistant block is ignored
    other = _prepare(core_runtime, {"messages": [*Q, {"role": "assistant", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]})
    assert other.cache_boundaries == []


def test_thinking_marker_is_deterministic():
    sig = am.thinking_signature("some reasoning")
    assert sig.startswith("flare-thinking-v1:") and sig == am.thinking_signature("some reasoning")
    assert sig != am.thinking_signature("other reasoning")


# --- failure paths on a scripted fake engine -------------------------------------------------------------


def test_execution_error_is_api_error(tokenizer):
    ids = tokenizer.encode("hello")

    def script(req):
        return [_out(req, ids[:1]), _out(req, [], finished=True, reason="error", error="boom")]

    async def main():
        c, _ = fake_protocol_client(tokenizer, script, HEADERS)
        async with c:
            r = await c.post("/v1/messages", json={"max_tokens": 5, "messages": Q})
            s = await c.post("/v1/messages", json={"max_tokens": 5, "messages": Q, "stream": True})
        return r, s

    r, s = asyncio.run(main())
    _anthropic_error(r, 500, "api_error")
    assert s.status_code == 200
    events = _events(s.text)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "error" and "message_stop" not in names
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "generation failed: boom"}}


def test_failure_before_first_token_has_no_message_start(tokenizer):
    def script(req):
        return [_out(req, [], finished=True, reason="error", error="boom")]

    async def main():
        c, _ = fake_protocol_client(tokenizer, script, HEADERS)
        async with c:
            return await c.post("/v1/messages", json={"max_tokens": 5, "messages": Q, "stream": True})

    assert [n for n, _ in _events(asyncio.run(main()).text)] == ["error"]


def test_queue_full_is_503_api_error(tokenizer):
    async def main():
        c, engine = fake_protocol_client(tokenizer, lambda req: [], HEADERS)
        engine.submit_error = QueueFull("full")
        async with c:
            return await c.post("/v1/messages", json={"max_tokens": 5, "messages": Q})

    _anthropic_error(asyncio.run(main()), 503, "api_error")


def test_error_shapes():
    err = ApiError(429, "rate_limit_error", "slow down")
    assert json.loads(err.encode_anthropic()) == {"type": "error", "error": {"type": "rate_limit_error",
                                                                              "message": "slow down"}}
    for status in (500, 503):
        assert json.loads(ApiError(status, "server_error", "x").encode_anthropic())["error"]["type"] == "api_error"
