"""A hybrid core served for real: the tiny qwen3_5 checkpoint exported by `ignition export`, `helios serve` on
127.0.0.1, the official openai SDK as the client. Completions equal the engine's tokens run in-process, concurrent
streams equal the same requests one by one, /metrics reports the state slots, and every slot is back after."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from tests.models.hybrid_tiny import build_hybrid
from tests.server.conftest import ROOT, _stop, serve_core


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    src = build_hybrid("qwen3_5", tmp / "hf")
    core = tmp / "core"
    subprocess.run([sys.executable, "-m", "ignition.cli", "export", str(src), "-o", str(core), "--dtype", "float32",
                    "--prompt-logprobs"],  # scored prompts: a run without prefix reuse
                   cwd=ROOT, check=True, capture_output=True)
    config = tmp / "server.toml"
    config.write_text("[server]\nmax_concurrency = 4\n", encoding="utf-8")
    proc, url = serve_core(core, config, tmp / "serve.log")
    yield url
    _stop(proc)


def test_completions_are_deterministic_and_independent_of_concurrency(hybrid_server):
    import openai

    client = openai.OpenAI(base_url=hybrid_server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    prompts = [f"the cat sat on the mat {i} " * (1 + 3 * i) for i in range(6)]
    alone = [client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0).choices[0].text
             for p in prompts]
    assert all(alone)

    async def together():
        aclient = openai.AsyncOpenAI(base_url=hybrid_server + "/v1", api_key="none")

        async def one(p):
            stream = await aclient.completions.create(model=model, prompt=p, max_tokens=24, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(together()) == alone
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8


def test_a_second_turn_reuses_the_first_turns_state(hybrid_server):
    import openai

    client = openai.OpenAI(base_url=hybrid_server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 10}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 64 == 0  # a checkpoint on the grid lcm(page 16, chunk 64)
    text = httpx.get(hybrid_server + "/metrics").text
    assert 'flare_checkpoint_captures_total{role="endpoint"}' in text


def test_metrics_report_the_state_slots_all_free_after(hybrid_server):
    metrics = httpx.get(hybrid_server + "/metrics", params={"format": "json"}).json()
    # 4 running slots and 4 checkpoint slots (state_checkpoints: as many as max_concurrency); only checkpoints held
    assert metrics["state_slots_total"] == 8 and metrics["state_slots_in_use"] == metrics["checkpoints_held"]
    text = httpx.get(hybrid_server + "/metrics").text
    assert "flare_state_slots_total 8" in text


def test_a_message_checkpoint_is_reused_when_the_last_message_changes(hybrid_server):
    """Two chats that share their first two messages: the second resumes at the message checkpoint the first left at
    the end of its assistant message (the endpoint of the first lies inside its last message, which the second does
    not share), and answers what a run without reuse (prompt_logprobs: no prefix reuse) answers."""
    import openai

    client = openai.OpenAI(base_url=hybrid_server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="warm up " * 20, max_tokens=1)  # a measured prefill rate
    shared = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 3},
              {"role": "assistant", "content": "the cat sat on the mat; the dog sat on the log. " * 5}]
    numbers = "one two three four five six seven eight nine ten " * 2

    def captures() -> int:
        snap = httpx.get(hybrid_server + "/metrics", params={"format": "json"}).json()
        return snap["checkpoint_captures"].get("message", 0)

    before = captures()
    client.chat.completions.create(model=model, messages=[*shared, {"role": "user", "content": "first: " + numbers}],
                                   max_tokens=4, temperature=0)
    assert captures() > before
    question = {"role": "user", "content": "second: " + numbers}
    second = client.chat.completions.create(model=model, messages=[*shared, question], max_tokens=8, temperature=0)
    cached, num_prompt = second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens
    # past the first message's end (< 128 tokens), short of the new question (its ~70 tokens)
    assert 128 <= cached < num_prompt - 64 and cached % 64 == 0
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in [*shared, question])
    alone = client.completions.create(model=model, prompt=text + "<|im_start|>assistant\n", max_tokens=8,
                                      temperature=0, extra_body={"prompt_logprobs": 0})
    assert alone.usage.prompt_tokens == num_prompt and alone.usage.prompt_tokens_details.cached_tokens == 0
    assert alone.choices[0].text == second.choices[0].message.content


def test_an_anthropic_cache_control_hint_is_a_message_checkpoint_candidate(hybrid_server):
    """Messages: a user message whose first text block carries cache_control. Its end is a message candidate (the
    request has no other: no system prompt, one message, its endpoint inside the second block), so a request with the
    same first block and another second one resumes there; without the hint it would reuse nothing."""
    model = httpx.get(hybrid_server + "/v1/models").json()["data"][0]["id"]
    numbers = "one two three four five six seven eight nine ten " * 2

    def ask(tail: str, hinted: bool = True) -> dict:
        head = {"type": "text", "text": "hello world! how are you today? " * 4}
        if hinted:
            head["cache_control"] = {"type": "ephemeral"}
        body = {"model": model, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": [head, {"type": "text", "text": tail + numbers}]}]}
        response = httpx.post(hybrid_server + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"},
                              timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    ask("first: ", hinted=False)
    assert ask("second: ", hinted=False)["cache_read_input_tokens"] == 0
    ask("third: ")
    usage = ask("fourth: ")
    assert usage["cache_read_input_tokens"] >= 64 and usage["cache_read_input_tokens"] % 64 == 0
