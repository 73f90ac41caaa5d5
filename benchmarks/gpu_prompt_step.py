"""Where a GPU prompt step's fixed cost goes (issue 22; run on the lent GPU, not part of `make test`).

Under served load every step that carries a prompt chunk costs a fixed part beside its tokens' (the scheduler fits
fixed + per token, Scheduler.observe_prefill): 12-31 ms on an H100 for the 8B core, against a 7-15 ms decode step.
This cuts the 8B llama shape to --layers layers (random bf16 weights made on the device) and, through the engine:
1. times decode-only steps of --decodes requests and mixed steps with one prompt of n tokens beside them (each
   step's wall time, the decode overlap on), and fits fixed + per token over n, per layer and for 32 layers;
2. cProfile over the 16-token mixed steps: the host functions by their own time;
3. torch.profiler over a few 16-token mixed steps: host (CPU) time against the kernels' GPU time, top ops.
Usage: python benchmarks/gpu_prompt_step.py [--layers 8] [--decodes 64] [--rows 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_decode import random_8b_runner  # noqa: E402
from helios.engine.config import SchedulerConfig  # noqa: E402
from helios.engine.engine_core import EngineCore  # noqa: E402
from helios.engine.messages import EngineRequest, SamplingParams  # noqa: E402

SIZES = (16, 64, 256, 1024)


def engine_for(runner, decodes: int) -> EngineCore:
    """An engine on the runner with `decodes` requests decoding (128-token prompts, outputs longer than the run)."""
    config = SchedulerConfig(max_concurrency=decodes + 1, max_num_batched_tokens=4096, prefill_chunk_size=4096,
                             page_size=runner.page_size, num_pages=runner.num_pages, max_model_len=4096)
    engine = EngineCore(config, runner)
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    vocab = runner.arch.vocab_size
    for r in range(decodes):
        ids = [(r * 31 + j) % (vocab - 10) + 10 for j in range(128)]
        engine.add_request(EngineRequest(req_id=f"d{r}", prompt_token_ids=ids, sampling=params))
    for _ in range(8):
        engine.step()
    return engine


def timed_steps(engine: EngineCore, n: int, reps: int, serial: list[int], profiler=None) -> tuple[float, float]:
    """Median wall ms of mixed steps (one n-token prompt, max_tokens 1, beside the decodes) and of the decode-only
    steps between them (three after each)."""
    mixed, plain = [], []
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.runner.arch.vocab_size
    last = time.perf_counter()
    for _ in range(reps):
        serial[0] += 1
        ids = [(serial[0] * 7 + j) % (vocab - 10) + 10 for j in range(n)]
        engine.add_request(EngineRequest(req_id=f"p{serial[0]}", prompt_token_ids=ids, sampling=params))
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        now = time.perf_counter()
        mixed.append(now - last)
        last = now
        for _ in range(3):
            engine.step()
            now = time.perf_counter()
            plain.append(now - last)
            last = now
        if engine.error:
            raise RuntimeError(engine.error)
    return 1e3 * statistics.median(mixed), 1e3 * statistics.median(plain[1::3])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    # every decoding request grows by a token a step (~300 steps here) beside prompts of up to 1024 tokens
    runner, _ = random_8b_runner(args.layers, num_pages=args.decodes * 32 + 128, max_model_len=4096)
    while runner.capture_pending():  # the decode and prompt buckets a lazy start leaves (helios serve: when idle)
        pass
    engine = engine_for(runner, args.decodes)
    serial = [0]
    timed_steps(engine, 16, 4, serial)  # warm: every prompt size's kernels
    for n in SIZES:
        timed_steps(engine, n, 2, serial)
    rows = []
    for n in SIZES:
        mixed, plain = timed_steps(engine, n, args.reps, serial)
        rows.append((n, mixed, plain))
        print(f"{args.layers} layers, {args.decodes} decodes + a {n:5d}-token prompt: step {mixed:7.2f} ms, "
              f"decode-only step {plain:6.2f} ms, prompt part {mixed - plain:7.2f} ms", flush=True)
    xs, ys = [n for n, _, _ in rows], [m - p for _, m, p in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    print(f"fit: prompt part = {fixed:.2f} ms + {1e3 * slope:.2f} us a token ({args.layers} layers); per layer "
          f"{1e3 * fixed / args.layers:.0f} us fixed; at 32 layers ~{32 * fixed / args.layers:.1f} ms fixed",
          flush=True)

    prof = cProfile.Profile()
    timed_steps(engine, 16, args.reps, serial, profiler=prof)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.rows)
    print(f"cProfile over {args.reps} mixed steps (16-token prompts), by own time:")
    print("\n".join(ln for ln in out.getvalue().splitlines() if ln.strip()), flush=True)

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        timed_steps(engine, 16, 3, serial)
        torch.cuda.synchronize()
    events = tp.key_averages()
    cpu = sum(e.self_cpu_time_total for e in events)
    gpu = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    print(f"torch.profiler over 3 mixed + 9 decode steps: host self time {cpu / 1e3:.1f} ms, kernels {gpu / 1e3:.1f} "
          "ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
