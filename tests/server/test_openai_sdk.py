"""The official OpenAI SDK against a real `helios serve` (sync + async, buffered + streaming)."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, CORE, _stop, serve_core

ALIAS = "smollm2-135m-instruct"
CHECKPOINT = "SmolLM2-135M-Instruct.Q4_1"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list_and_cards(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [ALIAS]
    card = models[0].model_dump()
    assert card["root"] == CHECKPOINT and card["parent"] is None and card["owned_by"] == "local"
    assert card["max_model_len"] == 8192
    assert card["permission"][0]["allow_logprobs"] is True and card["permission"][0]["allow_sampling"] is True
    flare = card["flare"]
    assert flare["vocab_size"] == 49152 and flare["max_top_logprobs"] == 20
    assert flare["sampling_ranges"]["temperature"] == {"min": 0.05, "max": 2.0}
    assert flare["input_modalities"] == ["text"] and flare["thinking_token_budget"] is None
    assert client.models.retrieve(CHECKPOINT).id == ALIAS
    again = client.models.retrieve(ALIAS).model_dump()
    assert again["created"] == card["created"] and again["permission"][0]["id"] == card["permission"][0]["id"]


def test_unknown_model_is_404_even_with_slashes(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert e.value.body["code"] == "model_not_found"


def test_chat_buffered(client):
    r = client.chat.completions.create(model="anything", messages=MSGS, max_tokens=12, temperature=0)
    assert r.model == ALIAS and r.object == "chat.completion"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the chat template's default system prompt is shared by every chat request: earlier ones may have
    # cached its full pages (16 tokens each), never the last prompt token
    cached = u.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and cached < u.prompt_tokens
    assert u.completion_tokens_details.reasoning_tokens == 0


def test_chat_stream_matches_buffered(client):
    kw = dict(model=ALIAS, messages=MSGS, max_tokens=16, seed=7)
    buffered = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == buffered
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")


def test_chat_eos_stop_is_hidden(client):
    r = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in r.choices[0].message.content


def test_continuous_usage_stats(client):
    chunks = list(client.chat.completions.create(
        model=ALIAS, messages=MSGS, max_tokens=8, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)


def test_chat_n_choices_and_seed(client):
    r = client.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=8, n=3, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    single = client.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=8, seed=12)
    assert single.choices[0].message.content == r.choices[1].message.content  # seed advances by index


def test_continue_final_message(client):
    r = client.chat.completions.create(
        model=ALIAS, max_tokens=4, temperature=0,
        messages=[*MSGS, {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in r.choices[0].message.content


def test_chat_string_stop(client):
    r = client.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=20, temperature=0, stop=[" Paris"])
    c = r.choices[0]
    assert c.finish_reason == "stop" and "Paris" not in c.message.content
    assert c.model_dump()["stop_reason"] == " Paris"


def test_completions_prompt_forms_and_indices(client, frontend):
    _, tok, _ = frontend
    ids = tok.encode("The capital of France is")
    r = client.completions.create(model=ALIAS, prompt=["The capital of France is", "The capital of France is"],
                                  max_tokens=4, n=2, seed=3)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[2] and texts[1] == texts[3]  # the seed advances by choice index
    assert r.usage.prompt_tokens == 2 * len(ids)
    for prompt in (ids, [ids, ids[:3]]):
        r = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=2)
        assert len(r.choices) == (1 if prompt is ids else 2)


def test_empty_text_prompt_is_the_bos_token_and_empty_ids_are_rejected(client, frontend):
    _, tok, _ = frontend
    bos = tok.info.bos_token_id
    assert bos is not None and tok.encode("") == []  # the default core declares a BOS it does not add
    kw = dict(model=ALIAS, max_tokens=3, temperature=0, extra_body={"return_tokens_as_token_ids": True})
    r = client.completions.create(prompt="", echo=True, logprobs=1, **kw)
    assert r.usage.prompt_tokens == 1
    assert r.choices[0].logprobs.tokens[0] == f"token_id:{bos}" and r.choices[0].logprobs.token_logprobs[0] is None
    same = client.completions.create(prompt=[bos], **kw)
    assert same.choices[0].text == r.choices[0].text
    for prompt in ([], [[]], [[bos], []]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(prompt=prompt, **kw)
        assert e.value.body["param"] == "prompt"


def test_completions_echo_and_stop(client):
    r = client.completions.create(model=ALIAS, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  echo=True, stop=["."])
    c = r.choices[0]
    assert c.text.startswith("The capital of France is") and "." not in c.text
    assert c.finish_reason == "stop"


def test_max_tokens_zero_echo_only(client):
    r = client.completions.create(model=ALIAS, prompt="Hello there", max_tokens=0, echo=True)
    assert r.choices[0].text == "Hello there" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_stream(client):
    kw = dict(model=ALIAS, prompt="Once upon a time", max_tokens=10, seed=5)
    buffered = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == buffered


def test_async_sdk_buffered_and_stream(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as ac:
            a, b = await asyncio.gather(
                ac.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=6, seed=1),
                ac.completions.create(model=ALIAS, prompt="1, 2, 3,", max_tokens=6, seed=1))
            stream = await ac.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=6, seed=1, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return a, b, text

    a, b, text = asyncio.run(main())
    assert a.choices[0].message.content == text and b.choices[0].text


def test_chat_stream_n_interleaves_indices(client):
    kw = dict(model=ALIAS, messages=MSGS, max_tokens=6, n=2, seed=21)
    buffered = client.chat.completions.create(**kw)
    texts = {0: "", 1: ""}
    roles = set()
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            if ch.delta.role:
                roles.add(ch.index)
            texts[ch.index] += ch.delta.content or ""
    assert roles == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in buffered.choices]


def test_completions_stream_echo_logprobs_match_buffered(client):
    kw = dict(model=ALIAS, prompt="The capital of France is", max_tokens=4, echo=True, logprobs=1, seed=8)
    buffered = client.completions.create(**kw).choices[0]
    text, tokens, offsets, lps = "", [], [], []
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            text += ch.text
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                offsets += ch.logprobs.text_offset
                lps += ch.logprobs.token_logprobs
    assert text == buffered.text
    assert tokens == buffered.logprobs.tokens and offsets == buffered.logprobs.text_offset
    assert lps == buffered.logprobs.token_logprobs


def test_concurrent_requests_match_sequential_ones(client, server):
    seeds = list(range(100, 106))
    alone = [client.completions.create(model=ALIAS, prompt="My favourite food is", max_tokens=6, seed=s).choices[0].text
             for s in seeds]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as ac:
            rs = await asyncio.gather(*[ac.completions.create(model=ALIAS, prompt="My favourite food is",
                                                              max_tokens=6, seed=s) for s in seeds])
            return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == alone  # a seed gives the same output alone or in a batch


# --- the prefix cache ---------------------------------------------------------------------------------

CONTEXT = (
    "The Roman Empire was the post-Republican state of ancient Rome. It included territories in Europe, North "
    "Africa, and Western Asia, and was ruled by emperors. The fall of the Western Roman Empire in 476 AD "
    "conventionally marks the end of classical antiquity and the beginning of the Middle Ages."
)


def _prefix_cache_messages() -> list[dict]:
    # a fresh nonce inside the first 16-token page: nothing earlier in the session shares even that page
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex}. {CONTEXT}"},
            {"role": "user", "content": "In which year did the Western Roman Empire fall?"}]


def test_prefix_cache_reports_cached_tokens(client, http):
    msgs = _prefix_cache_messages()
    before = http.get("/metrics?format=json").json()
    first = client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=12, temperature=0)
    second = client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=12, temperature=0)
    after = http.get("/metrics?format=json").json()
    num_prompt = first.usage.prompt_tokens
    assert num_prompt > 64 and second.usage.prompt_tokens == num_prompt
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full page but the one holding the last prompt token, which is always recomputed
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16
    assert second.choices[0].message.content == first.choices[0].message.content
    assert after["reused_tokens"] - before["reused_tokens"] >= (num_prompt - 1) // 16 * 16
    assert after["cached_pages"] > 0
    assert after["prefill_tokens"] - before["prefill_tokens"] <= 2 * num_prompt - (num_prompt - 1) // 16 * 16


def test_no_prefix_cache_flag(tmp_path):
    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    config = tmp_path / "helios.toml"
    config.write_text("[server]\nkv_cache_tokens = 4096\n", encoding="utf-8")
    proc, url = serve_core(CORE, config, tmp_path / "serve.log", ("--no-prefix-cache",))
    try:
        body = {"model": ALIAS, "messages": _prefix_cache_messages(), "max_tokens": 4, "temperature": 0}
        num_generated = []
        for _ in range(2):
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            num_generated.append(r["usage"]["completion_tokens"])
        snap = httpx.get(url + "/metrics?format=json").json()
        assert (snap["reused_tokens"], snap["cached_pages"]) == (0, 0)
        # one decode round per token after each prefill's first (the warm-up request's included), one at a
        # time here; no speculation: no drafts
        rounds = snap["generated_tokens"] - snap["completed"]
        assert sum(num_generated) - 2 <= rounds and snap["verification_rounds"] == snap["verify_steps"] == rounds
        assert snap["verification_drafts"] == snap["accepted_drafts"] == 0
    finally:
        _stop(proc)


def test_logit_bias_steers_the_draw_and_leaves_logprobs_raw(client):
    base = dict(model=ALIAS, messages=MSGS, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"return_tokens_as_token_ids": True})
    plain = client.chat.completions.create(**base).choices[0].logprobs.content
    forced = 1000  # an ordinary token the model would not pick here
    got = client.chat.completions.create(**base, logit_bias={str(forced): 100}).choices[0].logprobs.content
    assert [e.token for e in got] == [f"token_id:{forced}"] * 3 != [e.token for e in plain]
    # the record describes the raw distribution: the same alternatives, the forced token below them
    assert [t.token for t in got[0].top_logprobs] == [t.token for t in plain[0].top_logprobs]
    assert got[0].logprob < plain[0].top_logprobs[-1].logprob
    # a ban moves greedy off the model's first choice
    top = plain[0].token.removeprefix("token_id:")
    banned = client.chat.completions.create(**base, logit_bias={top: -100}).choices[0].logprobs.content
    assert banned[0].token != plain[0].token and banned[0].token == plain[0].top_logprobs[1].token
    raw = client.completions.create(model=ALIAS, prompt="The", max_tokens=2, temperature=0, logprobs=1,
                                    logit_bias={str(forced): 100}, extra_body={"return_tokens_as_token_ids": True})
    assert raw.choices[0].logprobs.tokens == [f"token_id:{forced}"] * 2


@pytest.mark.parametrize("bias, words", [
    ({"x": 1}, "token ids"), ({"-1": 1}, "in [0, 49152)"), ({"49152": 1}, "in [0, 49152)"),
    ({"5": 100.5}, "[-100, 100]"), ({str(i): 1 for i in range(1025)}, "at most 1024"),
])
def test_logit_bias_limits(client, bias, words):
    for create in (lambda: client.chat.completions.create(model=ALIAS, messages=MSGS, max_tokens=1, logit_bias=bias),
                   lambda: client.completions.create(model=ALIAS, prompt="Hi", max_tokens=1, logit_bias=bias)):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.body["param"] == "logit_bias" and words in e.value.message


def _sse(response) -> list[dict]:
    import json

    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_token_ids_and_timestamps_buffered_and_streamed(http, frontend):
    body = {"model": ALIAS, "messages": MSGS, "max_tokens": 12, "temperature": 0, "n": 2,
            "return_token_ids": True, "return_token_timestamps": True}
    full = http.post("/v1/chat/completions", json=body).json()
    usage = full["usage"]
    assert len(full["prompt_token_ids"]) == usage["prompt_tokens"]
    assert sum(len(c["token_ids"]) for c in full["choices"]) == usage["completion_tokens"]
    for c in full["choices"]:
        times = c["token_timestamps"]
        assert len(times) == len(c["token_ids"]) and times == sorted(times) and times[0] > 0
        ids = [t for t in c["token_ids"] if t not in frontend[0].tokenizer.eos_token_ids]
        assert frontend[1].decode(ids, skip_special_tokens=True) == c["message"]["content"]
    # streamed without a usage chunk: ids spread over the chunks, prompt ids first, usage on the terminal chunks
    chunks = _sse(http.post("/v1/chat/completions", json={**body, "stream": True, "return_token_timestamps": False}))
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:]) and all(c["choices"] for c in chunks)
    for i, choice in enumerate(full["choices"]):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == i]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        assert all("token_timestamps" not in c for c in mine)
    terminal = [chunk for chunk in chunks if chunk["choices"][0]["finish_reason"] is not None]
    last = terminal[-1]["usage"]  # (the repeated prompt now reuses cached pages)
    assert len(terminal) == 2 and {k: last[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == \
        {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert all("usage" not in chunk for chunk in chunks if chunk not in terminal)
