"""GPU check and decode timing on one CUDA device (run on the lent H200; not part of `make test`).

1. Parity: a tiny random llama core exported by ignition, greedy ids on CUDA (Triton and torch
   attention backends, float32 and bf16) against the CPU path; float32 logits against CPU.
2. Ceilings: device copy bandwidth and bf16 matmul rate measured in this run.
3. Decode: an 8B llama shape with random bf16 weights at batch 1, 16, 64, 256 through the engine, the
   eager runner beside the CUDA-graph runner with and without the speculative next decode step (overlap hits and
   misses printed); each as a fraction of the limit (weight + KV bytes per step over the measured copy
   bandwidth). Graph capture time of the default bucket plan.
4. Prefill: one 4096-token request, tokens/s and achieved FLOP/s as a fraction of the measured matmul rate.
5. Peers on the same weights, batch 1: HF transformers' eager generate, and static cache + torch.compile
   (mode="reduce-overhead").
6. Diagnostics: each decode graph replayed alone (GPU time per step without the engine), a kernel profile of
   the batch-1 graph, and the matmul ceiling (cuBLAS, per projection and per step).
Usage: python benchmarks/gpu_decode.py [--skip-8b] [--skip-parity] [--skip-hf-compile] [--skip-eager]
       [--skip-diagnostics]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helios.core.manifest import Architecture  # noqa: E402
from helios.engine.messages import EngineRequest, SamplingParams  # noqa: E402
from helios.switches import Switches  # noqa: E402

# the process's execution switches: this benchmark is its own composition root, so it reads HELIOS_* once, here
# (`HELIOS_GEMV=all python3 benchmarks/gpu_decode.py` runs every runner with them); variants build their own
SWITCHES = Switches.from_environ(os.environ)


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
                runner = ModelRunner(core.manifest.arch, tensors, 64, 16, device="cuda", attention_backend=backend,
                                     switches=SWITCHES)
                logits = runner.forward_logits(prompt).float().cpu()
                err = (logits - ref_logits).norm() / ref_logits.norm()
                eng = make_engine(core, num_pages=64, page_size=16, chunk=16)
                eng.runner = ModelRunner(core.manifest.arch, tensors, 64, 16, device="cuda", attention_backend=backend,
                                     switches=SWITCHES)
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


def timed_decode(runner, arch, batch: int, prompt_len: int, new: int, profiler=None,
                 ids_out: list | None = None) -> float:
    """Decode tokens/s of `batch` requests through the engine (scheduler + runner + sampler), prefill excluded;
    `profiler` (a cProfile.Profile) runs over the timed decode steps only; `ids_out` receives each request's
    output ids."""
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
    states = [runner.requests[req_id] for req_id in req_ids]
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if engine.error:
            raise RuntimeError(engine.error)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    if ids_out is not None:
        ids_out.extend(list(st.sampler_state.output_token_ids) for st in states)
    return batch * steps / elapsed


def _graph_time_ms(fn, reps: int = 20, tries: int = 5) -> float:
    """Median ms of one call of fn, captured `reps` times in one CUDA graph (launch gaps as in a decode graph)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(tries):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / reps)
    return sorted(times)[len(times) // 2]


def gemv_ceiling(t: dict, arch, bandwidth: float, limit1: float) -> list[str]:
    """What the matmuls alone allow at batch 1 and 16: each projection over all 32 layers' real weights (so no
    weight is in L2), cuBLAS via F.linear; then every matmul of one decode step. (A Triton GEMV for M <= 16
    lost to cuBLAS on every projection on the H200, 2026-12-02: 64-86% of copy bandwidth vs 55-95%.)"""
    import torch.nn.functional as F

    from helios.kernels.gemv import gemv

    lines = []
    names = {"qkv": "attn.qkv", "o": "attn.o", "gate_up": "mlp.gate_up", "down": "mlp.down"}
    layers = range(arch.num_layers)
    for m in (1, 16):
        for short, name in names.items():
            ws = [t[f"layers.{i}.{name}.weight"] for i in layers]
            n, k = ws[0].shape
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            nbytes = n * k * 2
            row = [f"GEMV m={m:2} {short:7} [{n}x{k}]"]
            for impl, f in (("cublas", F.linear), ("gemv", gemv)):
                ms = _graph_time_ms(lambda: [f(x, w) for w in ws], reps=2) / len(ws)
                row.append(f"{impl} {ms * 1e3:6.1f} us {nbytes / ms / 1e6:5.0f} GB/s ({nbytes / ms / 1e6 / (bandwidth / 1e9):.0%})")
            lines.append("  ".join(row))
    x = torch.randn(1, arch.hidden_size, dtype=torch.bfloat16, device="cuda")
    h = torch.randn(1, arch.intermediate_size, dtype=torch.bfloat16, device="cuda")
    a = torch.randn(1, arch.num_heads * arch.head_dim, dtype=torch.bfloat16, device="cuda")
    def step():
        for i in layers:
            p = f"layers.{i}."
            for inp, name in ((x, "attn.qkv"), (a, "attn.o"), (x, "mlp.gate_up"), (h, "mlp.down")):
                F.linear(inp, t[p + name + ".weight"])
        F.linear(x, t["lm_head.weight"])

    ms = _graph_time_ms(step, reps=2)
    lines.append(f"matmuls of one b=1 decode step (cuBLAS): {ms:.3f} ms = {1e3 / ms:.1f} tok/s, "
                 f"{1e3 / ms / limit1:.1%} of the limit")
    return lines


def decode_inputs(batch: int, ctx: int, page: int):
    from helios.engine.messages import ScheduledRequest

    per = -(-(ctx + 1) // page)
    return [ScheduledRequest(req_id=f"g{r}", token_ids=[5 + r], num_computed_tokens=ctx,
                             block_ids=list(range(r * per, (r + 1) * per)), sample=True) for r in range(batch)]


def graph_replays(graphed, limits: dict[int, float], ctx: int) -> list[str]:
    """GPU time of one decode step: each bucket's graph replayed alone (no engine, sampler or host copies)."""
    from helios.runner.cuda_graphs import prepare_decode_inputs

    lines = []
    for batch, limit in limits.items():
        gr = graphed.graphs
        gr.buffers.load(prepare_decode_inputs(decode_inputs(batch, ctx, gr.page_size), gr.page_size, batch))
        graph = gr.graph_for(batch, ctx + 1)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                graph.replay()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 10)
        ms = sorted(times)[3]
        tps = batch * 1e3 / ms
        lines.append(f"graph replay b={batch:3}: {ms:.3f} ms/step = {tps:8.1f} tok/s ({tps / limit:.1%} of the limit)")
    return lines


def variant_model(graphed, switches: Switches):
    """The runner's model built again over the same (bound, possibly norm-folded) weights with other switches: the
    forward path, the layers' kernels and the backend's decode path are chosen at construction; the rotary
    table is made as the runner makes it (rope_table)."""
    from helios.layers.rotary import tabulate_rope
    from helios.models import build_model
    from helios.runner.input_batch import max_table_blocks

    params = dict(graphed.model.named_parameters())  # shared, not copied
    model = build_model(graphed.arch, params, graphed.device, graphed.dtype, switches=switches,
                        norms_folded=graphed.model.norms_folded)
    if switches.rope_table:
        tabulate_rope(model, max_table_blocks(graphed.max_model_len, graphed.page_size) * graphed.page_size,
                      graphed.dtype)
    return model


def capture_under(graphed, buckets: list[int], env: dict[str, str]):
    """The runner's decode graphs for `buckets` captured again over a model built with the switches `env`'s
    HELIOS_* keys spell (helios.switches; the keys left out take their defaults, never the process's); a key
    "package.module.NAME" sets helios.package.module.NAME instead (tile constants such as
    kernels.decode_qkv.BLOCK_N), and "graphs.short_seq_len" / "graphs.short_programs" the new GraphRunner's
    short_seq_len / short_programs."""
    import importlib

    from helios.kernels.aot_shapes import SHORT_PROGRAMS
    from helios.runner.cuda_graphs import SHORT_SEQ_LEN, GraphRunner

    gr = graphed.graphs
    switches = Switches.from_environ({k: v for k, v in env.items() if "." not in k})
    attrs = {k: int(v) for k, v in env.items() if "." in k and not k.startswith("graphs.")}
    saved_attrs = {}
    for key, value in attrs.items():
        module, attr = key.rsplit(".", 1)
        mod = importlib.import_module(f"helios.{module}")
        saved_attrs[(mod, attr)] = getattr(mod, attr)
        setattr(mod, attr, value)
    try:
        return GraphRunner(variant_model(graphed, switches), graphed.kv_cache,
                           buckets=[b for b in buckets if b in gr.graphs],
                           max_model_len=gr.max_model_len, page_size=gr.page_size,
                           vocab_size=gr.buffers.logits.shape[1], num_kv_heads=graphed.arch.num_kv_heads,
                           device=graphed.device, short_seq_len=int(env.get("graphs.short_seq_len", SHORT_SEQ_LEN)),
                           short_programs=int(env.get("graphs.short_programs", SHORT_PROGRAMS)))
    finally:
        for (mod, attr), value in saved_attrs.items():
            setattr(mod, attr, value)


def variant_replays(graphed, limits: dict[int, float], ctx: int, env: dict[str, str], label: str) -> list[str]:
    """The same decode graphs captured again under `env` (HELIOS_PDL=0: no programmatic dependent launch;
    HELIOS_GEMV=all / narrow: the Triton GEMV for every / the o and down one-row projections, HELIOS_FOLD_NORMS=0
    with it: norms in their own kernels), replayed alone."""
    off = capture_under(graphed, list(limits), env)

    class _Off:  # graph_replays reads .graphs
        graphs = off

    lines = [line.replace("graph replay", f"graph replay, {label}") for line in graph_replays(_Off, limits, ctx)]
    del off
    torch.cuda.empty_cache()
    return lines


def _variant(gemv: str = "narrow", fused: str = "1", l2: str = "0", pdl: str = "", gemv_pdl: str = "1",
             block_n: int = 64, warps: int = 4, norm_warps: int = 8, short: int = 256,
             fold: str = "1", defer: str = "1", programs: int = 64, merge: int = 1, wide: int = 1,
             rope_table: str = "1") -> dict[str, str]:
    """Every switch a b=1 decode graph's model is built with, spelled out as HELIOS_* values (the process's switches
    never leak in), and the one-launch decode's tiles; the defaults are helios' own."""
    return {"HELIOS_GEMV": gemv, "HELIOS_FUSED_DECODE": fused, "HELIOS_L2_PREFETCH": l2, "HELIOS_PDL": pdl,
            "HELIOS_GEMV_PDL": gemv_pdl, "kernels.decode_qkv.BLOCK_N": str(block_n),
            "kernels.decode_qkv.NUM_WARPS": str(warps), "kernels.rmsnorm.WIDE_ROW_WARPS": str(norm_warps),
            "graphs.short_seq_len": str(short), "HELIOS_FOLD_NORMS": fold, "HELIOS_DEFER_NORMS": defer,
            "graphs.short_programs": str(programs), "kernels.decode_qkv.MERGE_IN_KERNEL": str(merge),
            "kernels.gemv.NORM_FREE_WIDE": str(wide), "HELIOS_ROPE_TABLE": rope_table}


# label -> switches: cuBLAS or the GEMV for which projections (HELIOS_GEMV), decode attention in one launch from
# the qkv row or after rotary_cache (HELIOS_FUSED_DECODE) and its tiles, the norm kernel's warps, the o weight
# pulled into L2 beside attention (HELIOS_L2_PREFETCH), programmatic dependent launch (HELIOS_PDL, HELIOS_GEMV_PDL).
# Measured and dropped (H200, 2026-12-03, session 4; b=1 engine, same process): the add + RMSNorm in the o / down
# GEMV's last program 74.5% against 82.3%; decode tiles of 128 keys x 4 / x 8 warps 71.3 / 74.5%, 32 keys 74.3%,
# 64 keys x 2 warps 38.0% (all beside that tail: the 64 x 4 default 74.5%); next call (copy 4272 GB/s): default
# 80.9 / 81.5%, PDL on 74.6 / 75.4%, pinned 16 decode splits + merge for short sequences 80.8 / 81.6% (decode 4.5 us
# + merge 1.8 us against 6.9 us), 32-key tiles with those splits 81.6 / 80.9%, the 4096-wide norm on 4 warps 81.0 /
# 81.7% and on 16 warps 81.6 / 80.7%, o in L2 77.6 / 77.7%, cuBLAS 78.1 / 77.9%; last call (copy 4217 GB/s): default
# 84.5 / 84.4%, the folded norm scaled after the dot (no statistics pass; removed) 77.0 / 77.0% with the GEMV for
# all and 83.1 / 83.2% for qkv/o/down, beside the statistics pass 82.4 / 82.1% and 84.1 / 83.9%.
# Session 5 (H200, 2026-12-03): the norm-free layers 83.3-83.7% (cuBLAS qkv / gate_up / lm_head) and 86.6-86.7% (GEMV
# for all) against 81.2-81.3% for session 4's default; next call 84.7-85.0% for every norm-free form against 82.9-83.0%;
# short-step decode splits 1 / 2 / 4 / 8: 83.0 / 82.7 / 83.4 / 83.7%.
# Session 6 (H200, 2026-12-03): PDL with the norm-free layers 87.6-87.7% against 84.7-84.9% without; qkv in 8 x 256
# tiles 85.3-85.4% without PDL, 86.9% with it (and other greedy ids: another summation order); the rope table 84.7-84.9%
# against 84.8-84.9% computed each step.
ENGINE_VARIANTS = {
    "norm-free layers with PDL, GEMV for every projection, 8 short splits, rope table (default)": _variant(),
    "norm-free layers without PDL (session 5's default, rope table)": _variant(pdl="0"),
    "norm kernels, GEMV o / down, one split (the session-4 default)": _variant(defer="0", programs=0),
}


def engine_variants(graphed, arch, prompt_len: int, limit: float, variants: dict[str, dict[str, str]],
                    repeats: int = 2) -> list[str]:
    """Batch-1 engine decode (graphs and the speculative next step on) with the b=1 decode graphs captured
    again under each variant's environment; the default graphs first; the whole list `repeats` times, so the
    spread between repeats shows the noise."""
    lines = []
    graphed.decode_overlap = True
    first_ids = None
    for label, env in [("default", {})] + [item for _ in range(repeats) for item in variants.items()]:
        saved = graphed.graphs
        graphed.graphs = capture_under(graphed, [1], env) if env else saved
        ids: list = []
        try:
            tps = timed_decode(graphed, arch, 1, prompt_len, 64, ids_out=ids)
        finally:
            graphed.graphs = saved
        first_ids = first_ids or ids[0]
        same = next((f"greedy ids differ from token {i}" for i, (a, b) in enumerate(zip(ids[0], first_ids)) if a != b),
                    "greedy ids as the default's")
        lines.append(f"engine b=1, {label}: {tps:.1f} tok/s ({tps / limit:.1%} of the limit), {same}")
        torch.cuda.empty_cache()
    return lines


def profile_graph(graphed, ctx: int, env: dict[str, str], label: str, rows: int = 24, batch: int = 1) -> list[str]:
    """Kernel time inside the b=`batch` decode graph captured under `env` (torch.profiler over 5 replays), summed per
    kernel name and grid (so each projection's GEMV is its own row). Run with HELIOS_PDL=0: under PDL a
    kernel's span starts at its early launch and includes the wait for the kernel before it."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from helios.runner.cuda_graphs import prepare_decode_inputs

    gr = capture_under(graphed, [batch], env)
    gr.buffers.load(prepare_decode_inputs(decode_inputs(batch, ctx, gr.page_size), gr.page_size, batch))
    graph = gr.graph_for(batch, ctx + 1)
    graph.replay()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    groups: dict[tuple, list[float]] = {}
    spans = []
    for evt in trace.get("traceEvents", []):
        if evt.get("cat") != "kernel":
            continue
        key = (evt["name"][:60], str(evt.get("args", {}).get("grid")))
        groups.setdefault(key, []).append(float(evt["dur"]))
        spans.append((float(evt["ts"]), float(evt["ts"]) + float(evt["dur"])))
    stats = sorted(((sum(d) / reps, len(d) // reps, k) for k, d in groups.items()), reverse=True)
    total = sum(s[0] for s in stats)
    spans.sort()
    wall = (spans[-1][1] - spans[0][0]) / reps if spans else 0.0
    lines = [f"profile b={batch} graph, {label}: {sum(s[1] for s in stats)} kernels/step, {total / 1e3:.3f} ms of kernel "
             f"time/step, first start to last end {wall / 1e3:.3f} ms/step (gaps {(wall - total) / 1e3:.3f} ms)"]
    for us, count, (name, grid) in stats[:rows]:
        lines.append(f"  {us:8.1f} us  x{count:4}  {us / max(count, 1):6.1f} us each  grid {grid:14} {name}")
    del gr
    torch.cuda.empty_cache()
    return lines


def engine_timeline(runner, arch, prompt_len: int, steps: int = 16, batch: int = 1) -> list[str]:
    """Where a batch-1 engine step's time goes (graphs and the speculative next step on): the host's waits in
    CUDA event syncs per step, then torch.profiler over `steps` engine steps: the GPU ops outside the decode
    graph (those seen about once a step), the idle gaps between GPU ops, and the CUDA runtime calls' host time."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    runner.decode_overlap = True
    waits: list[float] = []
    original = torch.cuda.Event.synchronize

    def timed_sync(self):
        t0 = time.perf_counter()
        original(self)
        waits.append(time.perf_counter() - t0)

    torch.cuda.Event.synchronize = timed_sync
    try:
        t0 = time.perf_counter()
        tps = timed_decode(runner, arch, batch, prompt_len, 64) / batch
        wall = time.perf_counter() - t0
    finally:
        torch.cuda.Event.synchronize = original
    lines = [f"timeline b={batch}: engine {tps * batch:.1f} tok/s = {1e3 / tps:.3f} ms/step; event syncs {len(waits)} waiting "
             f"{sum(waits) * 1e3:.1f} ms of {wall * 1e3:.0f} ms (mean {sum(waits) / max(len(waits), 1) * 1e3:.3f} ms, "
             f"min {min(waits, default=0) * 1e3:.3f})"]
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore

    page = runner.page_size
    config = SchedulerConfig(max_concurrency=batch, max_num_batched_tokens=max(2048, batch), prefill_chunk_size=2048,
                             page_size=page, num_pages=runner.num_pages, max_model_len=4096)
    runner.requests.clear()
    engine = EngineCore(config, runner)
    for r in range(batch):
        ids = [(31 * (r + 1) + j) % 30000 + 10 for j in range(prompt_len)]
        engine.add_request(EngineRequest(req_id=f"timeline{r}", prompt_token_ids=ids, sampling=SamplingParams(
            temperature=0.0, max_tokens=steps + 8 + batch // 16, ignore_eos=True)))
    for _ in range(4 + batch // 16):  # prefill and the first decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    gpu, runtime = [], {}
    for evt in trace.get("traceEvents", []):
        cat = evt.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append((float(evt["ts"]), float(evt["ts"]) + float(evt.get("dur", 0)), evt["name"][:70]))
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            runtime.setdefault(evt["name"], []).append(float(evt.get("dur", 0)))
    gpu.sort()
    if not gpu:
        return lines + ["timeline: no GPU events traced"]
    span = gpu[-1][1] - gpu[0][0]
    end = gpu[0][0]
    gaps: dict[tuple[str, str], list[float]] = {}
    for (s0, e0, n0), (s1, _, n1) in zip(gpu, gpu[1:]):
        end = max(end, e0)
        if s1 - end > 2.0:
            gaps.setdefault((n0[:40], n1[:40]), []).append(s1 - end)
    merged, cur_s, cur_e = 0.0, gpu[0][0], gpu[0][1]
    for s0, e0, _ in gpu[1:]:
        if s0 > cur_e:
            merged += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    busy = merged + cur_e - cur_s
    counts: dict[str, list[float]] = {}
    for s0, e0, name in gpu:
        counts.setdefault(name, []).append(e0 - s0)
    lines.append(f"timeline b={batch} under the profiler: {steps} steps, GPU span {span / 1e3:.3f} ms = "
                 f"{span / steps / 1e3:.3f} ms/step, busy {busy / steps / 1e3:.3f} ms/step, idle "
                 f"{(span - busy) / steps / 1e3:.3f} ms/step, {len(gpu) / steps:.0f} GPU ops/step")
    lines.append("  GPU ops seen <= 3 times a step (outside the graph's per-layer kernels):")
    for name, durs in sorted(counts.items(), key=lambda kv: -sum(kv[1])):
        if len(durs) <= 3 * steps:
            lines.append(f"    {sum(durs) / steps:8.1f} us/step  x{len(durs) / steps:4.1f}  {name}")
    lines.append("  idle gaps > 2 us on the GPU (per step, by the ops around them):")
    for (before, after), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]:
        lines.append(f"    {sum(g) / steps:8.1f} us/step  x{len(g) / steps:4.1f}  {before} -> {after}")
    lines.append("  CUDA runtime calls (host time per step):")
    for name, durs in sorted(runtime.items(), key=lambda kv: -sum(kv[1]))[:10]:
        lines.append(f"    {sum(durs) / steps:8.1f} us/step  x{len(durs) / steps:4.1f}  {name}")
    return lines


def random_8b_runner(layers: int, num_pages: int = 64, max_model_len: int = 512):
    """A CUDA ModelRunner of the 8B llama shape cut to `layers` layers, random bf16 weights made on the device, a KV
    pool of num_pages 16-token pages. Returns (runner, arch)."""
    from helios.runner.model_runner import ModelRunner

    a = dict(LLAMA_8B, num_layers=layers)
    arch = Architecture(family="llama", **a)
    h, f, v = a["hidden_size"], a["intermediate_size"], a["vocab_size"]
    qkv = (a["num_heads"] + 2 * a["num_kv_heads"]) * a["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)

    t = {"embed.weight": rnd(v, h), "norm.weight": torch.ones(h, device="cuda", dtype=torch.bfloat16),
         "lm_head.weight": rnd(v, h)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({p + "attn_norm.weight": torch.ones(h, device="cuda", dtype=torch.bfloat16),
                  p + "mlp_norm.weight": torch.ones(h, device="cuda", dtype=torch.bfloat16),
                  p + "attn.qkv.weight": rnd(qkv, h), p + "attn.o.weight": rnd(h, a["num_heads"] * a["head_dim"]),
                  p + "mlp.gate_up.weight": rnd(2 * f, h), p + "mlp.down.weight": rnd(h, f)})
    runner = ModelRunner(arch, t, num_pages, 16, device="cuda", dtype=torch.bfloat16, max_model_len=max_model_len,
                         switches=SWITCHES)
    return runner, arch


def host_profile(layers: int = 2, rows: int = 28) -> list[str]:
    """Where a batch-1 engine step's host time goes: the 8B shape cut to `layers` layers (random weights made
    on the device), its graph replayed alone vs a whole engine step, then cProfile over 64 engine steps."""
    import cProfile
    import io
    import pstats

    from helios.runner.cuda_graphs import prepare_decode_inputs

    runner, arch = random_8b_runner(layers)
    gr = runner.graphs
    gr.buffers.load(prepare_decode_inputs(decode_inputs(1, 160, 16), 16, 1))
    graph = gr.graph_for(1, 161)
    graph.replay()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(50):
        graph.replay()
    e1.record()
    torch.cuda.synchronize()
    replay_ms = e0.elapsed_time(e1) / 50
    timed_decode(runner, arch, 1, 128, 16)  # warm
    prof = cProfile.Profile()
    tps = timed_decode(runner, arch, 1, 128, 65, profiler=prof)
    step_ms = 1e3 / tps
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    lines = [f"host profile ({layers} layers of the 8B shape, b=1): graph replay {replay_ms:.3f} ms, engine step "
             f"{step_ms:.3f} ms (with cProfile on), host part ~{step_ms - replay_ms:.3f} ms"]
    lines += [ln for ln in out.getvalue().splitlines() if ln.strip()][:rows + 8]
    return lines


DIAGNOSTICS = "graphs,pdl,gemv,gemv_pdl,narrow,narrow_pdl,profile,profile_gemv,ceiling,timeline,engines"


def decode_8b(bandwidth: float, matmul: float, hf_compile: bool, eager: bool = True, diagnose: tuple[str, ...] = (),
              batches: tuple[int, ...] = (1, 16, 64, 256), prefill: bool = True,
              hf: bool = True) -> tuple[list[str], list[tuple]]:
    from helios.engine.messages import NewRequestData, ScheduledRequest, SchedulerOutput
    from helios.runner.model_runner import ModelRunner

    a = LLAMA_8B
    hf_model, t, arch, weight_bytes = llama_8b_tensors()
    lines, table = [], []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
    prompt_len, new = 128, 64
    num_pages = 256 * ((prompt_len + new) // 16 + 2) + 16
    t0 = time.perf_counter()
    graphed = ModelRunner(arch, t, num_pages, 16, device="cuda", dtype=torch.bfloat16, max_model_len=4096,
                          switches=SWITCHES)
    lines.append(f"graphed runner: {graphed.startup.summary()} (constructed in {time.perf_counter() - t0:.1f} s)")
    st = graphed.startup
    table.append((f"graph capture, {st.num_graphs} graphs, cold ({st.kernels_jit} kernels JIT)",
                  f"{st.capture_s:.2f} s", "", ""))
    from helios.runner.cuda_graphs import GraphRunner

    again = GraphRunner(graphed.model, graphed.kv_cache, buckets=graphed.graphs.buckets, max_model_len=4096,
                        page_size=16, vocab_size=a["vocab_size"], num_kv_heads=a["num_kv_heads"], device=graphed.device)
    num_again = len(again.graphs) + len(again.short_graphs)
    lines.append(f"graph capture with every kernel already loaded: {again.capture_s:.2f} s for {num_again} graphs")
    table.append((f"graph capture, {num_again} graphs, kernels loaded", f"{again.capture_s:.2f} s", "", ""))
    del again
    torch.cuda.empty_cache()
    eager = ModelRunner(arch, t, num_pages, 16, device="cuda", dtype=torch.bfloat16, max_model_len=4096,
                        cuda_graphs=False, switches=SWITCHES) if eager else None
    limits, bounds = {}, {}
    for batch in (1, 16, 64, 256):
        kv_bytes = batch * (prompt_len + new // 2) * a["num_layers"] * 2 * a["num_kv_heads"] * a["head_dim"] * 2
        limits[batch] = bandwidth / (weight_bytes + kv_bytes) * batch
        # the roofline bound: the projections' step at the slower of reading their weights and their matmul rate
        # (2 flops a weight a row), then the KV read; at b=256 on an H200 the matmul rate binds the projections
        projections = max(weight_bytes / bandwidth, 2 * (weight_bytes / 2) * batch / matmul)
        bounds[batch] = batch / (projections + kv_bytes / bandwidth)
    if diagnose:
        ctx = prompt_len + new // 2
        # batch 1 at a long context too: the graph with the bucket's pinned decode splits (and their merge)
        long_ctx = 2048
        kv_long = long_ctx * a["num_layers"] * 2 * a["num_kv_heads"] * a["head_dim"] * 2

        def long_replay() -> list[str]:
            return [line.replace("b=  1", f"b=  1 at {long_ctx} keys")
                    for line in graph_replays(graphed, {1: bandwidth / (weight_bytes + kv_long)}, long_ctx)]
        one = {1: limits[1]}
        parts = {
            "timeline": lambda: engine_timeline(graphed, arch, prompt_len),
            "timeline256": lambda: engine_timeline(graphed, arch, prompt_len, batch=256),
            "graphs": lambda: long_replay() + graph_replays(graphed, limits, ctx),
            "pdl": lambda: variant_replays(graphed, limits, ctx, {"HELIOS_PDL": "0"}, "PDL off"),
            "gemv": lambda: variant_replays(graphed, one, ctx, {"HELIOS_GEMV": "all"}, "GEMV for all"),
            "gemv_pdl": lambda: variant_replays(graphed, one, ctx, {"HELIOS_GEMV": "all", "HELIOS_PDL": "0"},
                                                "GEMV for all, PDL off"),
            "narrow": lambda: variant_replays(graphed, one, ctx, {"HELIOS_GEMV": "narrow"}, "GEMV for o/down only"),
            "narrow_pdl": lambda: variant_replays(graphed, one, ctx, {"HELIOS_GEMV": "narrow", "HELIOS_PDL": "0"},
                                                  "GEMV for o/down only, PDL off"),
            "profile": lambda: profile_graph(graphed, ctx, {"HELIOS_PDL": "0"}, "PDL off"),
            "profile256": lambda: profile_graph(graphed, ctx, {"HELIOS_PDL": "0"}, "PDL off", rows=30, batch=256),
            "profile64": lambda: profile_graph(graphed, ctx, {"HELIOS_PDL": "0"}, "PDL off", rows=20, batch=64),
            "profile_norm4": lambda: profile_graph(graphed, ctx, {"kernels.rmsnorm.WIDE_ROW_WARPS": "4"},
                                                   "4096-wide norm on 4 warps"),
            "profile_splits": lambda: profile_graph(graphed, ctx, {"graphs.short_seq_len": "0"},
                                                    "pinned decode splits + merge"),
            "profile_gemv": lambda: profile_graph(graphed, ctx, {"HELIOS_PDL": "0", "HELIOS_GEMV": "all"},
                                                  "PDL off, GEMV for all"),
            "profile_narrow": lambda: profile_graph(graphed, ctx, {"HELIOS_PDL": "0", "HELIOS_GEMV": "narrow"},
                                                    "PDL off, GEMV for o/down only"),
            "profile_unfused": lambda: profile_graph(graphed, ctx, {"HELIOS_PDL": "0", "HELIOS_FUSED_DECODE": "0"},
                                                     "PDL off, rotary + cache write in their own launch"),
            "profile_l2": lambda: profile_graph(graphed, ctx, {"HELIOS_PDL": "0", "HELIOS_L2_PREFETCH": "bulk"},
                                                "PDL off, o weight prefetched to L2 (bulk)"),
            "ceiling": lambda: gemv_ceiling(t, arch, bandwidth, limits[1]),
            "engines": lambda: engine_variants(graphed, arch, prompt_len, limits[1], ENGINE_VARIANTS),
        }
        for name in diagnose:
            part = parts[name]
            try:
                more = part()
            except Exception as exc:  # a failed diagnostic must not cost the figures after it
                more = [f"diagnostic failed: {type(exc).__name__}: {str(exc)[:300]}"]
            print("\n".join(more), flush=True)
            lines += more
    for batch in batches:
        limit = limits[batch]
        # graphs with and without the speculative next decode step (runner/decode_overlap.py)
        for name, runner, overlap in (("eager", eager, False), ("graphs", graphed, True),
                                      ("graphs-no-overlap", graphed, False)):
            if runner is None:
                continue
            runner.decode_overlap = overlap
            # NOTE: two runs, the second counted: a batch's first run on a runner also pays its one-time costs
            # (the sampler's and the speculation's buffers for that many rows); session 24's H200 run read 35.0%
            # with the speculation against 41.9% without it, each from a single run
            first = timed_decode(runner, arch, batch, prompt_len, new)
            replays = runner.graphs.num_replays if runner.graphs else 0
            hits, misses = runner.overlap_hits, runner.overlap_misses
            tps = timed_decode(runner, arch, batch, prompt_len, new)
            used = (runner.graphs.num_replays - replays) if runner.graphs else 0
            say(f"helios {name:6} decode batch {batch:3}: {tps:8.1f} tok/s  limit {limit:8.1f}  "
                f"({tps / limit:.1%}; roofline bound {bounds[batch]:.1f}: {tps / bounds[batch]:.1%})  graph replays "
                f"{used}  overlap hits {runner.overlap_hits - hits} misses {runner.overlap_misses - misses} (first "
                f"run {first:.1f} tok/s)")
            table.append((f"decode {name} b={batch}", f"{tps:.1f} tok/s", f"{limit:.1f} (roofline {bounds[batch]:.1f})",
                          f"{tps / limit:.1%} ({tps / bounds[batch]:.1%})"))
            torch.cuda.empty_cache()
    del eager
    torch.cuda.empty_cache()

    if prefill:
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
        say(f"helios prefill {n} tokens: {tps:8.0f} tok/s = {achieved / 1e12:.0f} TFLOP/s "
                     f"({achieved / matmul:.1%} of the measured bf16 matmul rate)")
        table.append((f"prefill {n} tok", f"{tps:.0f} tok/s", f"{matmul / 1e12:.0f} TFLOP/s", f"{achieved / matmul:.1%}"))

    del graphed
    torch.cuda.empty_cache()

    if not hf:
        return lines, table
    # HF transformers on the same weights, batch 1
    hf_ids = torch.randint(10, 30000, (1, prompt_len), device="cuda")
    kw = dict(attention_mask=torch.ones_like(hf_ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    limit1 = bandwidth / (weight_bytes + (prompt_len + new // 2) * a["num_layers"] * 2 * a["num_kv_heads"] * 256)
    with torch.inference_mode():
        hf_model.generate(hf_ids, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf_model.generate(hf_ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        tps = new / (time.perf_counter() - t0)
    say(f"HF transformers eager generate batch 1: {tps:8.1f} tok/s ({tps / limit1:.1%})")
    table.append(("HF eager generate b=1", f"{tps:.1f} tok/s", f"{limit1:.1f}", f"{tps / limit1:.1%}"))
    if hf_compile:
        # HF's documented path: a static cache makes generate compile the forward itself
        # (generation_config.compile_config, mode "reduce-overhead"); our own torch.compile over it re-used
        # CUDA-graph outputs across steps ("accessing tensor output of CUDAGraphs that has been overwritten").
        try:
            ckw = dict(kw, cache_implementation="static")
            t0 = time.perf_counter()
            with torch.inference_mode():
                for _ in range(3):  # compile + cudagraph warm-up at the timed shapes
                    torch.compiler.cudagraph_mark_step_begin()
                    hf_model.generate(hf_ids, max_new_tokens=new, min_new_tokens=new, **ckw)
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                torch.compiler.cudagraph_mark_step_begin()
                t0 = time.perf_counter()
                hf_model.generate(hf_ids, max_new_tokens=new, min_new_tokens=new, **ckw)
                torch.cuda.synchronize()
            tps = new / (time.perf_counter() - t0)
            say(f"HF static cache + generate's torch.compile batch 1: {tps:8.1f} tok/s "
                         f"({tps / limit1:.1%}); compile + warm-up {warm:.0f} s; compiled forward: "
                         f"{getattr(hf_model, '_compiled_call', None) is not None}")
            table.append(("HF static cache + compile b=1", f"{tps:.1f} tok/s", f"{limit1:.1f}", f"{tps / limit1:.1%}"))
        except Exception as exc:  # the peer's failure is a result, not a crash of our benchmark
            say(f"HF static cache + torch.compile failed: {type(exc).__name__}: {str(exc)[:300]}")
    return lines, table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-hf-compile", action="store_true", help="skip HF static cache + torch.compile")
    parser.add_argument("--skip-eager", action="store_true", help="skip helios' eager (no-graph) decode figures")
    parser.add_argument("--skip-diagnostics", action="store_true", help="skip graph replays, profile, GEMV")
    parser.add_argument("--diagnostics", default=DIAGNOSTICS, help="which diagnostics, in order (comma list)")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="skip both HF transformers peers")
    parser.add_argument("--batches", default="1,16,64,256", help="engine decode batch sizes")
    parser.add_argument("--host-profile", action="store_true", help="only: where a b=1 engine step's host time goes")
    args = parser.parse_args()
    start = time.perf_counter()
    print(torch.__version__, torch.cuda.get_device_name(), SWITCHES.describe(), flush=True)
    if args.host_profile:
        print("\n".join(host_profile()), flush=True)
        return
    bw = copy_bandwidth()
    mm = matmul_rate()
    lines = [f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s"]
    if not args.skip_parity:
        lines += parity()
        lines.append(f"[parity done at {time.perf_counter() - start:.0f} s]")
    print("\n".join(lines), flush=True)
    table = []
    if not args.skip_8b:
        more, table = decode_8b(bw, mm, not args.skip_hf_compile, not args.skip_eager,
                                () if args.skip_diagnostics else tuple(args.diagnostics.split(",")),
                                tuple(int(b) for b in args.batches.split(",")), not args.skip_prefill,
                                not args.skip_hf)
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
