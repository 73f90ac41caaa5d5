"""HTTP serving benchmark on this machine: `helios serve` vs llama.cpp's OpenAI-compatible server, same run.

Both servers start here (random free ports on 127.0.0.1) on the same SmolLM2 weights: helios on its
prepared core, llama-cpp-python's `llama_cpp.server` on the GGUF the core was exported from. Each gets the
same workload, one server at a time (the other sits idle):

  streaming  N concurrent clients (default 8), each sending --rounds streaming chat completions in turn;
             the same prompts, temperature 0, the same max_tokens (llama.cpp also gets repeat_penalty 1.0).
             TTFT = request sent -> first content chunk; ITL = gaps between content chunks of one request;
             output tokens/s = content chunks of all requests / phase wall time (one chunk ~ one token).
  max_tokens=1  N concurrent clients sending buffered chat completions with max_tokens 1; requests/s.

Prints a table of ours vs the peer and stops both servers by pid. llama-cpp-python is a benchmark peer only
(the optional `bench` extra; nothing of helios imports it). On this machine (AMD EPYC, avx512_bf16, no AMX) it
was built from source into the venv, in about 15 minutes on 2 cores:

  CMAKE_ARGS="-DGGML_AMX=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TESTS=OFF" .venv/bin/pip install 'llama-cpp-python[server]==0.3.36'

(an earlier default build segfaulted here). The CPU serving core is the bfloat16 one
(`.venv/bin/ignition build cores/smollm2-135m-instruct-bf16.toml`); the float32 default core works too. Usage:

  .venv/bin/python benchmarks/serve.py [--clients 8] [--rounds 2] [--max-tokens 64] [--requests-1 64]
                                       [--core DIR] [--gguf FILE] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"
HELIOS = ROOT / ".venv" / "bin" / "helios"
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works, step by step.",
    "Describe the water cycle to a ten-year-old.",
    "List ten ideas for a rainy weekend and explain each one.",
    "Write a letter to a friend describing your favourite city.",
    "Explain the rules of chess to a beginner.",
    "Tell me about the history of the bicycle.",
    "Write a recipe for a simple vegetable soup with detailed steps.",
]


# --- servers ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    ready_path: str
    extra: dict = field(default_factory=dict)  # merged into every request body

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready in {timeout:.0f}s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_helios(core: Path, tmp: Path, threads: int) -> Server:
    config = tmp / "helios.toml"
    config.write_text("[server]\n", encoding="utf-8")
    port = free_port()
    log = tmp / "helios.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([str(HELIOS), "serve", str(core), "--config", str(config), "--port", str(port)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return Server("helios", f"http://127.0.0.1:{port}", proc, log, "/health")


def start_llama_cpp(gguf: Path, tmp: Path, threads: int, n_ctx: int) -> Server:
    port = free_port()
    log = tmp / "llama_cpp.log"
    args = [str(PY), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--seed", "0", "--verbose", "False",
            "--interrupt_requests", "False"]  # NOTE: its default cuts a running stream short when another request arrives
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    return Server("llama.cpp", f"http://127.0.0.1:{port}", proc, log, "/v1/models", {"repeat_penalty": 1.0})


# --- clients ----------------------------------------------------------------------------------

@dataclass
class StreamResult:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    chunks: int = 0


def body(server: Server, prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "seed": 0, "stream": stream, **server.extra}


async def one_stream(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> StreamResult:
    res = StreamResult()
    t0 = time.perf_counter()
    last = None
    async with client.stream("POST", server.url + "/v1/chat/completions",
                             json=body(server, prompt, max_tokens, True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{server.name}: stream error {event}")
            choices = event.get("choices") or []
            if not choices or not (choices[0].get("delta") or {}).get("content"):
                continue
            now = time.perf_counter()
            if last is None:
                res.ttft = now - t0
            else:
                res.gaps.append(now - last)
            last = now
            res.chunks += 1
    return res


async def streaming_phase(server: Server, clients: int, rounds: int, max_tokens: int):
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_stream(client, server, PROMPTS[0], 4)  # warm-up (not timed)

        async def worker(i: int) -> list[StreamResult]:
            return [await one_stream(client, server, PROMPTS[(i + k * clients) % len(PROMPTS)], max_tokens)
                    for k in range(rounds)]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return [r for rs in per_client for r in rs], wall


async def one_token_phase(server: Server, clients: int, total: int) -> float:
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        url = server.url + "/v1/chat/completions"
        r = await client.post(url, json=body(server, PROMPTS[0], 1, False))  # warm-up
        r.raise_for_status()
        queue = list(range(total))

        async def worker() -> None:
            while queue:
                i = queue.pop()
                r = await client.post(url, json=body(server, PROMPTS[i % len(PROMPTS)], 1, False))
                if r.status_code != 200:
                    raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.text[:300]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return total / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def measure(server: Server, args) -> dict:
    results, wall = asyncio.run(streaming_phase(server, args.clients, args.rounds, args.max_tokens))
    ttfts = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps]
    chunks = sum(r.chunks for r in results)
    rps = asyncio.run(one_token_phase(server, args.clients, args.requests_1))
    return {
        "TTFT p50 (ms)": 1000 * pct(ttfts, 0.5),
        "TTFT p99 (ms)": 1000 * pct(ttfts, 0.99),
        "ITL p50 (ms)": 1000 * pct(gaps, 0.5),
        "ITL p99 (ms)": 1000 * pct(gaps, 0.99),
        "output tokens/s": chunks / wall,
        "tokens/request": statistics.mean(r.chunks for r in results),
        "requests/s (max_tokens=1)": rps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (N)")
    parser.add_argument("--rounds", type=int, default=2, help="streaming requests per client")
    parser.add_argument("--max-tokens", type=int, default=64, help="output budget of the streaming requests")
    parser.add_argument("--requests-1", type=int, default=64, help="max_tokens=1 requests in all")
    parser.add_argument("--core", type=Path, default=ROOT / "cores/build/smollm2-135m-instruct-bf16")
    parser.add_argument("--gguf", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads (helios: OMP)")
    parser.add_argument("--n-ctx", type=int, default=8192, help="llama.cpp context (helios: the core's)")
    parser.add_argument("--only", choices=["helios", "llama.cpp"], help="run one server")
    args = parser.parse_args()
    if not (args.core / "core.toml").is_file():
        sys.exit(f"no core at {args.core}; build it: .venv/bin/ignition build cores/smollm2-135m-instruct-bf16.toml "
                 "(or pass --core cores/build/smollm2-135m-instruct, `make core`)")
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        if args.only != "helios":
            sys.exit("llama-cpp-python is not installed: .venv/bin/pip install 'llama-cpp-python[server]' "
                     "(the bench extra), or pass --only helios")

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flare-serve-bench-") as tmp:
        tmp = Path(tmp)
        servers: list[Server] = []
        try:
            if args.only in (None, "helios"):
                servers.append(start_helios(args.core, tmp, args.threads))
            if args.only in (None, "llama.cpp"):
                if not args.gguf.is_file():
                    sys.exit(f"no GGUF at {args.gguf}")
                servers.append(start_llama_cpp(args.gguf, tmp, args.threads, args.n_ctx))
            for s in servers:
                s.wait_ready()
            rows = {}
            for s in servers:
                print(f"measuring {s.name} at {s.url} ...", file=sys.stderr, flush=True)
                rows[s.name] = measure(s, args)
        finally:
            for s in servers:
                s.stop()

    names = list(rows)
    print(f"\n{args.clients} concurrent clients, {args.clients * args.rounds} streaming chat requests "
          f"(max_tokens={args.max_tokens}, temperature 0), {args.requests_1} requests at max_tokens=1; "
          f"{os.cpu_count()} CPUs, 1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    header = f"{'metric':<28}" + "".join(f"{n:>12}" for n in names)
    if len(names) == 2:
        header += f"{'ours/peer':>12}  better"
    print(header)
    print("-" * len(header))
    for metric in rows[names[0]]:
        values = [rows[n][metric] for n in names]
        line = f"{metric:<28}" + "".join(f"{v:>12.1f}" for v in values)
        if len(names) == 2:
            line += f"{values[0] / values[1]:>11.2f}x" if values[1] else f"{'-':>12}"
            line += "  " + ("lower" if "(ms)" in metric else "-" if metric == "tokens/request" else "higher")
        print(line)


if __name__ == "__main__":
    main()
