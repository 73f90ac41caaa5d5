"""Cold start of `helios serve` on an 8B llama-shaped core (random bf16 weights), to the first served token.

Run on the lent GPU machine (not part of `make test`). Steps, each timed:
1. a random 8B llama checkpoint in HF layout (config, safetensors shards, a small BPE tokenizer);
2. `ignition export --target cuda-sm90` (the kernels of the graph plan compiled into core/kernels/cuda-sm90);
3. a second core sharing those weight files (hard links) whose manifest lists no kernels;
4. `helios serve` on each core, from process start to the first token of a completion over HTTP on 127.0.0.1
   (max_tokens=1, polled until the server answers): with kernels on a fresh runtime cache, again over that
   cache (a restart), and the core without kernels with an empty Triton cache, so it compiles every kernel.
   The server's own start-up line (open, weights, kernel load, KV, capture) is printed.
Usage: python benchmarks/gpu_serve_start.py --work /tmp/serve [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def serve_to_first_token(core: Path, port: int, env: dict, limit_s: float, log: Path) -> dict:
    """Start `helios serve`, poll a completion until one token comes back; the start-up line and timings."""
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
                time.sleep(0.05)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    lines = log.read_text(errors="replace").splitlines()
    result["ready_line"] = next((ln for ln in lines if " ready: " in ln), "")
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
