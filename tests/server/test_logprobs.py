"""Logprobs served over HTTP equal the model's own log-softmax (computed directly by the runner)."""

from __future__ import annotations

import math

import pytest

from helios.frontend.chat import ChatMessage

ALIAS = "smollm2-135m-instruct"
TOL = 2e-3


def _ids(strings):
    return [int(s.removeprefix("token_id:")) for s in strings]


def test_completion_logprobs_match_the_runner(client, frontend, reference):
    _, tok, _ = frontend
    prompt = tok.encode("The capital of France is")
    r = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=6, logprobs=3, seed=2,
                                  extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    lp = r.choices[0].logprobs
    gen = _ids(lp.tokens)
    assert len(gen) == 6 == r.usage.completion_tokens
    ref = reference(prompt + gen)
    for k, (tid, value, top) in enumerate(zip(gen, lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(prompt) - 1 + k]
        assert value == pytest.approx(row[tid].item(), abs=TOL)
        best = row.topk(3)
        assert _ids(list(top)[:3]) == best.indices.tolist()  # natural alternatives in order
        assert f"token_id:{tid}" in top  # the chosen token is always included
    assert lp.text_offset[0] == 0


def test_chat_logprobs_match_the_runner(client, frontend, reference):
    _, tok, chat = frontend
    msgs = [{"role": "user", "content": "Name a color."}]
    r = client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=5, logprobs=True, top_logprobs=2,
                                       seed=4, extra_body={"return_tokens_as_token_ids": True})
    content = r.choices[0].logprobs.content
    prompt = chat.render([ChatMessage(role="user", content="Name a color.")]).token_ids
    assert len(prompt) == r.usage.prompt_tokens
    gen = _ids([e.token for e in content])
    ref = reference(prompt + gen)
    text = b""
    for k, e in enumerate(content):
        row = ref[len(prompt) - 1 + k]
        assert e.logprob == pytest.approx(row[gen[k]].item(), abs=TOL)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=TOL)
        assert bytes(e.bytes) == tok.token_bytes[gen[k]]
        text += bytes(e.bytes)
    if r.choices[0].finish_reason == "length":
        assert text.decode("utf-8", "replace") == r.choices[0].message.content


def test_chat_logprobs_plain_tokens_and_stream(client):
    kw = dict(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=True,
              top_logprobs=1, seed=9)
    buffered = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in buffered]
    assert "".join(e.token for e in buffered)


def test_echo_prompt_logprobs_line_up(client, frontend, reference):
    _, tok, _ = frontend
    text = "The capital of France is"
    prompt = tok.encode(text)
    r = client.completions.create(model=ALIAS, prompt=text, max_tokens=3, echo=True, logprobs=2, seed=1,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    n = len(prompt)
    assert len(lp.tokens) == n + 3
    assert "".join(lp.tokens[:n]) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]
    assert lp.text_offset[n] == len(text)
    ref = reference(prompt)
    for p in range(1, n):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1][prompt[p]].item(), abs=TOL)
    pl = c.model_dump()["prompt_logprobs"]
    assert pl[0] is None and len(pl) == n
    entry = pl[1][str(prompt[1])]
    assert entry["decoded_token"] == tok.token_text(prompt[1])
    assert entry["rank"] == 1 + int((ref[0] > ref[0][prompt[1]]).sum())


def test_max_tokens_zero_scores_the_prompt(client, frontend):
    _, tok, _ = frontend
    r = client.completions.create(model=ALIAS, prompt="Hello world, how are you", max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    n = len(tok.encode("Hello world, how are you"))
    assert c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == n and all(v is not None for v in c.logprobs.token_logprobs[1:])
    assert all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])  # logprobs 0: the actual token only


def test_prompt_logprobs_field_and_stream_rejection(client, http):
    r = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       extra_body={"prompt_logprobs": 1})
    pl = r.model_dump()["prompt_logprobs"]
    assert pl[0] is None and len(pl) == r.usage.prompt_tokens
    assert all(1 <= len(e) <= 2 and all(math.isfinite(v["logprob"]) for v in e.values()) for e in pl[1:])
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                   "prompt_logprobs": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


def test_explicit_logprob_token_ids(client, frontend, reference):
    _, tok, _ = frontend
    prompt = tok.encode("The capital of France is")
    wanted = [tok.encode(" Paris", add_special_tokens=False)[0], tok.encode(" London", add_special_tokens=False)[0]]
    r = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=1, logprobs=0, seed=0,
                                  extra_body={"logprob_token_ids": wanted + wanted[:1],
                                              "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    top = lp.top_logprobs[0]
    ref = reference(prompt)[-1]
    for t in wanted:
        assert top[f"token_id:{t}"] == pytest.approx(ref[t].item(), abs=TOL)
    assert len(top) <= 3


def test_logprob_limits_are_400(http):
    for body in ({"prompt": "x", "logprobs": 21}, {"prompt": "x", "logprob_token_ids": [1]},
                 {"prompt": "x", "logprobs": 0, "logprob_token_ids": [10**6]}):
        assert http.post("/v1/completions", json=body).status_code == 400, body
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}).status_code == 400
    assert http.post("/v1/chat/completions", json={**chat, "max_tokens": 0}).status_code == 400
