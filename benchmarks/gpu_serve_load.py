"""Served load: `helios serve` under 1 to 512 concurrent streams against the engine alone, in the same run.

Workloads (seeded): `fixed`, a 121-token prompt and exactly 128 new tokens (ignore_eos); `sharegpt`, prompt and
output lengths drawn from log-normal distributions shaped like ShareGPT conversations (prompt median ~200 tokens,
output median ~180, clipped), no dataset needed. Every stream is a closed loop: a streaming request (/v1/completions,
or /v1/chat/completions with --api chat), read to [DONE], then the next at once, for --seconds per level; a probe
request with max_tokens=1 every 0.5 s beside the load gives the TTFT a newcomer sees.

1. The engine alone (the served core, its runner and scheduler on this process's main thread, as `helios serve`
   runs them): the same requests, prepared by the same frontend code, the same closed loop at each stream count.
2. `helios serve` (a subprocess on 127.0.0.1, the given [server] settings): the load from several client processes
   (a raw HTTP/1.1 keep-alive client per stream: no SDK in the way at 30k events/s). Per level: output tok/s,
   TTFT/ITL/end-to-end p50 and p99, the probe's TTFT, errors, the average decode batch and GPU-busy fraction from
   /metrics deltas, and whether every KV page and slot came back after the level drained.
Usage: python benchmarks/gpu_serve_load.py --device cuda --core /tmp/serve/core-8b [--streams 1,16,64,256,512]
       (the core benchmarks/gpu_serve_start.py --work /tmp/serve exports: random bf16 8B weights, kernels)
       python benchmarks/gpu_serve_load.py --device cpu   (the default SmolLM2 core, levels 1,4,8)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROBE_INTERVAL_S = 0.5
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain garden window music story letter").split()


# --- the workload --------------------------------------------------------------------------------


def lengths(workload: str, count: int, seed: int, prompt_tokens: int, max_tokens: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request, seeded."""
    if workload == "fixed":
        return [(prompt_tokens, max_tokens)] * count
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        p = int(min(max(rng.lognormvariate(math.log(200), 0.9), 8), 1500))
        o = int(min(max(rng.lognormvariate(math.log(180), 0.8), 4), 1024))
        out.append((p, o))
    return out


def prompt_ids(tokenizer, n: int, salt: int) -> list[int]:
    """n ordinary-word token ids, different per salt (no shared prefix beyond chance)."""
    rng = random.Random(salt)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(64)))
    return ids[:n]


def word_bias(tokenizer, count: int) -> dict[str, float]:
    """logit_bias +100 on `count` whole-word ASCII tokens: a random-weight model then writes words, so every
    token is text at once (random byte tokens are often held back as incomplete UTF-8, hiding TTFT and ITL)."""
    bias = {}
    for token_id in range(tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 50000):
        if len(bias) >= count:
            break
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:].isascii() and text[1:].isalpha() and 3 <= len(text) <= 9:
            bias[str(token_id)] = 100.0
    return bias


BIAS: dict[str, float] = {}


def body(api: str, ids: list[int], text: str, max_tokens: int, stream: bool = True) -> dict:
    common = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if BIAS:
        common["logit_bias"] = BIAS
    if stream:
        common["stream_options"] = {"include_usage": True}
    if api == "chat":
        return {**common, "messages": [{"role": "user", "content": text}]}
    return {**common, "prompt": ids}


# --- the engine alone ----------------------------------------------------------------------------


def engine_only(core_dir: Path, server_toml: dict, levels: list[int], seconds: float, work: list, api: str) -> dict:
    """Closed-loop tok/s of the engine at each stream count, on this thread (as helios serve steps it)."""
    import msgspec

    from helios.compose import build_runtime
    from helios.server.config import ServerConfig
    from helios.server.protocols import openai_chat, openai_completions

    config = ServerConfig(**server_toml)
    runtime = build_runtime(core_dir, config, own_thread=False)
    core = runtime.engine.core
    protocol = openai_chat if api == "chat" else openai_completions
    prepared = [protocol.prepare(msgspec.json.encode(body(api, ids, text, o, stream=False)), runtime.model)
                for ids, text, o in work]
    results = {}
    serial = 0
    for n in levels:
        def add(i: int) -> None:
            nonlocal serial
            serial += 1
            req = prepared[i % len(prepared)].children[0].request
            core.add_request(msgspec.structs.replace(req, req_id=f"e{serial}"))
        for i in range(n):
            add(serial)
        warm_until = time.perf_counter() + min(3.0, seconds / 4)
        while time.perf_counter() < warm_until:  # the level's steady state first (not timed)
            for out in core.step():
                if out.finished:
                    add(serial)
        tokens = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for out in core.step():
                tokens += len(out.new_token_ids)
                if out.finished:
                    add(serial)
        elapsed = time.perf_counter() - t0
        while core.has_unfinished_requests():  # drain what is left (not timed, nothing added)
            core.step()
        results[n] = tokens / elapsed
        print(f"engine alone, {n:4d} streams: {results[n]:9.1f} tok/s", flush=True)
    runtime.engine.shutdown()
    del runtime, core
    return results


def _engine_child(queue, bias, *args) -> None:
    BIAS.update(bias)  # a spawned child: the parent's module state is not inherited
    queue.put(engine_only(*args))


# --- the HTTP client -----------------------------------------------------------------------------


async def _request(reader, writer, path: str, payload: bytes):
    """One POST on a keep-alive connection; yields (time, event bytes) per SSE data event, then the status."""
    writer.write(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (path.encode(), len(payload)) + payload)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    events = []
    if b"transfer-encoding: chunked" in headers:
        buf = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            chunk = await reader.readexactly(size + 2)
            now = time.perf_counter()
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                events.append((now, event))
    else:
        length = int(headers.split(b"content-length:")[1].split(b"\r\n")[0])
        events.append((time.perf_counter(), await reader.readexactly(length)))
    return status, events


async def _stream_loop(host: str, port: int, path: str, payloads: list[bytes], deadline: float, out: list) -> None:
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    k = 0
    try:
        while time.perf_counter() < deadline:
            payload = payloads[k % len(payloads)]
            k += 1
            sent = time.perf_counter()
            try:
                status, events = await _request(reader, writer, path, payload)
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                out.append(("error", repr(e)))
                writer.close()
                reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
                continue
            if status != 200 or not events or events[-1][1] != b"data: [DONE]":
                out.append(("error", f"status {status}, {len(events)} events"))
                continue
            # token events carry choices; the usage event (include_usage) has none
            times = [t for t, e in events if e.startswith(b"data: {") and b'"choices":[]' not in e]
            last = next((json.loads(e[6:]) for _, e in reversed(events) if b'"choices":[]' in e), None)
            num = (last or {}).get("usage") or {}
            out.append(("ok", sent, times, events[-1][0], num.get("completion_tokens", len(times))))
    finally:
        writer.close()


async def _probe_loop(host: str, port: int, path: str, payload: bytes, deadline: float, out: list) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        status, events = await _request(reader, writer, path, payload)
        if status == 200 and len(events) > 1:
            out.append(events[0][0] - t0)
        await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - (time.perf_counter() - t0)))
    writer.close()


def _client_process(host, port, path, payloads, streams, deadline, probe, queue) -> None:
    async def main():
        out, probes = [], []
        tasks = [_stream_loop(host, port, path, payloads[i::max(1, streams)] or payloads, deadline, out)
                 for i in range(streams)]
        if probe is not None:
            tasks.append(_probe_loop(host, port, path, probe, deadline, probes))
        await asyncio.gather(*tasks, return_exceptions=True)
        return out, probes
    queue.put(asyncio.run(main()))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics?format=json", timeout=10) as r:
        return json.loads(r.read())


def served_level(url: str, host: str, port: int, path: str, payloads: list[bytes], probe: bytes, streams: int,
                 seconds: float, procs: int) -> dict:
    procs = max(1, min(procs, streams))
    start = time.perf_counter()
    warm = min(3.0, seconds / 4)
    deadline = start + warm + seconds
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    workers = []
    for p in range(procs):
        n = streams // procs + (p < streams % procs)
        workers.append(ctx.Process(target=_client_process, args=(host, port, path, payloads[p::procs], n, deadline,
                                                                 probe if p == 0 else None, queue)))
    for w in workers:
        w.start()
    # the level's throughput: generated tokens over its steady part, from the engine's counters (the engine
    # alone is timed the same way: after a warm period, over `seconds`)
    time.sleep(max(0.0, start + warm - time.perf_counter()))
    before, t1 = metrics(url), time.perf_counter()
    time.sleep(max(0.0, deadline - time.perf_counter()))
    steady, t2 = metrics(url), time.perf_counter()
    results = [queue.get() for _ in workers]
    for w in workers:
        w.join()
    wall = time.perf_counter() - start
    after = metrics(url)
    for _ in range(100):  # drained: every page and slot back
        if after["active"] == 0 and after["pending"] == 0:
            break
        time.sleep(0.1)
        after = metrics(url)
    records = [r for out, _ in results for r in out]
    probes = [p for _, ps in results for p in ps]
    ok = [r for r in records if r[0] == "ok"]
    errors = [r for r in records if r[0] == "error"]
    ttft = [r[2][0] - r[1] for r in ok if r[2]]
    itl = [b - a for r in ok for a, b in zip(r[2], r[2][1:])]
    e2e = [r[3] - r[1] for r in ok]
    steps = steady["verify_steps"] - before["verify_steps"]
    generated = steady["generated_tokens"] - before["generated_tokens"]
    return {
        "tok_s": generated / (t2 - t1), "client_tok_s": sum(r[4] for r in ok) / wall, "requests": len(ok), "errors": len(errors), "error_sample": errors[:2],
        "ttft": (pct(ttft, 0.5), pct(ttft, 0.99)), "itl": (pct(itl, 0.5), pct(itl, 0.99)),
        "e2e": (pct(e2e, 0.5), pct(e2e, 0.99)), "probe": (pct(probes, 0.5), pct(probes, 0.99)),
        "batch": generated / steps if steps else float("nan"),
        "busy": (steady["replay_gpu_ns"] - before["replay_gpu_ns"]) / 1e9 / (t2 - t1),
        "pages_ok": after["free_pages"] == after["total_pages"] and after["active"] == 0 and after["pending"] == 0,
        "launches": {k: steady["graph_launches"].get(k, 0) - before["graph_launches"].get(k, 0)
                     for k in steady["graph_launches"]},
    }


# --- main ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--core", type=Path, help="a core (cuda default: build the random 8B one)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "serve-load")
    parser.add_argument("--streams", help="comma-separated stream counts")
    parser.add_argument("--seconds", type=float, help="seconds per level")
    parser.add_argument("--workload", choices=["fixed", "sharegpt"], default="fixed")
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--prompt-tokens", type=int, default=121)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--max-concurrency", type=int, default=256, help="[server] max_concurrency (model slots)")
    parser.add_argument("--http-workers", type=int, default=0, help="[server] http_workers (0: the default)")
    parser.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--word-bias", type=int, help="logit_bias +100 on N word tokens (default: 64 on cuda, "
                        "whose core has random weights; 0 on cpu)")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    levels = [int(x) for x in (args.streams or ("1,16,64,256,512" if gpu else "1,4,8")).split(",")]
    seconds = args.seconds or (20.0 if gpu else 30.0)
    max_tokens = args.max_tokens or (128 if gpu else 64)
    if gpu and args.core is None:
        raise SystemExit("--device cuda needs --core: the 8B core benchmarks/gpu_serve_start.py exports "
                         "(--work W leaves it in W/core-8b)")
    core_dir = args.core or ROOT / "cores/build/smollm2-135m-instruct"
    server_toml = {"max_concurrency": args.max_concurrency, "max_waiting": 4096,
                   "max_num_batched_tokens": 8192 if gpu else 2048, "http_workers": args.http_workers,
                   "kv_cache_tokens": 65536}

    from helios.core.load import read_manifest
    from helios.frontend.tokenizer import Tokenizer

    manifest = read_manifest(core_dir)
    tokenizer = Tokenizer.from_file(core_dir / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    BIAS.update(word_bias(tokenizer, args.word_bias if args.word_bias is not None else (64 if gpu else 0)))
    pairs = lengths(args.workload, 4096, args.seed, args.prompt_tokens, max_tokens)
    work = []
    for i, (p, o) in enumerate(pairs[:1024]):
        ids = prompt_ids(tokenizer, p, args.seed * 100003 + i)
        work.append((ids, tokenizer.decode(ids), o))
    print(f"core {core_dir.name}, {args.workload} workload, {args.api}, levels {levels}, {seconds:.0f} s each, "
          f"{max_tokens} new tokens (fixed), {args.client_procs} client processes", flush=True)

    engine = {}
    if not args.skip_engine:  # in a child process, so its GPU memory is free again before the server starts
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_engine_child,
                            args=(queue, dict(BIAS), core_dir, server_toml, levels, seconds, work, args.api))
        child.start()
        engine = queue.get()
        child.join()

    config = args.work / "server.toml"
    args.work.mkdir(parents=True, exist_ok=True)
    config.write_text("[server]\n" + "".join(f"{k} = {v}\n" for k, v in server_toml.items()
                                               if not (k == "http_workers" and v == 0)))
    port = free_port()
    log = args.work / "serve.log"
    helios = [sys.executable, "-c", "from helios.cli import app; app()"]
    proc = subprocess.Popen([*helios, "serve", str(core_dir), "--config", str(config), "--port", str(port)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"helios serve did not start:\n{log.read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        print(next((l for l in log.read_text().splitlines() if "ready" in l), "")[:400], flush=True)
        path = "/v1/chat/completions" if args.api == "chat" else "/v1/completions"
        payloads = [json.dumps(body(args.api, ids, text, o)).encode() for ids, text, o in work]
        probe = json.dumps(body(args.api, work[0][0], work[0][1], 1)).encode()
        rows = []
        for n in levels:
            r = served_level(url, "127.0.0.1", port, path, payloads, probe, n, seconds, args.client_procs)
            ratio = r["tok_s"] / engine[n] if n in engine else float("nan")
            rows.append((n, r, engine.get(n, float("nan")), ratio))
            print(f"served {n:4d} streams: {r['tok_s']:9.1f} tok/s ({ratio:.2f} of the engine alone; clients counted "
                  f"{r['client_tok_s']:.1f} over the whole level), "
                  f"{r['requests']} requests, {r['errors']} errors {r['error_sample'] or ''}, TTFT p50/p99 "
                  f"{r['ttft'][0]*1e3:.0f}/{r['ttft'][1]*1e3:.0f} ms, ITL {r['itl'][0]*1e3:.1f}/{r['itl'][1]*1e3:.1f} "
                  f"ms, E2E {r['e2e'][0]:.2f}/{r['e2e'][1]:.2f} s, probe TTFT {r['probe'][0]*1e3:.0f}/"
                  f"{r['probe'][1]*1e3:.0f} ms, decode batch {r['batch']:.1f}, GPU busy {r['busy']:.0%}, "
                  f"launches {r['launches']}, pages {'OK' if r['pages_ok'] else 'LEAK'}", flush=True)
        print("\n| streams | served tok/s | engine tok/s | served/engine | TTFT p50/p99 ms | ITL p50/p99 ms | "
              "E2E p50/p99 s | probe TTFT p99 ms | errors | pages |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for n, r, e, ratio in rows:
            print(f"| {n} | {r['tok_s']:.0f} | {e:.0f} | {ratio:.2f} | {r['ttft'][0]*1e3:.0f}/{r['ttft'][1]*1e3:.0f} | "
                  f"{r['itl'][0]*1e3:.1f}/{r['itl'][1]*1e3:.1f} | {r['e2e'][0]:.2f}/{r['e2e'][1]:.2f} | "
                  f"{r['probe'][1]*1e3:.0f} | {r['errors']} | {'OK' if r['pages_ok'] else 'LEAK'} |")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
