"""GPU check and decode timing on one CUDA device (run on the lent H200; not part of `make test`).

1. Parity: a tiny random llama core exported by ignition, greedy ids on CUDA (Triton and torch
   attention backends, float32 and bf16) against the CPU path; float32 logits against CPU.
2. Ceilings: device copy bandwidth and bf16 matmul rate measured in this run.
3. Decode: an 8B llama shape with random bf16 weights at batch 1, 16, 64, 256 through the engine, the
   eager runner beside the CUDA-graph runner; each as a fraction of the limit (weight + KV bytes per step
   over the measured copy bandwidth). Graph capture time of the default bucket plan.
4. Prefill: one 4096-token request, tokens/s and achieved FLOP/s as a fraction of the measured matmul rate.
5. Peers on the same weights, batch 1: HF transformers' eager generate, and static cache + torch.compile
   (mode="reduce-overhead").
Usage: python benchmarks/gpu_decode.py [--skip-8b] [--skip-parity] [--skip-hf-compile]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helios.core.manifest import Architecture  # noqa: E402
from helios.engine.messages import EngineRequest, SamplingParams  # noqa: E402


def copy_bandwidth() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    return 2 * n * reps / (e0.elapsed_time(e1) / 1e3)


def matmul_rate() -> float:
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    reps = 20
    for _ in range(reps):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    return 2 * m**3 * reps / (e0.elapsed_time(e1) / 1e3)


def parity() -> list[str]:
    from helios.core.load import load_core
    from helios.runner.model_runner import ModelRunner
    from ignition.export import ExportOptions, export_core
    from tests.ignition.tiny_models import build_tiny
    from tests.models.engine_harness import greedy, make_engine, run, tokens

    lines = []
    tmp = Path(tempfile.mkdtemp())
    for family in ("llama", "qwen3", "gemma3"):
        src = build_tiny(family, tmp / f"src-{family}", seed=0)
        core = load_core(export_core(src, tmp / f"core-{family}", ExportOptions(dtype="float32")))
        prompt = [(7 * i + 3) % 250 + 3 for i in range(37)]
        cpu = make_engine(core, num_pages=64, page_size=16, chunk=16)
        ref = tokens(run(cpu, [EngineRequest(req_id="a", prompt_token_ids=prompt, sampling=greedy(32))])["a"])
        ref_logits = ModelRunner(core.manifest.arch, core.tensors, 64, 16).forward_logits(prompt)
        for backend in ("torch", "triton"):
            for dtype in (torch.float32, torch.bfloat16):
                tensors = {k: v.to("cuda", dtype) for k, v in core.tensors.items()}
                runner = ModelRunner(core.manifest.arch, tensors, 64, 16, device="cuda", attention_backend=backend)
                logits = runner.forward_logits(prompt).float().cpu()
                err = (logits - ref_logits).norm() / ref_logits.norm()
                eng = make_engine(core, num_pages=64, page_size=16, chunk=16)
                eng.runner = ModelRunner(core.manifest.arch, tensors, 64, 16, device="cuda", attention_backend=backend)
                out = tokens(run(eng, [EngineRequest(req_id="a", prompt_token_ids=prompt, sampling=greedy(32))])["a"])
                same = sum(x == y for x, y in zip(out, ref))
                replays = eng.runner.graphs.num_replays if eng.runner.graphs is not None else 0
                lines.append(f"parity {family:7} {backend:6} {str(dtype)[6:]:9} rel-err {err:.2e}  greedy {same}/32 equal"
                             f"  (graph replays {replays})")
    return lines


LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=8192, tie_word_embeddings=False)


def llama_8b_tensors():
    """(HF model, helios tensors, Architecture, decode weight bytes) of a random bf16 8B llama on CUDA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    a = LLAMA_8B
    cfg = LlamaConfig(vocab_size=a["vocab_size"], hidden_size=a["hidden_size"], intermediate_size=a["intermediate_size"],
                      num_hidden_layers=a["num_layers"], num_attention_heads=a["num_heads"],
                      num_key_value_heads=a["num_kv_heads"], rms_norm_eps=a["rms_norm_eps"], rope_theta=a["rope_theta"],
                      max_position_embeddings=a["max_position_embeddings"], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    sd = hf.state_dict()
    t = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
         "lm_head.weight": sd["lm_head.weight"]}
    for i in range(a["num_layers"]):
        p = f"model.layers.{i}."
        t[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        t[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        t[f"layers.{i}.attn.qkv.weight"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        t[f"layers.{i}.attn.o.weight"] = sd[p + "self_attn.o_proj.weight"]
        t[f"layers.{i}.mlp.gate_up.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        t[f"layers.{i}.mlp.down.weight"] = sd[p + "mlp.down_proj.weight"]
    arch = Architecture(family="llama", **a)
    weight_bytes = sum(v.numel() * v.element_size() for k, v in t.items() if k != "embed.weight")
    weight_bytes += a["hidden_size"] * 2  # one embedding row per token
    return hf, t, arch, weight_bytes


def timed_decode(runner, arch, batch: int, prompt_len: int, new: int) -> float:
    """Decode tokens/s of `batch` requests through the engine (scheduler + runner + sampler), prefill excluded."""
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore

    page = runner.page_size
    config = SchedulerConfig(max_concurrency=batch, max_num_batched_tokens=max(2048, batch), prefill_chunk_size=2048,
                             page_size=page, num_pages=runner.num_pages, max_model_len=4096)
    runner.requests.clear()  # requests of an earlier engine on this runner (their pages are reused)
    engine = EngineCore(config, runner)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    req_ids = [f"b{batch}-r{r}" for r in range(batch)]
    for r, req_id in enumerate(req_ids):
        ids = [(r * 31 + j) % 30000 + 10 for j in range(prompt_len)]
        engine.add_request(EngineRequest(req_id=req_id, prompt_token_ids=ids, sampling=params))

    def decoding() -> bool:
        states = [runner.requests.get(req_id) for req_id in req_ids]
        return all(st is not None and len(st.sampler_state.output_token_ids) >= 2 for st in states)

    for _ in range(10_000):  # prefill (and the first decode) before the clock starts
        if decoding():
            break
        engine.step()
        if engine.error:
            raise RuntimeError(engine.error)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if engine.error:
            raise RuntimeError(engine.error)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def decode_8b(bandwidth: float, matmul: float, hf_compile: bool) -> tuple[list[str], list[tuple]]:
    from helios.engine.messages import NewRequestData, ScheduledRequest, SchedulerOutput
    from helios.runner.model_runner import ModelRunner

    a = LLAMA_8B
    hf, t, arch, weight_bytes = llama_8b_tensors()
    lines, table = [], []
    prompt_len, new = 128, 64
    num_pages = 256 * ((prompt_len + new) // 16 + 2) + 16
    t0 = time.perf_counter()
    graphed = ModelRunner(arch, t, num_pages, 16, device="cuda", dtype=torch.bfloat16, max_model_len=4096)
    lines.append(f"graphed runner: {graphed.startup.summary()} (constructed in {time.perf_counter() - t0:.1f} s)")
    st = graphed.startup
    table.append((f"graph capture, {st.num_graphs} buckets, cold ({st.kernels_jit} kernels JIT)",
                  f"{st.capture_s:.2f} s", "", ""))
    from helios.runner.cuda_graphs import GraphRunner

    again = GraphRunner(graphed.model, graphed.kv_cache, buckets=graphed.graphs.buckets, max_model_len=4096,
                        page_size=16, vocab_size=a["vocab_size"], num_kv_heads=a["num_kv_heads"], device=graphed.device)
    lines.append(f"graph capture with every kernel already loaded: {again.capture_s:.2f} s for {len(again.graphs)} graphs")
    table.append((f"graph capture, {len(again.graphs)} buckets, kernels loaded", f"{again.capture_s:.2f} s", "", ""))
    del again
    torch.cuda.empty_cache()
    eager = ModelRunner(arch, t, num_pages, 16, device="cuda", dtype=torch.bfloat16, max_model_len=4096,
                        cuda_graphs=False)
    for batch in (1, 16, 64, 256):
        kv_bytes = batch * (prompt_len + new // 2) * a["num_layers"] * 2 * a["num_kv_heads"] * a["head_dim"] * 2
        limit = bandwidth / (weight_bytes + kv_bytes) * batch
        for name, runner in (("eager", eager), ("graphs", graphed)):
            replays = runner.graphs.num_replays if runner.graphs else 0
            tps = timed_decode(runner, arch, batch, prompt_len, new)
            used = (runner.graphs.num_replays - replays) if runner.graphs else 0
            lines.append(f"helios {name:6} decode batch {batch:3}: {tps:8.1f} tok/s  limit {limit:8.1f}  "
                         f"({tps / limit:.1%})  graph replays {used}")
            table.append((f"decode {name} b={batch}", f"{tps:.1f} tok/s", f"{limit:.1f}", f"{tps / limit:.1%}"))
            torch.cuda.empty_cache()
    del eager
    torch.cuda.empty_cache()

    # prefill: one 4096-token request in one step (logits for the last row only)
    n = 4096
    ids = [(7 * j) % 30000 + 10 for j in range(n)]
    blocks = list(range(n // 16))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rates = []
    for rep in range(4):
        rid = f"prefill{rep}"
        plan = SchedulerOutput(new_requests=[NewRequestData(req_id=rid, prompt_token_ids=ids, sampling=params)],
                               scheduled=[ScheduledRequest(req_id=rid, token_ids=ids, num_computed_tokens=0,
                                                           block_ids=blocks, sample=True)],
                               finished_req_ids=[f"prefill{rep - 1}"], num_scheduled_tokens=n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphed.execute(plan)
        torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t0))
    tps = max(rates[1:])
    params_count = weight_bytes / 2
    attn_flops = 2 * n * n * a["num_heads"] * a["head_dim"] * a["num_layers"]  # causal QK^T + PV
    flops = 2 * params_count * n + attn_flops
    achieved = flops * tps / n
    lines.append(f"helios prefill {n} tokens: {tps:8.0f} tok/s = {achieved / 1e12:.0f} TFLOP/s "
                 f"({achieved / matmul:.1%} of the measured bf16 matmul rate)")
    table.append((f"prefill {n} tok", f"{tps:.0f} tok/s", f"{matmul / 1e12:.0f} TFLOP/s", f"{achieved / matmul:.1%}"))
    del graphed
    torch.cuda.empty_cache()

    # HF transformers on the same weights, batch 1
    hf_ids = torch.randint(10, 30000, (1, prompt_len), device="cuda")
    kw = dict(attention_mask=torch.ones_like(hf_ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    limit1 = bandwidth / (weight_bytes + (prompt_len + new // 2) * a["num_layers"] * 2 * a["num_kv_heads"] * 256)
    with torch.inference_mode():
        hf.generate(hf_ids, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(hf_ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        tps = new / (time.perf_counter() - t0)
    lines.append(f"HF transformers eager generate batch 1: {tps:8.1f} tok/s ({tps / limit1:.1%})")
    table.append(("HF eager generate b=1", f"{tps:.1f} tok/s", f"{limit1:.1f}", f"{tps / limit1:.1%}"))
    if hf_compile:
        try:
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead")
            ckw = dict(kw, cache_implementation="static")
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(2):  # compile + cudagraph warm-up at the timed shapes
                    hf.generate(hf_ids, max_new_tokens=new, min_new_tokens=new, **ckw)
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                t0 = time.perf_counter()
                hf.generate(hf_ids, max_new_tokens=new, min_new_tokens=new, **ckw)
                torch.cuda.synchronize()
            tps = new / (time.perf_counter() - t0)
            lines.append(f"HF static cache + torch.compile(reduce-overhead) batch 1: {tps:8.1f} tok/s "
                         f"({tps / limit1:.1%}); compile + warm-up {warm:.0f} s")
            table.append(("HF static+compile b=1", f"{tps:.1f} tok/s", f"{limit1:.1f}", f"{tps / limit1:.1%}"))
        except Exception as exc:  # the peer's failure is a result, not a crash of our benchmark
            lines.append(f"HF static cache + torch.compile failed: {type(exc).__name__}: {str(exc)[:200]}")
    return lines, table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-hf-compile", action="store_true", help="skip HF static cache + torch.compile")
    args = parser.parse_args()
    start = time.perf_counter()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    bw = copy_bandwidth()
    mm = matmul_rate()
    lines = [f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s"]
    if not args.skip_parity:
        lines += parity()
        lines.append(f"[parity done at {time.perf_counter() - start:.0f} s]")
    print("\n".join(lines), flush=True)
    table = []
    if not args.skip_8b:
        more, table = decode_8b(bw, mm, not args.skip_hf_compile)
        lines += more
    lines.append(f"[total {time.perf_counter() - start:.0f} s]")
    print("\n=== summary ===")
    print("\n".join(lines))
    if table:
        print("\n| measurement (8B llama shape, bf16) | ours | limit / peer ceiling | fraction |")
        print("| --- | --- | --- | --- |")
        for row in table:
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
