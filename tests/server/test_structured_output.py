"""Structured output end to end: the official OpenAI and Anthropic SDKs against a real `helios serve`.

Every spelling (Chat and Completions response_format and structured_outputs, Responses text.format, Messages
output_format and output_config.format) yields text that obeys its constraint; logprobs describe the raw
distribution, not the masked one; the combination rules and invalid definitions are 400s naming the field.
The schemas are small and bounded so the tiny model finishes well inside max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re

import anthropic
import openai
import pytest

from helios.frontend.chat import ChatMessage
from tests.server.conftest import API_KEY

ALIAS = "smollm2-135m-instruct"
TOL = 1e-3  # the same prompt's logprobs, recomputed: equal up to float noise (a renormalized mask moves them far)

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "continent": {"type": "string", "enum": ["Europe", "Asia", "Africa", "America"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "continent", "population"],
    "additionalProperties": False,
}
DESCRIBE = "Describe Paris as JSON."
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
FLAT_FORMAT = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}  # Responses: not nested
ANTHROPIC_FORMAT = {"type": "json_schema", "schema": CITY}
CODE = "[0-9]{3}-[a-z]{2}"


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _obeys(value, schema: dict) -> None:
    """The subset of JSON Schema the tests use, checked by hand (assertions name the failing path)."""
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), value
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), value
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), value
        for key, sub in props.items():
            if key in value:
                _obeys(value[key], sub)
    elif kind == "string":
        assert isinstance(value, str), value
        assert len(value) <= schema.get("maxLength", len(value)), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), value
    if "enum" in schema:
        assert value in schema["enum"], value


def _json_obeys(text: str, schema: dict = CITY) -> None:
    _obeys(json.loads(text), schema)


# --- Chat Completions ---------------------------------------------------------------------------------


def test_chat_json_schema_greedy_buffered_and_stream(client, frontend):
    _, _, chat = frontend
    kw = dict(model=ALIAS, messages=_user(DESCRIBE), max_tokens=48, temperature=0, response_format=CHAT_FORMAT)
    r = client.chat.completions.create(**kw)
    [choice] = r.choices
    assert choice.finish_reason == "stop"
    _json_obeys(choice.message.content)
    # the JSON-only instruction (with the schema) joins the system prompt
    plain = chat.render([ChatMessage(role="user", content=DESCRIBE)]).token_ids
    assert r.usage.prompt_tokens > len(plain)

    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"


def test_chat_json_schema_sampled_n2(client):
    kw = dict(model=ALIAS, messages=_user(DESCRIBE), max_tokens=48, temperature=1, seed=3, n=2,
              response_format=CHAT_FORMAT)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "stop"
        _json_obeys(c.message.content)
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices]
    assert finished == {0: "stop", 1: "stop"}


def test_chat_json_object(client):
    r = client.chat.completions.create(model=ALIAS, messages=_user("What is the capital of France?"), max_tokens=48,
                                       temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("spec, check", [
    ({"choice": ["maybe", "never"]}, lambda t: t in ("maybe", "never")),
    ({"regex": CODE}, lambda t: re.fullmatch(CODE, t)),
    ({"grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"json": {"type": "integer", "minimum": 10, "maximum": 99}}, lambda t: 10 <= json.loads(t) <= 99),
], ids=["choice", "regex", "grammar", "json"])
def test_chat_native_structured_outputs(client, spec, check):
    r = client.chat.completions.create(model=ALIAS, messages=_user("Is the sky blue?"), max_tokens=16,
                                       temperature=0, extra_body={"structured_outputs": spec})
    c = r.choices[0]
    assert c.finish_reason == "stop" and check(c.message.content), c.message.content


def test_concurrent_constraints_stay_on_their_rows(client, server):
    """One batch, five rows, four different masks (and one without): each row obeys its own constraint and
    matches what it produces alone."""
    specs = [None, {"regex": CODE}, {"choice": ["maybe", "never"]}, {"grammar": 'start: "yes" | "no"'},
             {"json": {"type": "integer", "minimum": 10, "maximum": 99}}]

    def kw(spec):
        return dict(model=ALIAS, messages=_user("Tell me something."), max_tokens=10, temperature=0,
                    extra_body={"structured_outputs": spec} if spec else {})

    alone = [client.chat.completions.create(**kw(s)).choices[0].message.content for s in specs]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as ac:
            rs = await asyncio.gather(*[ac.chat.completions.create(**kw(s)) for s in specs])
            return [r.choices[0].message.content for r in rs]

    together = asyncio.run(main())
    assert together == alone
    _, code, word, yes_no, number = together
    assert re.fullmatch(CODE, code) and word in ("maybe", "never") and yes_no in ("yes", "no")
    assert 10 <= json.loads(number) <= 99


# --- Completions (raw text: the whole output follows the grammar) --------------------------------------


def test_completions_regex_and_json_schema(client):
    r = client.completions.create(model=ALIAS, prompt="My phone code is", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": CODE}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(CODE, r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=ALIAS, prompt="A JSON about Paris:", max_tokens=48, temperature=0,
                                  extra_body={"response_format": CHAT_FORMAT})
    assert r.choices[0].finish_reason == "stop"
    _json_obeys(r.choices[0].text)


# --- Responses ----------------------------------------------------------------------------------------


def _echoes(fmt) -> None:
    assert fmt.type == "json_schema" and fmt.name == "city" and fmt.strict is True


def test_responses_text_format_buffered_and_stream(client):
    kw = dict(model=ALIAS, input=DESCRIBE, max_output_tokens=48, temperature=0, text={"format": FLAT_FORMAT})
    r = client.responses.create(**kw)
    assert r.status == "completed"
    _json_obeys(r.output_text)
    _echoes(r.text.format)

    events = list(client.responses.create(stream=True, **kw))
    assert events[0].type == "response.created"
    _echoes(events[0].response.text.format)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed" and final.response.output_text == deltas == r.output_text
    _echoes(final.response.text.format)


# --- Messages -----------------------------------------------------------------------------------------


def test_messages_output_format_and_output_config(anthropic_client):
    m = anthropic_client.messages.create(model=ALIAS, max_tokens=48, messages=_user(DESCRIBE),
                                         extra_body={"temperature": 0, "output_format": ANTHROPIC_FORMAT})
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    _json_obeys(m.content[0].text)
    with anthropic_client.messages.stream(model=ALIAS, max_tokens=48, messages=_user(DESCRIBE),
                                          output_config={"format": ANTHROPIC_FORMAT},
                                          extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn" and text == final.content[0].text
    _json_obeys(text)


def test_messages_count_tokens_includes_the_instruction(anthropic_client):
    msgs = _user(DESCRIBE)
    plain = anthropic_client.messages.count_tokens(model=ALIAS, messages=msgs).input_tokens
    shaped = anthropic_client.messages.count_tokens(model=ALIAS, messages=msgs,
                                                    extra_body={"output_format": ANTHROPIC_FORMAT}).input_tokens
    configured = anthropic_client.messages.count_tokens(model=ALIAS, messages=msgs,
                                                        output_config={"format": ANTHROPIC_FORMAT}).input_tokens
    assert shaped == configured > plain


# --- logprobs: the raw distribution ------------------------------------------------------------------


def test_logprobs_describe_the_raw_distribution(client):
    """A choice constraint (no prompt instruction: the prompt is unchanged) forces a first token the model
    would not pick; that position's alternatives and the forced token's logprob are the unmasked ones."""
    kw = dict(model=ALIAS, messages=_user("Is the sky blue?"), temperature=0, logprobs=True, top_logprobs=5)
    ids = {"return_tokens_as_token_ids": True}
    free = client.chat.completions.create(max_tokens=1, extra_body=ids, **kw)
    bound = client.chat.completions.create(max_tokens=8, **kw,
                                           extra_body={**ids, "structured_outputs": {"choice": ["maybe", "never"]}})
    assert bound.choices[0].message.content in ("maybe", "never")
    assert bound.usage.prompt_tokens == free.usage.prompt_tokens
    [f] = free.choices[0].logprobs.content
    b = bound.choices[0].logprobs.content[0]
    assert b.token != f.token  # the mask changed the draw ...
    assert [t.token for t in b.top_logprobs] == [t.token for t in f.top_logprobs]  # ... not the alternatives
    assert [t.logprob for t in b.top_logprobs] == pytest.approx([t.logprob for t in f.top_logprobs], abs=TOL)
    assert b.logprob < f.logprob == pytest.approx(f.top_logprobs[0].logprob, abs=TOL)
    # the forced token's own logprob is its raw one, as an unconstrained request reports it
    forced_id = int(b.token.removeprefix("token_id:"))
    probe = client.chat.completions.create(max_tokens=1, extra_body={**ids, "logprob_token_ids": [forced_id]}, **kw)
    raw = {t.token: t.logprob for t in probe.choices[0].logprobs.content[0].top_logprobs}
    assert raw[b.token] == pytest.approx(b.logprob, abs=TOL)


# --- refusals -----------------------------------------------------------------------------------------

OK_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
BIG_GRAMMAR = "start: " + " | ".join(f'"word{i}"' for i in range(8000))  # > 64 KiB of valid Lark


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": OK_FORMAT, "stop": ["}"]}, "response_format", "custom stops"),
    ({"response_format": OK_FORMAT, "stop_token_ids": [2]}, "response_format", "custom stops"),
    ({"response_format": OK_FORMAT, "ignore_eos": True}, "response_format", "ignore_eos"),
    ({"response_format": OK_FORMAT, "continue_final_message": True, "add_generation_prompt": False,
      "messages": [*_user("Hi"), {"role": "assistant", "content": "4"}]},
     "response_format", "continuation"),
    ({"response_format": OK_FORMAT, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex",
     "cannot be combined"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "nonempty"),
    ({"structured_outputs": {"grammar": BIG_GRAMMAR}}, "structured_outputs.grammar", "exceeds 65536 bytes"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "invalid lark grammar"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex", "invalid regex grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON schema"),
], ids=["bad-schema", "unknown-type", "no-name", "stop", "stop-token-ids", "ignore-eos", "continuation",
        "two-spellings", "two-keys", "empty-choice", "grammar-over-64k", "bad-lark", "bad-regex", "unparsable-json"])
def test_chat_refusals(client, extra, param, words):
    assert len(BIG_GRAMMAR.encode()) > 64 * 1024
    body = {"messages": _user("Hi"), **extra}
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=ALIAS, messages=messages, max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and words in e.value.message
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param


def test_completions_refuses_stops_under_a_constraint(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ALIAS, prompt="x", max_tokens=4, stop=["q"],
                                  extra_body={"structured_outputs": {"regex": CODE}})
    assert e.value.status_code == 400 and e.value.body["param"] == "structured_outputs.regex"


@pytest.mark.parametrize("fmt, param, words", [
    ({**FLAT_FORMAT, "schema": {"type": "strin"}}, "text.format.schema", "invalid JSON schema"),
    ({"type": "json_schema", "schema": CITY}, "text.format.name", "name"),
    ({"type": "yaml"}, "text.format", "json_schema"),
], ids=["bad-schema", "no-name", "unknown-type"])
def test_responses_refusals(client, fmt, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=ALIAS, input="Hi", max_output_tokens=16, text={"format": fmt})
    assert e.value.status_code == 400 and words in e.value.message and e.value.body["param"] == param


@pytest.mark.parametrize("kw, words", [
    (dict(messages=[*_user("Hi"), {"role": "assistant", "content": "{"}],
          extra_body={"output_format": ANTHROPIC_FORMAT}), "assistant continuation"),
    (dict(messages=_user("Hi"), stop_sequences=["}"], extra_body={"output_format": ANTHROPIC_FORMAT}),
     "custom stops"),
    (dict(messages=_user("Hi"), extra_body={"output_format": {"type": "json_schema", "schema": {"type": "strin"}}}),
     "invalid JSON schema"),
    (dict(messages=_user("Hi"), output_config={"format": ANTHROPIC_FORMAT},
          extra_body={"output_format": ANTHROPIC_FORMAT}), "cannot be combined"),
], ids=["prefill", "stop-sequences", "bad-schema", "two-spellings"])
def test_messages_refusals(anthropic_client, kw, words):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=ALIAS, max_tokens=8, **kw)
    assert e.value.status_code == 400
    assert e.value.body["error"]["type"] == "invalid_request_error" and words in e.value.body["error"]["message"]
