"""helios serve as a router's backend (issue 23): the vLLM-named gauges an llm-d / Gateway API Inference Extension
endpoint picker scrapes, and vLLM's render routes, against the real `tight_server` (one model slot, a
one-request queue) so a second request waits while the first runs."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

LONG = {"prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "ignore_eos": True, "stream": True}
GENERATE_REQUEST_FIELDS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                           "stream_options", "cache_salt", "priority", "kv_transfer_params"}
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        "max_tokens": 5, "temperature": 0.5, "seed": 7, "stop": ["xyz"]}


def _scrape(url: str) -> dict[str, list]:
    """Metric family name -> its samples, from one Prometheus text scrape."""
    text = httpx.get(url + "/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(families: dict[str, list], name: str) -> float:
    (sample,) = families[name]
    return sample.value


def _hold_stream(url: str, started: threading.Event, stop: threading.Event) -> None:
    """Stream LONG until `stop`; `started` once its first line arrives (a queued stream sends none)."""
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=LONG) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


def _scrape_until(url: str, predicate, what: str, timeout_s: float = 30.0) -> dict[str, list]:
    """The first scrape whose families satisfy `predicate`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate(families := _scrape(url)):
            return families
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_vllm_gauges_follow_the_engine(tight_server):
    url = tight_server.url
    stop, first, second = threading.Event(), threading.Event(), threading.Event()
    holders = [threading.Thread(target=_hold_stream, args=(url, first, stop))]
    holders[0].start()
    try:
        assert first.wait(60)
        holders.append(threading.Thread(target=_hold_stream, args=(url, second, stop)))
        holders[1].start()
        busy = _scrape_until(url, lambda f: _value(f, "vllm:num_requests_waiting") == 1, "the second request to queue")
        assert _value(busy, "vllm:num_requests_running") == 1 == _value(busy, "flare_active_requests")
        assert _value(busy, "flare_pending_requests") == 1
        total, free = _value(busy, "flare_total_kv_pages"), _value(busy, "flare_free_kv_pages")
        usage = _value(busy, "vllm:kv_cache_usage_perc")
        assert 0 < usage <= 1 and usage == (total - free) / total
        assert _value(busy, "vllm:gpu_cache_usage_perc") == usage
        (info,) = busy["vllm:cache_config_info"]
        assert info.value == 1 and info.labels == {"block_size": str(int(_value(busy, "flare_kv_page_tokens"))),
                                                   "num_gpu_blocks": str(int(total))}
        (lora,) = busy["vllm:lora_requests_info"]
        assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert abs(lora.value - time.time()) < 60
    finally:
        stop.set()
        for t in holders:
            t.join(60)
    drained = ("vllm:num_requests_running", "vllm:num_requests_waiting", "flare_http_admission_slots_in_use")
    idle = _scrape_until(url, lambda f: all(_value(f, name) == 0 for name in drained), "the aborted streams to drain")
    assert _value(idle, "vllm:kv_cache_usage_perc") == 0.0  # every page free (prefix-cached ones are evictable)


def test_chat_render_is_the_prompt_chat_completions_prefills(tight_server):
    url = tight_server.url
    before = httpx.get(url + "/metrics?format=json").json()
    r = httpx.post(url + "/v1/chat/completions/render", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    rendered = r.json()
    after = httpx.get(url + "/metrics?format=json").json()
    assert (after["completed"], after["prefill_tokens"]) == (before["completed"], before["prefill_tokens"])
    assert set(rendered) == GENERATE_REQUEST_FIELDS and rendered["request_id"].startswith("chatcmpl-")
    assert rendered["features"] is None and rendered["stream"] is False and rendered["priority"] == 0
    params = rendered["sampling_params"]
    assert (params["n"], params["max_tokens"], params["seed"], params["stop"]) == (1, 5, 7, ["xyz"])
    generated = httpx.post(url + "/v1/chat/completions", json={**CHAT, "return_token_ids": True}, timeout=60)
    assert generated.status_code == 200, generated.text
    assert rendered["token_ids"] == generated.json()["prompt_token_ids"]
    streamed = httpx.post(url + "/v1/chat/completions/render", timeout=60,
                          json={**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}).json()
    assert streamed["token_ids"] == rendered["token_ids"] and streamed["sampling_params"]["n"] == 3
    assert streamed["stream"] is True
    assert streamed["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


def test_completions_render_returns_one_request_per_prompt(tight_server, frontend):
    _, tok, _ = frontend
    prompts = ["Hello there", "The sky is", "Once upon a time"]
    r = httpx.post(tight_server.url + "/v1/completions/render",
                   json={"prompt": prompts, "n": 2, "max_tokens": 0, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert [x["token_ids"] for x in rendered] == [tok.encode(p) for p in prompts]
    assert all(set(x) == GENERATE_REQUEST_FIELDS and x["request_id"].startswith("cmpl-") for x in rendered)
    assert len({x["request_id"] for x in rendered}) == 3
    assert all(x["sampling_params"]["n"] == 2 and x["sampling_params"]["max_tokens"] == 0 for x in rendered)
    assert all(x["stream"] is True and x["stream_options"] is None for x in rendered)
    r = httpx.post(tight_server.url + "/v1/completions/render", json={"prompt": [[1, 2, 3], [4]]}, timeout=60)
    assert [x["token_ids"] for x in r.json()] == [[1, 2, 3], [4]]


def test_bad_render_requests_are_400_in_the_openai_shape(tight_server):
    url = tight_server.url
    for path, body, param in (("/v1/chat/completions/render", {"messages": "hi"}, "messages"),
                              ("/v1/chat/completions/render", {**CHAT, "n": 0}, "n"),
                              ("/v1/completions/render", {"prompt": 5}, "prompt"),
                              ("/v1/completions/render", {"prompt": "x", "logprobs": 99}, "logprobs")):
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert httpx.get(url + "/v1/completions/render").status_code == 405
