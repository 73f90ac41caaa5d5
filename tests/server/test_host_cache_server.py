"""The prefix cache's host DRAM tier on a real `helios serve` (the default core, CPU): a long chat prompt whose
pages other traffic evicts from the GPU pool comes back from the host store, with the same answer.

NOTE: on the CPU the pool holds at least the core's context length (8192 tokens), so the other traffic is ~9k
prompt tokens: the cost of this test (about 20 s on two cores).
"""

from __future__ import annotations

import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import CORE, _stop, serve_core

ALIAS = "smollm2-135m-instruct"
POOL_TOKENS = 8192  # kv_cache_tokens below the context length still gives a pool of the context length
WORDS = ("river stone cloud market silver garden window harbor lantern meadow orchard bridge candle forest "
         "pepper violin engine castle dragon planet rocket saddle tunnel whistle anchor basket cotton desert").split()


def long_messages(seed: int, num_words: int) -> list[dict]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(num_words))
    # a fresh nonce in the first page: no two prompts share a page
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex}. Notes: {text}"},
            {"role": "user", "content": "Which word comes up most often in the notes?"}]


def chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": ALIAS, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_evicted_prompt_comes_back_from_the_host_store(tmp_path):
    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    config = tmp_path / "helios.toml"
    # 512 MiB: ~700 float32 pages of this core, more than the traffic below evicts
    config.write_text("[server]\nkv_cache_tokens = 2048\nhost_cache_bytes = 536870912\n", encoding="utf-8")
    proc, url = serve_core(CORE, config, tmp_path / "serve.log")
    try:
        first_messages = long_messages(0, 500)
        first = chat(url, first_messages, 8)
        num_prompt = first["usage"]["prompt_tokens"]
        assert num_prompt > 400 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # other prompts, four at a time, until more tokens than the whole pool went through it
        with ThreadPoolExecutor(4) as pool:
            others = list(pool.map(lambda seed: chat(url, long_messages(seed, 520), 1), range(1, 17)))
        assert sum(o["usage"]["prompt_tokens"] for o in others) > POOL_TOKENS + num_prompt
        before = httpx.get(url + "/metrics?format=json").json()
        assert before["host_memory_records"] > 0 and before["host_bytes_out"] > 0 and before["host_hits"] == 0
        again = chat(url, first_messages, 8)
        after = httpx.get(url + "/metrics?format=json").json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(f"prompt {num_prompt} tokens, cached {cached}, host records {after['host_memory_records']}, "
              f"bytes in {after['host_bytes_in']}, out {after['host_bytes_out']}")
        assert cached == (num_prompt - 1) // 16 * 16  # every reusable page, from the host store
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert after["host_hits"] >= 1 and after["host_reused_tokens"] >= cached and after["host_bytes_in"] > 0
    finally:
        _stop(proc)


def test_an_evicted_prompt_comes_back_from_disk_and_after_a_restart(tmp_path):
    """48 DRAM records (~35 MiB of float32 pages, more than the prompt's ~37 pages, which a load needs) cannot hold
    what the other traffic evicts: the prompt's records spill to the disk directory, come back from it, and a
    restarted server on that directory serves the prompt's first request from disk. The traffic above and a
    quarter more (~12 k prompt tokens; only what overflows the 8192-token pool is evicted: ~100 records, ~80 MB, written)."""
    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    config = tmp_path / "helios.toml"
    disk = tmp_path / "records"
    config.write_text(f"[server]\nkv_cache_tokens = 2048\nhost_cache_bytes = {48 * 737280}\n"
                      f"host_disk_dir = '{disk}'\nhost_disk_bytes = 1073741824\n", encoding="utf-8")
    proc, url = serve_core(CORE, config, tmp_path / "serve.log")
    try:
        first_messages = long_messages(0, 500)
        first = chat(url, first_messages, 8)
        num_prompt = first["usage"]["prompt_tokens"]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda seed: chat(url, long_messages(seed, 520), 1), range(1, 21)))
        before = httpx.get(url + "/metrics?format=json").json()
        print(f"prompt {num_prompt} tokens, disk records {before['host_disk_records']}")
        assert before["host_disk_records"] > 48 and before["host_memory_records"] == 48
        again = chat(url, first_messages, 8)
        after = httpx.get(url + "/metrics?format=json").json()
        num_reusable = (num_prompt - 1) // 16 * 16
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == num_reusable
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert after["host_disk_records"] > 0 and after["host_hits"] >= 1
        text = httpx.get(url + "/metrics").text
        assert "flare_host_cache_disk_records" in text
    finally:
        _stop(proc)
    records = [p for d in disk.iterdir() for p in d.iterdir()]
    assert len(records) == after["host_disk_records"]
    proc, url = serve_core(CORE, config, tmp_path / "serve2.log")
    try:
        assert httpx.get(url + "/metrics?format=json").json()["host_disk_records"] == len(records)
        restarted = chat(url, first_messages, 8)
        assert restarted["usage"]["prompt_tokens_details"]["cached_tokens"] == num_reusable
        assert restarted["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    finally:
        _stop(proc)
