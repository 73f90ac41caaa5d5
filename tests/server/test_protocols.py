"""Protocol conformance with the official `openai` and `anthropic` SDKs against a running service, any core.

    FLARE_API_TEST_URL=http://127.0.0.1:8000 .venv/bin/python -m pytest tests/server/test_protocols.py -q

FLARE_API_TEST_KEY is the serving key of an authenticated endpoint. Without FLARE_API_TEST_URL the suite runs
against the local session `server` (tests/server/conftest.py), so CI runs it too. Model-agnostic: the model id
comes from /v1/models and the tests assert protocol behaviour (shapes, orders, counts, buffered == streamed
under a fixed seed), never what the model says. Requests stay small so the tiny local model answers in seconds.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

ANTHROPIC_VERSION = "2023-06-01"  # the spec's version; the pinned SDK's default differs
SEED = 1234
ASK = "Name three colours."
JSON_ASK = 'Reply with the JSON object {"answer": "yes"} and nothing else.'
# small and bounded: a constant key and a two-value enum, so any model closes it within a few tokens
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
STRUCTURED_MAX_TOKENS = 256  # bounds a reasoning model's thinking before the constrained answer
OPENAI_ERROR_KEYS = {"type", "message", "param", "code"}
ANTHROPIC_ERROR_KEYS = {"type", "message"}


@dataclass(frozen=True)
class Target:
    url: str  # scheme://host:port, no trailing slash
    key: str  # "" when the endpoint is unauthenticated

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}


# --- fixtures: the service, its clients and its one model card ------------------------------------------


@pytest.fixture(scope="module")
def target(request) -> Target:
    url = os.environ.get("FLARE_API_TEST_URL", "").rstrip("/")
    if url:
        return Target(url, os.environ.get("FLARE_API_TEST_KEY", ""))
    server = request.getfixturevalue("server")  # started only when no external URL is given
    return Target(server.url, server.api_key)


@pytest.fixture(scope="module")
def oai(target):
    # an arbitrary nonempty key satisfies SDK construction when the server has no key
    with openai.OpenAI(base_url=target.url + "/v1", api_key=target.key or "unused", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def ant(target):
    with anthropic.Anthropic(base_url=target.url, api_key=target.key or "unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def raw(target):
    with httpx.Client(base_url=target.url, headers=target.headers(), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def card(oai) -> dict:
    models = oai.models.list().data
    assert len(models) == 1, [m.id for m in models]
    return models[0].model_dump()


@pytest.fixture(scope="module")
def model(card) -> str:
    return card["id"]


@pytest.fixture(scope="module")
def top_k(card) -> int:
    """Alternatives to ask for in logprob tests; skips on a core without generation logprobs."""
    if not card["permission"][0]["allow_logprobs"]:
        pytest.skip("the loaded core has no generation logprob outputs")
    return min(3, card["flare"]["max_top_logprobs"])


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _openai_error(resp: httpx.Response, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS, body
    assert body["error"]["type"] == type_ and body["error"]["message"], body
    return body["error"]


def _anthropic_error(resp: httpx.Response, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == ANTHROPIC_ERROR_KEYS and body["error"]["type"] == type_, body
    return body["error"]


# --- /v1/models --------------------------------------------------------------------------------------


def test_model_card(card, oai):
    assert card["object"] == "model" and card["owned_by"] == "local" and card["parent"] is None
    assert isinstance(card["created"], int) and card["created"] > 0
    assert card["root"] and isinstance(card["max_model_len"], int) and card["max_model_len"] > 0
    [perm] = card["permission"]
    assert perm["allow_sampling"] is True and perm["allow_view"] is True and isinstance(perm["allow_logprobs"], bool)
    assert (perm["allow_fine_tuning"], perm["allow_create_engine"], perm["allow_search_indices"]) == (False,) * 3
    flare = card["flare"]
    for key in ("vocab_size", "max_top_logprobs", "max_concurrency", "prefill_chunk_size", "default_max_tokens",
                "sampling_defaults", "thinking_token_budget", "sampling_ranges", "max_images_per_prompt",
                "max_image_tokens_per_prompt", "image_feature_window_tokens", "max_image_tokens_per_image",
                "max_image_pixels", "max_image_bytes", "input_modalities", "output_modalities"):
        assert key in flare, key
    assert 0 <= flare["max_top_logprobs"] <= 20
    assert (flare["max_top_logprobs"] > 0) == perm["allow_logprobs"]
    assert flare["output_modalities"] == ["text"] and "text" in flare["input_modalities"]
    # the same card, stable, under its id and under the checkpoint identifier
    for name in {card["id"], card["root"]}:
        assert oai.models.retrieve(name).model_dump() == card


@pytest.mark.parametrize("name", ["no-such-model-{}", "no-such-org/no-such-model-{}"])
def test_unknown_model_is_404_model_not_found(oai, name):
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve(name.format(uuid.uuid4().hex))
    # OpenAI's own shape for an unknown model
    assert _openai_error(e.value.response, 404, "invalid_request_error")["code"] == "model_not_found"


# --- Chat Completions --------------------------------------------------------------------------------


def _reasoning(obj) -> str:
    return getattr(obj, "reasoning_content", None) or getattr(obj, "reasoning", None) or ""


def _counts(usage) -> tuple[int, int, int]:
    # NOTE: cached_tokens legitimately differs once the first request has published the prompt's pages
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_chat_buffered_equals_streamed(oai, model):
    kw = dict(model=model, messages=_user(ASK), max_tokens=16, temperature=0, seed=SEED)
    r = oai.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.model == model and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0
    assert 0 <= u.prompt_tokens_details.cached_tokens < u.prompt_tokens

    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.object == "chat.completion.chunk" and c.model == model for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    reasoning = "".join(_reasoning(c.choices[0].delta) for c in with_choices)
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert (text, reasoning) == (choice.message.content or "", _reasoning(choice.message))
    assert finishes == [choice.finish_reason]
    # include_usage: one final chunk without choices carries the usage, no other chunk does
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert _counts(chunks[-1].usage) == _counts(u)


def test_chat_stream_without_include_usage_has_no_usage(oai, model):
    chunks = list(oai.chat.completions.create(model=model, messages=_user(ASK), max_tokens=4, stream=True))
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_chat_n2_indices_buffered_and_streamed(oai, model):
    kw = dict(model=model, messages=_user(ASK), max_tokens=8, temperature=0, seed=SEED, n=2)
    r = oai.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    texts, finishes, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert [texts[0], texts[1]] == [c.message.content or "" for c in r.choices]
    assert [finishes[0], finishes[1]] == [[c.finish_reason] for c in r.choices]
    assert _counts(usage) == _counts(r.usage)


def test_generation_answers_with_the_loaded_model(oai, model):
    r = oai.chat.completions.create(model=f"not-{model}", messages=_user(ASK), max_tokens=1)
    assert r.model == model


# --- Completions -------------------------------------------------------------------------------------


def test_completions_string_prompts_and_indices(oai, model):
    prompts = ["The sky is", "Water is"]
    counts = [oai.completions.create(model=model, prompt=p, max_tokens=0).usage.prompt_tokens for p in prompts]
    r = oai.completions.create(model=model, prompt=prompts, max_tokens=4, n=2, seed=SEED, temperature=0)
    assert r.object == "text_completion" and r.model == model
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt_index * n + choice_index
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage.prompt_tokens == sum(counts)  # each input counted once, whatever n is
    assert 0 < r.usage.completion_tokens <= 4 * 4


def test_completions_token_id_prompt_and_echo(oai, raw, model):
    # the rendered chat prompt as token ids (vLLM's return_token_ids extension): valid ids for any core
    chat = raw.post("/v1/chat/completions", json={"model": model, "messages": _user(ASK), "max_tokens": 1,
                                                  "return_token_ids": True}).json()
    ids = chat["prompt_token_ids"]
    assert len(ids) == chat["usage"]["prompt_tokens"] and all(isinstance(i, int) for i in ids)
    echoed = oai.completions.create(model=model, prompt=ids, max_tokens=0, echo=True)  # no generation at all
    prompt_text = echoed.choices[0].text
    assert prompt_text and echoed.choices[0].finish_reason == "length" and echoed.usage.completion_tokens == 0
    r = oai.completions.create(model=model, prompt=ids, max_tokens=4, echo=True, seed=SEED, temperature=0)
    assert r.choices[0].text.startswith(prompt_text) and r.usage.prompt_tokens == len(ids)
    both = oai.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=2)
    assert [c.index for c in both.choices] == [0, 1] and both.usage.prompt_tokens == len(ids) + 3
    s = oai.completions.create(model=model, prompt="The sky is", max_tokens=3, echo=True)
    assert s.choices[0].text.startswith("The sky is")


def test_completions_buffered_equals_streamed(oai, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0, seed=SEED)
    r = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(r.usage)


def test_completions_logprob_arrays(oai, model, top_k):
    r = oai.completions.create(model=model, prompt="The sky is", max_tokens=6, temperature=0, seed=SEED,
                               logprobs=top_k, extra_body={"return_tokens_as_token_ids": True})
    c, u = r.choices[0], r.usage
    lp = c.logprobs
    n = len(lp.tokens)
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    # one entry per generated token; a terminating EOS has none
    assert n == u.completion_tokens if c.finish_reason == "length" else n in (u.completion_tokens,
                                                                                u.completion_tokens - 1)
    assert lp.text_offset == sorted(lp.text_offset) and (not n or lp.text_offset[0] == 0)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token.startswith("token_id:") and value <= 0
        assert top_k <= len(top) <= top_k + 1  # the chosen token is always included
        assert top[token] == pytest.approx(value, abs=1e-4) and all(v <= 0 for v in top.values())


# --- logprob invariants (Chat) -----------------------------------------------------------------------


def test_chat_logprob_invariants(oai, model, top_k):
    kw = dict(model=model, messages=_user(ASK), max_tokens=6, temperature=0, seed=SEED, logprobs=True,
              top_logprobs=top_k)
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    entries = c.logprobs.content
    n = r.usage.completion_tokens
    assert len(entries) == n if c.finish_reason == "length" else len(entries) in (n, n - 1)
    for e in entries:
        values = [t.logprob for t in e.top_logprobs]
        assert len(values) == top_k and values == sorted(values, reverse=True)
        assert e.logprob <= 0 and all(v <= 0 for v in values)
        assert e.logprob <= values[0] + 1e-4  # nothing beats the most likely alternative
        assert bytes(e.bytes) and all(t.bytes is not None for t in e.top_logprobs)
        for t in e.top_logprobs:
            if t.token == e.token:
                assert t.logprob == pytest.approx(e.logprob, abs=1e-4)
    streamed = [e for chunk in oai.chat.completions.create(stream=True, **kw) for ch in chunk.choices
                if ch.logprobs for e in ch.logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


# --- Responses ---------------------------------------------------------------------------------------


def test_responses_buffered_equals_streamed(oai, model):
    kw = dict(model=model, input=ASK, max_output_tokens=16, temperature=0, extra_body={"seed": SEED})
    r = oai.responses.create(**kw)
    assert r.object == "response" and r.model == model and r.status in ("completed", "incomplete")
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens > 0
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert u.output_tokens_details.reasoning_tokens >= 0

    events = list(oai.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == f"response.{r.status}" and types.count(types[-1]) == 1
    seq = [e.sequence_number for e in events]
    assert seq == sorted(set(seq))  # strictly increasing
    # every output item and content part opens before it closes, in output order
    opened = {e.output_index: k for k, e in enumerate(events) if e.type == "response.output_item.added"}
    closed = {e.output_index: k for k, e in enumerate(events) if e.type == "response.output_item.done"}
    assert list(opened) == list(closed) == list(range(len(r.output)))
    assert all(opened[i] < closed[i] for i in opened)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == r.output_text
    assert [item.type for item in final.output] == [item.type for item in r.output]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (u.input_tokens, u.output_tokens)


# --- Messages ----------------------------------------------------------------------------------------


def test_messages_buffered_equals_streamed_and_usage(ant, model):
    # NOTE: the pinned SDK has no `temperature` parameter; it travels as an extra field
    kw = dict(model=model, max_tokens=16, messages=_user(ASK), extra_body={"temperature": 0, "seed": SEED})
    count = ant.messages.count_tokens(model=model, messages=_user(ASK)).input_tokens
    m = ant.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == model
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count
    assert m.usage.cache_creation_input_tokens == 0

    events = list(ant.messages.create(stream=True, **kw))  # the SDK drops pings
    names = [e.type for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0].message
    assert start.content == [] and start.stop_reason is None and start.model == model
    assert (start.usage.input_tokens, start.usage.cache_read_input_tokens) == (count, 0)
    # blocks: start(i), delta(i)*, stop(i) for i = 0, 1, ... in order
    index, texts = -1, {}
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert e.index == index + 1
            index = e.index
            texts[index] = ""
        elif e.type == "content_block_delta":
            assert e.index == index
            texts[index] += getattr(e.delta, "text", "") or getattr(e.delta, "thinking", "") or ""
        else:
            assert e.type == "content_block_stop" and e.index == index, e
    assert index + 1 == len(m.content)
    for i, block in enumerate(m.content):
        assert texts[i] == (getattr(block, "text", None) or getattr(block, "thinking", ""))
    delta = events[-2]
    assert delta.delta.stop_reason == m.stop_reason and delta.usage.output_tokens == m.usage.output_tokens
    assert delta.usage.input_tokens + delta.usage.cache_read_input_tokens == count


# --- SSE framing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, done", [
    ("/v1/chat/completions", {"messages": _user(ASK), "max_tokens": 2}, True),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, True),
    ("/v1/responses", {"input": ASK, "max_output_tokens": 2}, False),
    ("/v1/messages", {"messages": _user(ASK), "max_tokens": 2}, False),
], ids=["chat", "completions", "responses", "messages"])
def test_sse_framing(raw, target, model, path, body, done):
    headers = {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": target.key} if target.key else {})}
    r = raw.post(path, json={"model": model, **body, "stream": True}, headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.headers.get("x-request-id")  # the request reached model submission
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    # only the OpenAI Chat and Completions streams end with the [DONE] sentinel
    assert (data[-1] == "[DONE]") == done and data.count("[DONE]") == int(done)
    assert all(isinstance(json.loads(d), dict) for d in data if d != "[DONE]")


# --- structured output, one route per protocol -------------------------------------------------------


def _obeys(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"answer"} and value["answer"] in ("yes", "no"), value


def test_chat_json_object(oai, model):
    r = oai.chat.completions.create(model=model, messages=_user(JSON_ASK), max_tokens=STRUCTURED_MAX_TOKENS,
                                    temperature=0, seed=SEED, response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert isinstance(json.loads(c.message.content), dict)


def test_responses_text_format_json_schema(oai, model):
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}
    r = oai.responses.create(model=model, input=JSON_ASK, max_output_tokens=STRUCTURED_MAX_TOKENS, temperature=0,
                             text={"format": fmt}, extra_body={"seed": SEED})
    assert r.status == "completed", r.incomplete_details
    _obeys(r.output_text)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"


def test_messages_output_format(ant, model):
    m = ant.messages.create(model=model, max_tokens=STRUCTURED_MAX_TOKENS, messages=_user(JSON_ASK),
                            extra_body={"temperature": 0, "seed": SEED,
                                        "output_format": {"type": "json_schema", "schema": ANSWER_SCHEMA}})
    assert m.stop_reason == "end_turn", m.stop_reason
    [text] = [b.text for b in m.content if b.type == "text"]
    _obeys(text)


# --- error shapes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_400_openai_routes(oai, model, card, route, stream):
    over = card["max_model_len"] + 1  # over-context on every route: prompt + output cannot fit
    create = {
        "chat": lambda: oai.chat.completions.create(model=model, messages=_user(ASK), max_tokens=over, stream=stream),
        "completions": lambda: oai.completions.create(model=model, prompt="Hi", max_tokens=over, stream=stream),
        "responses": lambda: oai.responses.create(model=model, input=ASK, max_output_tokens=over, stream=stream),
    }[route]
    # validation precedes the SSE headers, so a stream is refused with the same 400
    with pytest.raises(openai.BadRequestError) as e:
        create()
    _openai_error(e.value.response, 400, "invalid_request_error")


def test_400_anthropic_routes(target, ant, card, model):
    headers = {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": target.key} if target.key else {})}
    over = {"model": model, "max_tokens": card["max_model_len"] + 1, "messages": _user(ASK)}
    with httpx.Client(base_url=target.url, headers=headers, timeout=120) as c:
        for body in (over, {**over, "stream": True}):
            _anthropic_error(c.post("/v1/messages", json=body), 400, "invalid_request_error")
        _anthropic_error(c.post("/v1/messages/count_tokens", json={"model": model, "messages": []}), 400,
                         "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):  # the SDK types it too
        ant.messages.create(**over)


def test_401_wrong_key(target, model):
    if not target.key:
        pytest.skip("the endpoint is unauthenticated")
    wrong = "wrong-" + uuid.uuid4().hex
    bad = openai.OpenAI(base_url=target.url + "/v1", api_key=wrong, max_retries=0, timeout=60)
    for call in (lambda: bad.models.list(),
                 lambda: bad.chat.completions.create(model=model, messages=_user(ASK), max_tokens=1),
                 lambda: bad.completions.create(model=model, prompt="Hi", max_tokens=1),
                 lambda: bad.responses.create(model=model, input=ASK, max_output_tokens=1)):
        with pytest.raises(openai.AuthenticationError) as e:
            call()
        _openai_error(e.value.response, 401, "authentication_error")
    with httpx.Client(base_url=target.url, timeout=60) as c:
        _openai_error(c.get("/v1/models"), 401, "authentication_error")  # no key at all
        body = {"model": model, "max_tokens": 1, "messages": _user(ASK)}
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            for headers in ({"x-api-key": wrong}, {}):
                r = c.post(path, json=body, headers={"anthropic-version": ANTHROPIC_VERSION, **headers})
                _anthropic_error(r, 401, "authentication_error")
