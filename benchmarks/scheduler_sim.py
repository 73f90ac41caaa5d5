"""The scheduler under a closed loop of streams, on a simulated clock: admission policy without a GPU.

The real Scheduler (helios/engine/scheduler.py) plans every step; a step's time comes from a cost model instead of
a runner (defaults: the 8B shape on an H100, session 21: a decode step of 5.6 ms + 29.7 us a decoding request, a
prompt part beside it of 4.4 ms + 17.3 us a token of its prompt graph's bucket when one holds it (at most 8 chunks,
512 tokens: helios/runner/prompt_graphs.py), else an eager 9 ms + 17.3 us a token), and goes to the scheduler's
cost fit as EngineCore reports a measured step. Each stream sends its next request `--rtt` after the last one
finished (fixed prompt and output lengths, as benchmarks/gpu_serve_load.py's fixed workload), its first requests
spread over 2 s. Printed per policy and stream count: output tok/s, requests running and queued per step, TTFT
and inter-token gap p50/p99 (simulated), and the steps by kind (decode only, prompt graph, eager, one pass).

`python benchmarks/scheduler_sim.py` compares the stall budget (decode_stall_ratio 1) with the prompt graphs' cap
(prompt_step_tokens 512, prompt_step_seqs 8, ratio 0), both (what helios serve takes where a runner has prompt
graphs), and both with one-pass steps (HELIOS_ONE_PASS=1: a step of prompts beside up to 72 decodes is one prompt
graph's replay, no fixed 4.4 ms second pass, at most 256 prompt tokens a step; the scheduler holds a prompt back one
step after a decode-only step, which the runner would otherwise have run ahead). Steps not run ahead wait --gap-ms
for the host's plan.
Found with it (session 21): the stall budget's allowance scales with the decode step, which shrinks with
the running set, so under a closed loop fewer admissions meant fewer running and fewer admissions again: at 256
streams it settled with requests queued (TTFT p99 0.7 s here, ~1 s measured on the H100) until the scheduler held
the queue's head back at most STALL_MAX_WAIT_STEPS steps; the cap alone left a 2.15x ITL tail at 64 streams.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loadgen import pct  # noqa: E402
from helios.engine.config import SchedulerConfig  # noqa: E402
from helios.engine.engine_core import EngineCore  # noqa: E402
from helios.engine.messages import EngineRequest, ModelRunnerOutput, RequestResult, SamplingParams  # noqa: E402
from helios.engine.scheduler import Scheduler  # noqa: E402
from helios.runner.prompt_graphs import (ONE_PASS_BUCKETS, ONE_PASS_MAX_SEQS, ONE_PASS_PROMPT_TOKENS,  # noqa: E402
                                         PROMPT_BUCKETS, bucket_seqs)

BUCKETS = PROMPT_BUCKETS


def simulate(streams: int, *, ratio: float, cap_tokens: int, cap_seqs: int, seconds: float = 20.0, warm: float = 4.0,
             prompt: int = 121, output: int = 128, rtt: float = 0.001, decode_ms: tuple[float, float] = (5.6, 0.0297),
             graph_ms: tuple[float, float] = (4.4, 0.0173), eager_ms: tuple[float, float] = (9.0, 0.0173),
             max_concurrency: int = 256, seed: int = 0, one_pass: bool = False, gap_ms: float = 0.0) -> dict:
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=8192, prefill_chunk_size=2048,
                             decode_stall_ratio=ratio, max_waiting=4096, page_size=16, num_pages=1 << 15,
                             max_model_len=4096, prompt_step_tokens=cap_tokens, prompt_step_seqs=cap_seqs,
                             one_pass_rows=ONE_PASS_MAX_SEQS if one_pass else 0,
                             one_pass_prompt_tokens=ONE_PASS_PROMPT_TOKENS if one_pass else 0)
    sched = Scheduler(config)
    engine = types.SimpleNamespace(scheduler=sched)  # what EngineCore._observe reads
    rng = random.Random(seed)
    arrivals = [(g / streams * 2.0, g) for g in range(streams)]
    serial, now = streams, 0.0
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft, gaps, kinds = [], [], {"decode": 0, "graph": 0, "eager": 0, "one_pass": 0}
    tokens = steps = running = queued = 0
    ran_ahead = False  # this step's decode rows were launched by the step before (runner/decode_overlap.py)
    buckets = ONE_PASS_BUCKETS if one_pass else BUCKETS
    while now < warm + seconds:
        while arrivals and arrivals[0][0] <= now:
            at, s = heapq.heappop(arrivals)
            sent[f"r{s}"] = at
            ids = [1 + (s * 7919 + i * 31) % 30000 for i in range(prompt)]
            sched.add_request(EngineRequest(req_id=f"r{s}", prompt_token_ids=ids,
                                            sampling=SamplingParams(max_tokens=output, ignore_eos=True)))
        plan = sched.schedule()
        if not plan.scheduled:
            now = arrivals[0][0] if arrivals else now + 1e-3
            continue
        decodes = sum(len(s.token_ids) == 1 for s in plan.scheduled)
        chunks = [len(s.token_ids) for s in plan.scheduled if len(s.token_ids) > 1]
        ms = decode_ms[0] + decode_ms[1] * decodes if decodes else 0.0
        rows, num_tokens = decodes + len(chunks), decodes + sum(chunks)
        fits = [b for b in buckets if b >= num_tokens and bucket_seqs(b, ONE_PASS_MAX_SEQS) >= rows]
        if not chunks:
            kinds["decode"] += 1
        elif one_pass and not ran_ahead and fits:  # decode and prompt rows in one prompt graph: one pass
            ms = decode_ms[0] + decode_ms[1] * decodes + graph_ms[1] * fits[0]
            kinds["one_pass"] += 1
        elif len(chunks) <= 8 and sum(chunks) <= buckets[-1]:  # the decode rows' graph, then the prompt rows'
            ms += graph_ms[0] + graph_ms[1] * next(b for b in buckets if b >= sum(chunks))
            kinds["graph"] += 1
        else:
            ms += eager_ms[0] + eager_ms[1] * sum(chunks)
            kinds["eager"] += 1
        # a step run ahead was launched before the host planned it; every other step waits gap_ms for the plan
        ms += 0.0 if ran_ahead else gap_ms
        ran_ahead = not chunks and not plan.hold_ahead
        step_s = 1e-3 * ms * rng.uniform(0.97, 1.03)
        now += step_s
        if now >= warm:
            steps, running, queued = steps + 1, running + sched.num_running, queued + sched.num_waiting
        EngineCore._observe(engine, plan, step_s)
        results = [RequestResult(req_id=s.req_id, sampled_token_id=7 if s.sample else None) for s in plan.scheduled]
        for out in sched.update(plan, ModelRunnerOutput(results=results)):
            if out.new_token_ids:
                if out.req_id not in last:
                    if sent[out.req_id] >= warm:
                        ttft.append(now - sent[out.req_id])
                elif now >= warm:
                    gaps.append(now - last[out.req_id])
                last[out.req_id] = now
                tokens += len(out.new_token_ids) if now >= warm else 0
            if out.finished:
                heapq.heappush(arrivals, (now + rtt, serial))
                serial += 1
    steps = max(steps, 1)
    return {"tok_s": tokens / seconds, "running": running / steps, "queued": queued / steps,
            "ttft_ms": (1e3 * pct(ttft, 0.5), 1e3 * pct(ttft, 0.99)),
            "itl_ms": (1e3 * pct(gaps, 0.5), 1e3 * pct(gaps, 0.99)), "steps": kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="16,64,256,512")
    parser.add_argument("--seconds", type=float, default=20.0, help="simulated seconds measured per run")
    parser.add_argument("--rtt", type=float, default=0.001, help="seconds from a request's end to its stream's next")
    parser.add_argument("--gap-ms", type=float, default=0.6, help="the host's plan between steps not run ahead")
    args = parser.parse_args()
    policies = {"stall budget (ratio 1)": (1.0, 0, 0, False), "prompt graphs' cap (ratio 0)": (0.0, 512, 8, False),
                "both (helios serve on a GPU)": (1.0, 512, 8, False),
                "both + one-pass steps (HELIOS_ONE_PASS=1)": (1.0, 512, 8, True)}
    print("| streams | policy | tok/s | running | queued | TTFT p50/p99 ms | ITL p50/p99 ms | steps d/g/e/1 |")
    print("| --- " * 8 + "|")
    for n in [int(x) for x in args.streams.split(",")]:
        for name, (ratio, cap_tokens, cap_seqs, one_pass) in policies.items():
            r = simulate(n, ratio=ratio, cap_tokens=cap_tokens, cap_seqs=cap_seqs, seconds=args.seconds, rtt=args.rtt,
                         one_pass=one_pass, gap_ms=args.gap_ms)
            k = r["steps"]
            print(f"| {n} | {name} | {r['tok_s']:.0f} | {r['running']:.1f} | {r['queued']:.1f} | "
                  f"{r['ttft_ms'][0]:.0f}/{r['ttft_ms'][1]:.0f} | {r['itl_ms'][0]:.1f}/{r['itl_ms'][1]:.1f} "
                  f"({r['itl_ms'][1] / r['itl_ms'][0]:.2f}x) | "
                  f"{k['decode']}/{k['graph']}/{k['eager']}/{k['one_pass']} |",
                  flush=True)


if __name__ == "__main__":
    main()
