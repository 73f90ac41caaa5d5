"""`ignition export` wall time on this machine: a random-weight llama checkpoint of about --gb GB (bf16), exported
to a core (CPU target), and the kernel precompile alone for a GPU target (`python -m helios.runner.aot_compile`).

Every GPU session starts a fresh machine whose first benchmark exports the 8B shape (16 GB; 151-167 s there in
sessions 19-20, a tenth of the session's device time), and a user's first step is the same export. Runs each
--repeats times in fresh processes and prints the median and the weights' GB/s; --root points at another checkout
(git worktree) to time that code on the same checkpoint. Usage:

  .venv/bin/python benchmarks/export_speed.py [--gb 1.7] [--repeats 2] [--target cuda-sm90] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_checkpoint(out: Path, gb: float) -> None:
    """A llama of hidden 2048 (16 heads, 4 kv heads, MLP 8192, vocab 32000) with as many layers as make ~gb GB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.ignition.tiny_models import write_tokenizer

    per_layer = 2 * (4 * 2048 * 2048 // 2 + 2 * 2048 * 512 + 3 * 2048 * 8192)  # bytes: q, o, k, v, MLP (bf16)
    layers = max(1, round((gb * 1e9 - 2 * 2 * 32000 * 2048) / per_layer))
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
                      pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, max_shard_size="1GB")
    write_tokenizer(out)


def timed(cmd: list[str], env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-1500:]}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--target", default="cuda-sm90", help="the kernel precompile's target ('' to skip it)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose ignition and helios run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="export-speed-"))
    try:
        hf = work / "hf"
        write_checkpoint(hf, args.gb)
        size = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
        env["PYTHONPATH"] = str(args.root.resolve())
        runs = []
        for i in range(args.repeats):
            shutil.rmtree(work / "core", ignore_errors=True)
            os.sync()
            runs.append(timed([sys.executable, "-m", "ignition.cli", "export", str(hf), "-o", str(work / "core")],
                              env, work))
        median = statistics.median(runs)
        print(f"export of {size / 1e9:.2f} GB ({args.root}): median {median:.1f} s over {len(runs)} runs "
              f"({', '.join(f'{r:.1f}' for r in runs)}), {size / 1e9 / median:.2f} GB/s", flush=True)
        if args.target:
            out = work / "kernels"
            shutil.rmtree(out, ignore_errors=True)
            s = timed([sys.executable, "-m", "helios.runner.aot_compile", "compile", "--manifest",
                       str(work / "core" / "core.toml"), "--target", args.target, "--out", str(out)], env, work)
            count = len([p for p in out.iterdir() if p.is_dir()])
            print(f"kernel precompile for {args.target}: {s:.1f} s, {count} kernels, {os.cpu_count()} CPUs", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
