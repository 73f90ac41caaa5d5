"""Served load: `helios serve` under 1 to 512 concurrent streams against the engine alone, in the same run.

Workloads (seeded, no dataset): `fixed`, a 121-token prompt and exactly --max-tokens new tokens (ignore_eos);
`sharegpt`, prompt and output lengths drawn log-normal like ShareGPT conversations (prompt median ~200 tokens,
output median ~180, clipped). Prompts are ordinary words; completions send token ids, so prompt lengths are exact;
the first three ids of each request are unique (no prefix-cache hit from the benchmark cycling its prompts).
1. The engine alone (spawned child, so its GPU memory is free before the server starts): the core built by
   helios' own composition root (helios.compose.build_runtime, the [server] settings below) and stepped on the
   child's main thread; the same requests, a closed loop per stream, the streams' starts spread over --warm.
2. `helios serve CORE --config X` (subprocess on 127.0.0.1): the same closed loop over streaming /v1/completions
   and/or /v1/chat/completions (--api), from --client-procs processes (benchmarks/loadgen.py: a raw HTTP/1.1
   client parsing SSE in data_received). Statistics cover the --seconds window after --warm: output tok/s (token
   events in the window, each worth usage tokens / token events), TTFT/ITL/end-to-end p50 and p99, the TTFT of a
   max_tokens=1 probe every --probe-every s beside the load (the engine alone gets the same probes), errors
   (non-200, broken streams, error events, no [DONE], not exactly max_tokens); from /metrics deltas over the
   window the average decode batch (decode rounds / decode steps) and the graph-busy fraction (replay_gpu_ns /
   window); the server's CPU by process; after the level drains, every KV page, model slot and HTTP admission
   slot back. Requests still running --grace s after the window are cut (the connection closed: an abort).
--device cuda: the random-weight 8B llama core of benchmarks/gpu_serve_start.py (built in --work if absent), and a
copy whose lm_head rows of tokens without printable text are zero (same shapes and work; its 300-token tokenizer
covers 0.2% of the 128k vocabulary, and a token without text sends no SSE event to time).
Usage: python benchmarks/gpu_serve_load.py --device cuda [--core /tmp/serve/core-8b] [--streams 1,16,64,256,512]
       python benchmarks/gpu_serve_load.py --device cpu   (levels 1,4,8; the bfloat16 SmolLM2 core:
       `.venv/bin/ignition build cores/smollm2-135m-instruct-bf16.toml`; --core cores/build/smollm2-135m-instruct
       for the float32 one)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.loadgen import SALT, LoadPool, Target, get_from, pct  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain garden window music story letter").split()


# --- the workload --------------------------------------------------------------------------------


def lengths(workload: str, count: int, seed: int, prompt_tokens: int, max_tokens: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request, seeded; sharegpt outputs clipped at 8 x max_tokens."""
    if workload == "fixed":
        return [(prompt_tokens, max_tokens)] * count
    rng = random.Random(seed)
    return [(int(min(max(rng.lognormvariate(math.log(200), 0.9), 8), 1500)),
             int(min(max(rng.lognormvariate(math.log(180), 0.8), 4), 8 * max_tokens))) for _ in range(count)]


def prompt_ids(tokenizer, n: int, salt: int) -> list[int]:
    """n ordinary-word token ids, different per salt."""
    rng = random.Random(salt)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" " + " ".join(rng.choice(WORDS) for _ in range(64)), add_special_tokens=False)
    return ids[:n]


def word_ids(tokenizer, limit: int = 64) -> list[int]:
    """Ids of plain-word tokens (letters, maybe a leading space): the per-request salt of completion prompts."""
    return [i for i, b in enumerate(tokenizer.token_bytes)
            if re.fullmatch(rb" ?[A-Za-z]+", b) and i not in tokenizer.special_ids][:limit]


def body(api: str, ids: list[int], text: str, max_tokens: int, stream: bool = True) -> dict:
    common = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if api == "chat":
        return {**common, "messages": [{"role": "user", "content": text}]}
    return {**common, "prompt": ids}


def payload(api: str, ids: list[int], text: str, max_tokens: int) -> bytes:
    """The streaming body with SALT where loadgen puts the request's unique first three ids (or words)."""
    if api == "chat":
        return json.dumps(body(api, [], SALT.decode() + " " + text, max_tokens)).encode()
    raw = json.dumps(body(api, ["@@IDS@@"], "", max_tokens)).encode()
    return raw.replace(b'["@@IDS@@"]', b"[" + SALT + b"," + ",".join(map(str, ids[3:])).encode() + b"]")


# --- the 8B core (cuda) ----------------------------------------------------------------------------


def build_8b(work: Path, target: str) -> Path:
    """The core benchmarks/gpu_serve_start.py exports (the same checkpoint writer and export command)."""
    from benchmarks.gpu_serve_start import write_checkpoint

    hf, core = work / "hf-8b", work / "core-8b"
    if (core / "core.toml").is_file():
        return core
    t0 = time.perf_counter()
    if not (hf / "config.json").is_file():
        write_checkpoint(hf)
    cmd = [sys.executable, "-m", "ignition.cli", "export", str(hf), "-o", str(core), "--target", target,
           "--context-length", "4096", "--force"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}"
                                                                           f"{os.environ.get('PYTHONPATH', '')}"))
    print(f"8B checkpoint and export: {time.perf_counter() - t0:.0f} s", flush=True)
    return core


def text_core(core: Path, out: Path, tokenizer, manifest) -> Path:
    """`core` (files hard-linked) with the lm_head rows of tokens lacking printable text zeroed, so greedy picks
    text tokens; the shard holding lm_head is copied, patched and its digest rewritten. `core` itself when most
    tokens have text."""
    import msgspec

    from helios.core.manifest import MANIFEST_FILE, encode_manifest

    vocab, hidden = manifest.arch.vocab_size, manifest.arch.hidden_size
    keep = {i for i, b in enumerate(tokenizer.token_bytes[:vocab])
            if b and i not in tokenizer.special_ids and all(32 <= c < 127 for c in b)}
    if len(keep) > vocab // 2 or manifest.arch.tie_word_embeddings:
        return core
    source = hashlib.sha256((core / MANIFEST_FILE).read_bytes()).hexdigest()
    marker = out.with_name(out.name + ".source")  # the core it was made from: a re-exported core makes a new one
    if (out / MANIFEST_FILE).is_file() and marker.is_file() and marker.read_text() == source:
        return out
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    for entry in manifest.files:  # the shard holding lm_head.weight, and where
        if entry.path.endswith(".safetensors"):
            with open(core / entry.path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            if "lm_head.weight" in header:
                info, shard = header["lm_head.weight"], entry
                break
    else:
        raise SystemExit(f"{core}: no lm_head.weight in its safetensors files")
    itemsize = {"BF16": 2, "F16": 2, "F32": 4}[info["dtype"]]
    assert info["shape"] == [vocab, hidden], info
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for entry in manifest.files:
        (tmp / entry.path).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copyfile if entry is shard else os.link)(core / entry.path, tmp / entry.path)
    row = hidden * itemsize
    base = 8 + size + info["data_offsets"][0]
    with open(tmp / shard.path, "r+b") as f:  # zero bytes are 0.0 in every float format
        start = 0
        for stop in [*sorted(keep), vocab]:
            if stop > start:
                f.seek(base + start * row)
                for lo in range(start, stop, 8192):
                    f.write(bytes((min(stop, lo + 8192) - lo) * row))
            start = stop + 1
    digest = hashlib.sha256()
    with open(tmp / shard.path, "rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
    files = [msgspec.structs.replace(e, sha256=digest.hexdigest()) if e is shard else e for e in manifest.files]
    (tmp / MANIFEST_FILE).write_bytes(encode_manifest(msgspec.structs.replace(manifest, files=files)))
    tmp.rename(out)
    marker.write_text(source)
    print(f"text core {out}: lm_head rows of {vocab - len(keep)} of {vocab} tokens zeroed ({shard.path}), "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return out


# --- the engine alone ----------------------------------------------------------------------------


def engine_alone(core_dir: Path, server_toml: dict, levels: list[int], warm: float, seconds: float,
                 probe_every: float, work: list, salt_ids: list[int]) -> dict[int, float]:
    """Closed-loop output tok/s of the engine at each stream count (on this thread, as the engine process runs),
    with the served run's probes (their tokens not counted)."""
    import msgspec

    from helios.compose import build_runtime
    from helios.server.config import ServerConfig
    from helios.server.protocols import openai_completions
    from helios.switches import Switches

    # the HELIOS_* switches of this process, as `helios serve` reads them for the served run
    runtime = build_runtime(core_dir, ServerConfig(**server_toml), Switches.from_environ(os.environ), own_thread=False)
    core = runtime.engine.core
    while core.has_background_work:  # the decode graphs a lazy start left (helios serve captures them when idle)
        core.background_step()
    requests = [openai_completions.prepare(msgspec.json.encode(body("completions", ids, "", o, stream=False)),
                                           runtime.model).children[0].request for ids, _, o in work]
    serial, n_salt, results = 0, len(salt_ids), {}

    def add(stream: int, probe: bool = False) -> None:
        nonlocal serial
        req = requests[0 if probe else (stream + serial * 7919) % len(requests)]
        salt = [salt_ids[(serial // n_salt**i) % n_salt] for i in range(3)]
        sampling = msgspec.structs.replace(req.sampling, max_tokens=1) if probe else req.sampling
        core.add_request(msgspec.structs.replace(req, req_id=f"{'p' if probe else 'e'}{serial}", sampling=sampling,
                                                 prompt_token_ids=salt + req.prompt_token_ids[3:]))
        serial += 1

    # NOTE: a first, unmeasured pass at the first level: its kernels' first launches (compiles, autotuning) fell
    # inside the measured window of the first level (session 20: 421 tok/s at 16 streams against 1933 served)
    for i, n in enumerate([levels[0]] + list(levels)):
        t0 = time.monotonic()
        starts = [t0 + g / n * warm for g in range(n)]  # spread like the served streams' starts
        probes = [t0 + warm + k * probe_every for k in range(int(seconds / probe_every))] if probe_every else []
        owner: dict[str, int] = {}
        tokens = 0
        occupancy = [0, 0, 0]  # steps in the window, running and waiting requests summed over them
        step_s: list[float] = []  # each step's wall time in the window: the engine's own inter-token gaps
        while (now := time.monotonic()) < t0 + warm + seconds:
            while starts and starts[0] <= now:
                owner[f"e{serial}"] = n - len(starts)
                add(n - len(starts))
                starts.pop(0)
            while probes and probes[0] <= now:
                add(0, probe=True)
                probes.pop(0)
            if now >= t0 + warm:
                occupancy[0] += 1
                occupancy[1] += core.scheduler.num_running
                occupancy[2] += core.scheduler.num_waiting
            started = time.perf_counter()
            outputs = core.step()
            if now >= t0 + warm:
                step_s.append(time.perf_counter() - started)
            for out in outputs:
                if out.req_id[0] == "p":
                    continue
                if now >= t0 + warm:
                    tokens += len(out.new_token_ids)
                if out.finished:
                    stream = owner.pop(out.req_id)
                    owner[f"e{serial}"] = stream
                    add(stream)
        for req_id in list(owner):  # what is left is aborted (long sharegpt outputs would hold the next level)
            core.abort(req_id)
        while core.has_unfinished_requests():
            core.step()
        if i == 0:
            print(f"engine alone, {n:4d} streams: warm-up pass, {tokens / seconds:9.1f} tok/s (not counted)", flush=True)
            continue
        results[n] = tokens / seconds
        sched = core.scheduler  # the step costs its prompt budget reads (Scheduler.observe_prefill / _decode)
        costs = (f"decode step {1e-6 * sched.decode_step_ns:.2f} ms, prompt step {1e-6 * sched.prefill_fixed_ns:.2f} ms"
                 f" + {1e-3 * sched.prefill_ns_per_token:.2f} us a token" if sched.decode_step_ns and
                 sched.prefill_ns_per_token else "step costs unmeasured")
        steps = max(occupancy[0], 1)
        print(f"engine alone, {n:4d} streams: {results[n]:9.1f} tok/s ({costs}; {occupancy[1] / steps:.1f} running + "
              f"{occupancy[2] / steps:.1f} queued a step; step p50/p99/max {1e3 * pct(step_s, 0.5):.1f}/"
              f"{1e3 * pct(step_s, 0.99):.1f}/{1e3 * pct(step_s, 1.0):.1f} ms)", flush=True)
    runtime.engine.shutdown()
    return results


def _engine_child(queue, *args) -> None:
    queue.put(engine_alone(*args))


# --- the server ----------------------------------------------------------------------------------


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics?format=json", timeout=10) as r:
        return json.loads(r.read())


def start_server(core_dir: Path, config: Path, log: Path,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "helios.cli", "serve", str(core_dir), "--config", str(config), "--port", str(port),
           *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise SystemExit(f"helios serve did not start:\n{log.read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return proc, url, port
        except OSError:
            time.sleep(0.3)


def warm_server(url: str, target: Target) -> None:
    """Two requests read to their end before the first level (its first requests would pay lazy set-up)."""
    for i, (body, _) in enumerate(target.payloads[:2]):
        req = urllib.request.Request(url, data=target.salted(body, (1 << 40) + i),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_ticks(pid: int) -> dict[int, tuple[int, int]]:
    """{pid: (CPU ticks, its busiest thread's)} of `pid` and its children but multiprocessing's resource tracker
    (Linux /proc; {} elsewhere)."""
    def ticks(stat: str) -> int:
        fields = stat.rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    out = {}
    try:
        children = [c for t in Path(f"/proc/{pid}/task").glob("*/children") for c in t.read_text().split()]
        for p in [pid, *map(int, children)]:
            if b"resource_tracker" in Path(f"/proc/{p}/cmdline").read_bytes():
                continue
            threads = [ticks(t.read_text()) for t in Path(f"/proc/{p}/task").glob("*/stat")]
            out[p] = (ticks(Path(f"/proc/{p}/stat").read_text()), max(threads, default=0))
    except OSError:
        pass
    return out


def cpu_split(before: dict, after: dict, root: int, seconds: float) -> str:
    """The server's CPU over the window, in cores: the engine process (its busiest thread), each HTTP process."""
    hz = os.sysconf("SC_CLK_TCK") * seconds
    use = {p: ((after[p][0] - before[p][0]) / hz, (after[p][1] - before[p][1]) / hz) for p in after if p in before}
    if root not in use:
        return "n/a"
    http = [f"{use[p][0]:.2f}" for p in use if p != root]
    return f"engine process {use[root][0]:.2f} (busiest thread {use[root][1]:.2f}), HTTP {'/'.join(http)}"


def served_level(url: str, server_pid: int, pool: LoadPool, streams: int, warm: float, seconds: float,
                 grace: float, probe_every: float) -> dict:
    """One level: the load, /metrics and the server's CPU at the window's edges, then the drained state."""
    lo, hi = pool.start(streams, warm, seconds, grace, probe_every)
    time.sleep(max(0.0, lo - time.monotonic()))
    asked = time.monotonic()
    m0, c0, t0 = metrics(url), cpu_ticks(server_pid), time.monotonic()
    slow = [t0 - asked]  # a /metrics answer held up by the load skews the window's server-side figures
    # where the requests in flight are: decoding or prefilling (active) or queued in the engine (pending); the
    # rest of the streams are between the clients and the engine (HTTP, frontends, the socket)
    samples = []
    while time.monotonic() < hi - 0.3:
        m = metrics(url)
        samples.append((m["active"], m["pending"]))
        time.sleep(max(0.0, min(0.25, hi - 0.3 - time.monotonic())))
    time.sleep(max(0.0, hi - time.monotonic()))
    asked = time.monotonic()
    m1, c1, t1 = metrics(url), cpu_ticks(server_pid), time.monotonic()
    slow.append(t1 - asked)
    r = pool.collect()
    after = metrics(url)
    for _ in range(100):  # in-flight requests finished with the clients; the engine releases at its next step
        if after["active"] == after["pending"] == after["http_admission_in_use"] == 0 \
                and after["free_pages"] == after["total_pages"]:
            break
        time.sleep(0.1)
        after = metrics(url)
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in ("generated_tokens", "verify_steps", "verification_rounds",
                                                  "replay_gpu_ns", "reused_tokens", "kernels_jit")}
    return {
        "tok_s": r.window_tokens / seconds, "server_tok_s": d["generated_tokens"] / (t1 - t0),
        "requests": r.num_requests, "cut": r.num_cut, "errors": len(r.errors), "error_sample": r.errors[:2],
        "ttft": (pct(r.ttft, 0.5), pct(r.ttft, 0.99)), "itl": (pct(r.itl, 0.5), pct(r.itl, 0.99)),
        "e2e": (pct(r.e2e, 0.5), pct(r.e2e, 0.99)), "probe": (pct(r.probe_ttft, 0.5), pct(r.probe_ttft, 0.99)),
        "batch": d["verification_rounds"] / d["verify_steps"] if d["verify_steps"] else float("nan"),
        "busy": d["replay_gpu_ns"] / 1e9 / (t1 - t0), "reused": d["reused_tokens"], "jit": d["kernels_jit"],
        "client_cpu": r.cpu_s / r.wall_s / len(pool.procs) if r.wall_s else float("nan"),
        "server_cpu": cpu_split(c0, c1, server_pid, t1 - t0),
        "launches": {k: v - m0["graph_launches"].get(k, 0) for k, v in m1["graph_launches"].items()},
        "pages_ok": after["active"] == after["pending"] == after["http_admission_in_use"] == 0
        and after["free_pages"] == after["total_pages"],
        "pages": f"free {after['free_pages']}/{after['total_pages']}, active {after['active']}, pending "
                 f"{after['pending']}, admission in use {after['http_admission_in_use']}",
        "metrics_s": max(slow),
        "in_engine": (sum(a for a, _ in samples) / len(samples), sum(w for _, w in samples) / len(samples))
        if samples else (float("nan"), float("nan")),
    }


def level_line(api: str, n: int, r: dict, engine: float) -> str:
    return (f"served {api} {n:4d} streams: {r['tok_s']:9.1f} tok/s ({r['tok_s'] / engine:.2f} of the engine alone; "
            f"server-side {r['server_tok_s']:.0f}), {r['requests']} requests ({r['cut']} cut), {r['errors']} errors "
            f"{r['error_sample'] or ''}, TTFT p50/p99 {r['ttft'][0] * 1e3:.0f}/{r['ttft'][1] * 1e3:.0f} ms, ITL "
            f"{r['itl'][0] * 1e3:.1f}/{r['itl'][1] * 1e3:.1f} ms, E2E {r['e2e'][0]:.2f}/{r['e2e'][1]:.2f} s, probe "
            f"TTFT {r['probe'][0] * 1e3:.0f}/{r['probe'][1] * 1e3:.0f} ms, in the engine (mean of /metrics samples) "
            f"{r['in_engine'][0]:.1f} active + {r['in_engine'][1]:.1f} queued, decode batch {r['batch']:.1f}, "
            f"graph busy {r['busy']:.0%}, forward passes {r['launches']}, kernels JIT-compiled in the window "
            f"{r['jit']}, prefix-reused tokens {r['reused']}, server CPU in "
            f"cores: {r['server_cpu']}, client processes' CPU {r['client_cpu']:.0%} each, "
            f"{'OK' if r['pages_ok'] else 'LEAK'} ({r['pages']})"
            + (f", /metrics answered in {r['metrics_s']:.1f} s" if r["metrics_s"] > 0.5 else ""))


def table_row(api: str, n: int, r: dict, engine: float) -> str:
    ms = lambda pair, f=".0f": f"{pair[0] * 1e3:{f}}/{pair[1] * 1e3:{f}}"  # noqa: E731
    return (f"| {api} | {n} | {r['tok_s']:.0f} | {engine:.0f} | {r['tok_s'] / engine:.2f} | {ms(r['ttft'])} | "
            f"{ms(r['itl'], '.1f')} | {r['e2e'][0]:.2f}/{r['e2e'][1]:.2f} | {r['probe'][1] * 1e3:.0f} | "
            f"{r['batch']:.1f} | {r['busy']:.0%} | {r['requests']} | {r['errors']} | "
            f"{'OK' if r['pages_ok'] else 'LEAK'} |")


# --- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--core", type=Path, help="the core to serve (cuda: default the 8B one in --work)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/serve"), help="8B checkpoint, cores, server log")
    parser.add_argument("--target", default="cuda-sm90", help="kernel target of the 8B export")
    parser.add_argument("--streams", help="comma-separated stream counts (cuda 1,16,64,256,512; cpu 1,4,8)")
    parser.add_argument("--seconds", type=float, help="measured seconds per level (cuda 12, cpu 20)")
    parser.add_argument("--warm", type=float, default=3.0, help="seconds per level before the window (starts spread)")
    parser.add_argument("--grace", type=float, default=15.0,
                        help="seconds after the window before requests still running are cut (aborted)")
    parser.add_argument("--probe-every", type=float, help="seconds between max_tokens=1 probes, served and alone "
                        "(cuda 0.5; cpu 2: a 121-token prefill is ~0.3 s of a 2-core CPU's time; 0: none)")
    parser.add_argument("--workload", choices=["fixed", "sharegpt"], default="fixed")
    parser.add_argument("--api", choices=["completions", "chat", "both"], default="completions")
    parser.add_argument("--prompt-tokens", type=int, default=121)
    parser.add_argument("--max-tokens", type=int, help="new tokens per request (cuda 128, cpu 64)")
    parser.add_argument("--max-concurrency", type=int, default=256, help="[server] max_concurrency (model slots)")
    parser.add_argument("--max-waiting", type=int, default=4096, help="[server] max_waiting")
    parser.add_argument("--max-num-batched-tokens", type=int, help="[server] (cuda 8192, cpu 2048)")
    parser.add_argument("--http-workers", type=int, default=0, help="[server] http_workers (0: the server's default)")
    parser.add_argument("--decode-stall-ratio", type=float,
                        help="[server] decode_stall_ratio (unset: the server's default, 1.0; 0: prompts limited only "
                        "by the token budget and the prompt graphs' cap)")
    parser.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--skip-engine", action="store_true", help="no engine-alone figures")
    parser.add_argument("--engine-samples", action="store_true",
                        help="sample the served engine thread's stack (helios serve --engine-samples) and print it")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    levels = [int(x) for x in (args.streams or ("1,16,64,256,512" if gpu else "1,4,8")).split(",")]
    seconds = args.seconds or (12.0 if gpu else 20.0)
    max_tokens = args.max_tokens or (128 if gpu else 64)
    probe_every = args.probe_every if args.probe_every is not None else (0.5 if gpu else 2.0)
    apis = ["completions", "chat"] if args.api == "both" else [args.api]
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    from helios.core.load import read_manifest
    from helios.frontend.tokenizer import Tokenizer

    cpu_core = ROOT / "cores/build/smollm2-135m-instruct-bf16"
    core_dir = args.core or (build_8b(args.work, args.target) if gpu else cpu_core)
    manifest = read_manifest(core_dir)
    tokenizer = Tokenizer.from_file(core_dir / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    core_dir = text_core(core_dir, args.work / f"{core_dir.name}-text", tokenizer, manifest)
    server_toml = {"max_concurrency": args.max_concurrency, "max_waiting": args.max_waiting,
                   "max_num_batched_tokens": args.max_num_batched_tokens or (8192 if gpu else 2048),
                   "device": args.device, **({"http_workers": args.http_workers} if args.http_workers else {}),
                   **({} if args.decode_stall_ratio is None else {"decode_stall_ratio": args.decode_stall_ratio})}
    work = []
    for i, (p, o) in enumerate(lengths(args.workload, 1024, args.seed, args.prompt_tokens, max_tokens)):
        ids = prompt_ids(tokenizer, p, args.seed * 100003 + i)
        work.append((ids, tokenizer.decode(ids[3:]), o))
    salt_ids = word_ids(tokenizer)
    print(f"core {core_dir}, {args.workload} workload, {'+'.join(apis)}, levels {levels}, {args.warm:.0f}+"
          f"{seconds:.0f} s each, {max_tokens} new tokens{' (fixed)' if args.workload == 'fixed' else ' x8 max'}, "
          f"{args.client_procs} client processes, [server] {server_toml}", flush=True)

    engine: dict[int, float] = {}
    if not args.skip_engine:  # a spawned child: its GPU memory is free again before the server starts
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_engine_child,
                            args=(queue, core_dir, server_toml, levels, args.warm, seconds, probe_every, work,
                                  salt_ids))
        child.start()
        engine = get_from(queue, [child])
        child.join()
        print(f"[engine alone done at {time.perf_counter() - t_start:.0f} s]", flush=True)

    config = args.work / "server.toml"
    config.write_text("[server]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in server_toml.items()))
    log = args.work / "serve.log"
    samples = args.work / "engine_samples.txt"
    samples.unlink(missing_ok=True)
    proc, url, port = start_server(core_dir, config, log,
                                   ("--engine-samples", str(samples)) if args.engine_samples else ())
    rows = []
    try:
        ready = next((ln for ln in log.read_text().splitlines() if " ready: " in ln), "")
        print(ready[:600], flush=True)
        # the graph buckets a lazy start left are captured while the server idles (under load each unit stalls the
        # streams): wait for them as the engine alone does (flare_graph_captures_pending; 60 s at most)
        waited = time.monotonic()
        while metrics(url).get("graph_captures_pending", 0) and time.monotonic() - waited < 60:
            time.sleep(0.2)
        print(f"graph captures left by the start: done {time.monotonic() - waited:.1f} s after ready "
              f"({metrics(url).get('graph_captures_pending', 0)} pending)", flush=True)
        for api in apis:
            path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
            salts, sep = ([w.encode() for w in WORDS], b" ") if api == "chat" else \
                ([str(i).encode() for i in salt_ids], b",")
            target = Target("127.0.0.1", port, path, [(payload(api, ids, text, o), o) for ids, text, o in work],
                            payload(api, *work[0][:2], 1), salts, sep, lead=1 if api == "chat" else 0)
            warm_server(url + path, target)
            pool = LoadPool(target, args.client_procs)
            try:
                for n in levels:
                    r = served_level(url, proc.pid, pool, n, args.warm, seconds, args.grace, probe_every)
                    e = engine.get(n, float("nan"))
                    rows.append((api, n, r, e))
                    print(level_line(api, n, r, e), flush=True)
            finally:
                pool.close()
    finally:
        stop_server(proc)
    if args.engine_samples and samples.is_file():  # the served engine thread's sampled stacks, every level together
        print(f"engine thread, sampled ({samples}):\n" + samples.read_text(), flush=True)
    # what the server said beyond its ready line (a frontend restarted, an error), for a level that looks wrong
    notes = [ln for ln in log.read_text(errors="replace").splitlines()
             if re.search(r"error|warning|traceback|restart|died|exited", ln, re.IGNORECASE)]
    if notes:
        print(f"server log ({log}), {len(notes)} lines of note, the last 15:\n" + "\n".join(notes[-15:]), flush=True)
    print(f"\n[total {time.perf_counter() - t_start:.0f} s]\n| api | streams | served tok/s | engine tok/s | "
          "served/engine | TTFT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 s | probe TTFT p99 ms | decode batch | "
          "graph busy | requests | errors | pages |\n" + "| --- " * 14 + "|")
    for api, n, r, e in rows:
        print(table_row(api, n, r, e))


if __name__ == "__main__":
    main()
