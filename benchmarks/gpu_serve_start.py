"""Cold start of `helios serve` on an 8B llama-shaped core (random bf16 weights), to the first served token.

Run on the lent GPU machine (not part of `make test`). Steps, each timed:
1. a random 8B llama checkpoint in HF layout (config, safetensors shards, a small BPE tokenizer);
2. `ignition export --target cuda-sm90` (the kernels of the graph plan compiled into core/kernels/cuda-sm90);
3. a second core sharing those weight files (hard links) whose manifest lists no kernels;
4. `helios serve` on each core, from process start to the first token of a completion over HTTP on 127.0.0.1
   (max_tokens=1, polled until the server answers): with kernels on a fresh runtime cache, again over that
   cache (a restart), and the core without kernels with an empty Triton cache, so it compiles every kernel.
   The server's own start-up line (open, weights, kernel load, KV, capture) is printed, and each start's split
   from process start to the first token (python and CLI imports, checks, torch imports, HTTP spawn, load, warm-up,
   waiting for the HTTP processes, ready, first token: the ready line's timeline plus this client's clock).
Usage: python benchmarks/gpu_serve_start.py --work /tmp/serve [--skip-bare]
       python benchmarks/gpu_serve_start.py --core cores/build/smollm2-135m-instruct --repeat 5   (any built core,
       no checkpoint or export: the CPU's cold start on this machine; the median of the repeats is printed)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_checkpoint(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.gpu_decode import LLAMA_8B
    from tests.ignition.tiny_models import write_tokenizer

    a = LLAMA_8B
    cfg = LlamaConfig(vocab_size=a["vocab_size"], hidden_size=a["hidden_size"], intermediate_size=a["intermediate_size"],
                      num_hidden_layers=a["num_layers"], num_attention_heads=a["num_heads"],
                      num_key_value_heads=a["num_kv_heads"], rms_norm_eps=a["rms_norm_eps"], rope_theta=a["rope_theta"],
                      max_position_embeddings=a["max_position_embeddings"], tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    write_tokenizer(out)


def core_without_kernels(core: Path, out: Path) -> None:
    """The same core (weights hard-linked) with a manifest that lists no kernels."""
    import msgspec

    from helios.core.manifest import MANIFEST_FILE, decode_manifest, encode_manifest

    manifest = decode_manifest((core / MANIFEST_FILE).read_bytes())
    out.mkdir(parents=True)
    for f in manifest.files:
        if f.path.startswith("kernels/"):
            continue
        (out / f.path).parent.mkdir(parents=True, exist_ok=True)
        os.link(core / f.path, out / f.path)
    files = [f for f in manifest.files if not f.path.startswith("kernels/")]
    (out / MANIFEST_FILE).write_bytes(encode_manifest(msgspec.structs.replace(manifest, kernels=[], files=files)))


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


_STARTED = re.compile(r" ready: ([\d.]+)s from process start \((.*?)(?:; HTTP up at ([\d.]+)s)?\); load")
_PART = re.compile(r"([a-zA-Z][\w -]*?) ([\d.]+)s")
_LOAD_PARTS = {"open": r"\(open ([\d.]+)s", "beside": r"grammar vocabulary ([\d.]+)s beside",
               "weights": r"weights ([\d.]+)s", "kernels": r"kernel load ([\d.]+)s", "kv": r"KV ([\d.]+)s",
               "capture": r"capture ([\d.]+)s", "graphs": r"\((\d+) graphs",
               "background": r"(\d+) more \(\d+ buckets\) left"}


def parse_ready(line: str) -> dict:
    """The ready line's start-up split: {step: seconds} in the order they ran, `ready` (seconds from process
    start), `http_up` and the load's own parts (`load_open`, ...); {} for a line without the timeline."""
    started = _STARTED.search(line)
    if started is None:
        return {}
    split = {name: float(s) for name, s in _PART.findall(started.group(2))}
    split["ready"] = float(started.group(1))
    if started.group(3):
        split["http_up"] = float(started.group(3))
    load = line[started.end() - len("; load"):]
    for key, pattern in _LOAD_PARTS.items():
        if (found := re.search(pattern, load)) is not None:
            split[f"load_{key}"] = float(found.group(1))
    return split


def print_split(name: str, results: list[dict]) -> None:
    """One start's split (the median over `results`, each a serve_to_first_token result), as a markdown table."""
    splits = [r["split"] for r in results if r.get("split") and "first_token_s" in r]
    if not splits:
        print(f"{name}: no split (no ready line with the timeline, or no first token)")
        return
    print(f"\n{name}: median of {len(splits)} start(s); seconds; load average {results[-1].get('loadavg')}")
    print("| step | took | ended at |\n| --- | --- | --- |")
    at = 0.0
    for key in splits[0]:
        if key in ("ready", "http_up") or key.startswith("load_"):
            continue
        took = statistics.median(s.get(key, 0.0) for s in splits)
        at += took
        print(f"| {key} | {took:.2f} | {at:.2f} |")
    for key in ("load_open", "load_beside", "load_weights", "load_kernels", "load_kv", "load_capture",
                "load_graphs", "load_background"):
        if key in splits[0]:
            value = statistics.median(s[key] for s in splits)
            shown = f"{value:g}" if key in ("load_graphs", "load_background") else f"{value:.2f}"
            print(f"| (load: {key[5:]}) | {shown} | |")
    if "http_up" in splits[0]:
        print(f"| (HTTP processes up) | | {statistics.median(s['http_up'] for s in splits):.2f} |")
    ready = statistics.median(s["ready"] for s in splits)
    first = statistics.median(r["first_token_s"] for r in results if "first_token_s" in r)
    print(f"| ready line | | {ready:.2f} |\n| first token (client: from Popen) | {first - ready:.2f} | {first:.2f} |")


def serve_to_first_token(core: Path, port: int, env: dict, limit_s: float, log: Path) -> dict:
    """Start `helios serve`, poll a completion until one token comes back; the start-up line, its split and
    timings."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "helios.cli", "serve", str(core), "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    result = {"core": core.name}
    try:
        url = f"http://127.0.0.1:{port}"
        model = None
        while time.perf_counter() - t0 < limit_s:
            if proc.poll() is not None:
                result["error"] = f"server exited with {proc.returncode}"
                break
            try:
                if model is None:
                    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
                        model = json.loads(resp.read())["data"][0]["id"]
                    result["models_s"] = time.perf_counter() - t0
                reply = _post(f"{url}/v1/completions",
                              {"model": model, "prompt": "Hello there", "max_tokens": 1, "temperature": 0}, 60)
                result["first_token_s"] = time.perf_counter() - t0
                result["text"] = reply["choices"][0]["text"]
                result["completion_tokens"] = reply.get("usage", {}).get("completion_tokens")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.01)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    lines = log.read_text(errors="replace").splitlines()
    result["ready_line"] = next((ln for ln in lines if " ready: " in ln), "")
    result["split"] = parse_ready(result["ready_line"])
    result["loadavg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result["warnings"] = [ln[:300] for ln in lines if "arning" in ln][:5]
    if "first_token_s" not in result:
        result["log_tail"] = lines[-15:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "helios-serve-start")
    parser.add_argument("--target", default="cuda-sm90")
    parser.add_argument("--limit", type=float, default=150.0, help="seconds to wait for each server")
    parser.add_argument("--out", type=Path, default=None, help="folder for the server logs")
    parser.add_argument("--skip-bare", action="store_true", help="skip the start that compiles every kernel")
    parser.add_argument("--core", type=Path, default=None,
                        help="serve this built core instead (no checkpoint, no export; the CPU's cold start)")
    parser.add_argument("--repeat", type=int, default=1, help="starts of --core (the split is their median)")
    parser.add_argument("--port", type=int, default=8231, help="--core: the port")
    args = parser.parse_args()
    if args.core is not None:
        serve_core_only(args)
        return
    work, logs = args.work, args.out or args.work
    logs.mkdir(parents=True, exist_ok=True)
    hf, core, bare = work / "hf-8b", work / "core-8b", work / "core-8b-nokernels"
    report = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not (hf / "config.json").is_file():
        t0 = time.perf_counter()
        write_checkpoint(hf)
        report["checkpoint_s"] = round(time.perf_counter() - t0, 1)
    if not (core / "core.toml").is_file():
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "ignition.cli", "export", str(hf), "-o", str(core), "--target", args.target,
               "--context-length", "4096", "--force"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        report["export_s"] = round(time.perf_counter() - t0, 1)
        report["export_rc"] = proc.returncode
        if proc.returncode != 0:
            report["export_err"] = proc.stdout[-1500:] + proc.stderr[-1500:]
            print(json.dumps(report, indent=1))
            return
    shutil.rmtree(bare, ignore_errors=True)
    core_without_kernels(core, bare)
    report["kernel_files"] = sorted(p.name for p in (core / "kernels" / args.target).rglob("*.cubin"))
    # with kernels: a fresh helios runtime cache (a first start on this machine: Triton's launcher stubs are
    # built), then a restart over that cache; without: an empty Triton cache, so every kernel is compiled
    kernel_cache = tempfile.mkdtemp(prefix="helios-kc-")
    runs = (("with_kernels", core, 8231, kernel_cache), ("with_kernels_restart", core, 8233, kernel_cache),
            ("without_kernels", bare, 8232, tempfile.mkdtemp(prefix="helios-kc-")))
    for name, path, port, cache in runs[:2] if args.skip_bare else runs:
        run_env = dict(env, HELIOS_KERNEL_CACHE=cache, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-empty-"))
        report[name] = serve_to_first_token(path, port, run_env, args.limit, logs / f"serve_{name}.log")
        print(name, json.dumps(report[name], indent=1), flush=True)
    print(json.dumps(report, indent=1))
    (logs / "serve_start.json").write_text(json.dumps(report, indent=1))
    for name in report:
        if isinstance(report[name], dict) and "split" in report[name]:
            print_split(name, [report[name]])


def serve_core_only(args) -> None:
    """--core: `helios serve` on a built core, --repeat times (the OS's file cache warm after the first), the
    split of each and their median."""
    logs = args.out or args.work
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = []
    for i in range(args.repeat):
        result = serve_to_first_token(args.core.resolve(), args.port, env, args.limit, logs / f"serve_core_{i}.log")
        print(json.dumps({k: v for k, v in result.items() if k != "ready_line"}), flush=True)
        results.append(result)
    print(results[-1]["ready_line"])
    print_split(args.core.name, results)


if __name__ == "__main__":
    main()
