"""H200 microbenchmark of helios.kernels.gemv against cuBLAS on the 8B-llama decode projections (not `make test`).

1. Copy bandwidth of this run (a 2 GiB device-to-device copy, bytes read + written over time): the ceiling.
2. Each projection alone (qkv, o, gate_up, down, lm_head) at M = 1: cuBLAS F.linear, then the GEMV over a sweep
   of tile configs with PDL on and off; M = 4 and 16 briefly. Every variant is checked against F.linear first.
3. A layer-like chain at M = 1 over 32 layer-weight sets in one graph: rmsnorm -> qkv -> elementwise -> o ->
   fused add + rmsnorm -> gate_up -> silu_and_mul -> down (-> the next layer's fused add + rmsnorm), with
   all-cuBLAS, all-GEMV (PDL on, then off) and mixed (GEMV for qkv/o, cuBLAS for gate_up/down) projections.
Timing: `reps` calls captured in a CUDA graph, replays timed with CUDA events, median of several tries; calls
rotate among enough weight copies that the working set is far past the 50 MB L2. Random data throughout.
NOTE: projections timed "alone" are back-to-back independent calls; with PDL they may overlap one another.
Usage: python benchmarks/gpu_gemv.py [--dry]   (--dry: CPU, Triton interpreter, tiny shapes, no timing)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helios.kernels._triton import forced_pdl, jit, pdl_launch_dependents, pdl_wait, tl, use_pdl  # noqa: E402
from helios.kernels.activation import silu_and_mul  # noqa: E402
from helios.kernels.gemv import default_config, gemv  # noqa: E402
from helios.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402

# name -> (K, N) of llama-3-8B: hidden 4096, 32 q heads + 2 * 8 kv heads of 128, intermediate 14336
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}
DRY_SHAPES = {"qkv": (64, 96), "o": (64, 64), "gate_up": (64, 160), "down": (80, 64), "lm_head": (64, 200)}
# (block_n, block_k, num_warps, num_stages, split_k); compiled kernels are shared across shapes
SWEEP = [(8, 512, 4, 1, 1), (4, 512, 4, 1, 1), (16, 512, 4, 1, 1), (8, 1024, 4, 1, 1), (8, 256, 4, 1, 1),
         (8, 512, 8, 1, 1), (16, 512, 8, 1, 1), (16, 1024, 8, 1, 1), (8, 512, 4, 3, 1), (4, 1024, 4, 1, 1),
         (8, 512, 4, 1, 2), (8, 512, 4, 1, 4), (16, 512, 4, 1, 2)]
DRY_SWEEP = [(8, 32, 4, 1, 1), (16, 64, 4, 1, 2)]
KEYS = ("block_n", "block_k", "num_warps", "num_stages", "split_k")
SWEEP_BUDGET_S = 120.0
ROWS: list[str] = []
DRY = "--dry" in sys.argv


def pdl_mode(pdl: bool | None):
    """forced_pdl(pdl); in --dry the interpreter has no PDL, so the device (CPU: off) decides."""
    return forced_pdl(None if DRY else pdl)


def log(line: str) -> None:
    print(line, flush=True)


def guarded(label: str, fn, *args, **kwargs):
    """Run one variant; a failure prints one line and returns None so the rest still runs."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a benchmark keeps going
        log(f"ERROR {label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        if os.environ.get("GEMV_BENCH_TRACE"):
            traceback.print_exc()
        return None


# --- timing -------------------------------------------------------------------------------------------


def copy_bandwidth(dry: bool) -> float:
    if dry:
        return float("nan")
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    return 2 * n * 10 / (e0.elapsed_time(e1) / 1e3)


def time_graph(step, reps: int, dry: bool, tries: int = 5) -> float:
    """Seconds per step(i): reps calls in one CUDA graph, median over tries replays."""
    if dry:
        for i in range(2):
            step(i)
        return float("nan")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):  # compile, autotune handles, allocator
            step(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(tries):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3 / reps)
    del graph
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --- projections alone --------------------------------------------------------------------------------


class Projection:
    """Random weight copies of one shape (enough to defeat the L2) and a random x."""

    def __init__(self, name, k, n, m, device, dtype, dry):
        self.name, self.k, self.n, self.m = name, k, n, m
        self.bytes = n * k * dtype.itemsize + m * (k + n) * dtype.itemsize
        num_copies = 2 if dry else max(4, math.ceil(400e6 / (n * k * dtype.itemsize)))
        self.weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(num_copies)]
        self.x = torch.randn(m, k, device=device, dtype=dtype)
        self.reps = 4 if dry else max(10, min(200, int(2e-3 / (self.bytes / 4e12))))

    def check(self, fn) -> float:
        out = fn(self.x, self.weights[1])
        err = rel_err(out, F.linear(self.x.float(), self.weights[1].float()))
        if not err < 1e-2 or out.isnan().any():
            raise AssertionError(f"rel err {err:.2e} against F.linear")
        return err

    def time(self, fn, dry) -> float:
        ws, x = self.weights, self.x
        return time_graph(lambda i: fn(x, ws[i % len(ws)]), self.reps, dry)


def gemv_fn(cfg):
    kw = dict(zip(KEYS, cfg))
    return lambda x, w: gemv(x, w, **kw)


def run_variant(proj: Projection, label: str, fn, pdl: bool | None, dry: bool, bw: float):
    with pdl_mode(pdl):
        proj.check(fn)
        t = proj.time(fn, dry)
    frac = proj.bytes / t / bw if t == t and bw == bw else float("nan")
    ROWS.append(f"{proj.name:8s} M={proj.m:<3d} {label:34s} {t * 1e6:9.2f} us  {frac * 100:6.1f}% of copy bw")
    log(ROWS[-1])
    return t


def sweep_shapes(shapes, sweep, device, dtype, dry, bw) -> dict:
    best: dict[str, tuple[float, tuple]] = {}
    start = time.perf_counter()
    for name, (k, n) in shapes.items():
        proj = guarded(f"{name} alloc", Projection, name, k, n, 1, device, dtype, dry)
        if proj is None:
            continue
        guarded(f"{name} cublas", run_variant, proj, "cublas F.linear", F.linear, None, dry, bw)
        # a bias sends torch's addmm to cuBLASLt (another heuristic, other kernels than the plain GEMV path)
        zero_bias = torch.zeros(n, device=device, dtype=dtype)
        guarded(f"{name} cublaslt", run_variant, proj, "cublasLt F.linear + zero bias",
                lambda x, w: F.linear(x, w, zero_bias), None, dry, bw)
        default = tuple(default_config(1, n, k, dtype))
        configs = [default] + [c for c in sweep if c != default and not (c[4] > 1 and n > 8192)]
        for cfg in configs:
            if time.perf_counter() - start > SWEEP_BUDGET_S:
                log(f"sweep budget spent: skipping the rest of {name}")
                break
            for pdl in (True, False):
                label = f"gemv {'pdl' if pdl else 'nopdl'} " + ",".join(map(str, cfg)) + (" (default)" if cfg == default else "")
                t = guarded(f"{name} {label}", run_variant, proj, label, gemv_fn(cfg), pdl, dry, bw)
                if pdl and t is not None and (name not in best or t < best[name][0]):
                    best[name] = (t, cfg)
        del proj
        if not dry:
            torch.cuda.empty_cache()
    return {name: cfg for name, (t, cfg) in best.items()}


def batch_shapes(shapes, best, device, dtype, dry, bw) -> None:
    for m in (4, 16):
        for name, (k, n) in shapes.items():
            proj = guarded(f"{name} M={m} alloc", Projection, name, k, n, m, device, dtype, dry)
            if proj is None:
                continue
            guarded(f"{name} M={m} cublas", run_variant, proj, "cublas F.linear", F.linear, None, dry, bw)
            guarded(f"{name} M={m} gemv default", run_variant, proj, "gemv pdl default", gemv_fn(tuple(default_config(m, n, k, dtype))), True, dry, bw)
            if name in best:
                guarded(f"{name} M={m} gemv best1", run_variant, proj, "gemv pdl best-at-M1 " + ",".join(map(str, best[name])),
                        gemv_fn(best[name]), True, dry, bw)
            del proj
            if not dry:
                torch.cuda.empty_cache()


# --- a layer-like chain -------------------------------------------------------------------------------


@jit
def _attention_stand_in_kernel(
    qkv_ptr,  # [M, q_width + 2 * v_width]
    out_ptr,  # [M, q_width]
    q_width,
    v_width,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < q_width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    width = q_width + 2 * v_width
    q = tl.load(qkv_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(qkv_ptr + row * width + q_width + v_width + offs % v_width, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * q_width + offs, (q * tl.sigmoid(v)).to(out_ptr.dtype.element_ty), mask=mask)


def attention_stand_in(qkv: torch.Tensor, q_width: int) -> torch.Tensor:
    v_width = (qkv.shape[1] - q_width) // 2
    out = torch.empty(qkv.shape[0], q_width, dtype=qkv.dtype, device=qkv.device)
    pdl = use_pdl(qkv, qkv.shape[0])
    _attention_stand_in_kernel[(qkv.shape[0], -(-q_width // 1024))](
        qkv, out, q_width, v_width, BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


class Layers:
    def __init__(self, shapes, num_layers, device, dtype):
        hidden = shapes["o"][1]
        self.hidden = hidden
        self.weights = [{name: torch.randn(n, k, device=device, dtype=dtype) / k**0.5
                         for name, (k, n) in shapes.items() if name != "lm_head"} for _ in range(num_layers)]
        self.norms = [(1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
                       1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)) for _ in range(num_layers)]
        self.x = torch.randn(1, hidden, device=device, dtype=dtype)
        self.bytes = sum(w.numel() * w.element_size() for w in self.weights[0].values())

    def forward(self, projs: dict) -> torch.Tensor:
        """projs: name -> fn(x, weight). Returns the final residual."""
        residual, down = self.x, None
        for w, (ln1, ln2) in zip(self.weights, self.norms):
            if down is None:
                h = rms_norm(residual, ln1, 1e-5)
            else:
                h, residual = fused_add_rms_norm(down, residual, ln1, 1e-5)
            qkv = projs["qkv"](h, w["qkv"])
            a = attention_stand_in(qkv, self.hidden)
            o = projs["o"](a, w["o"])
            h, residual = fused_add_rms_norm(o, residual, ln2, 1e-5)
            gu = projs["gate_up"](h, w["gate_up"])
            down = projs["down"](silu_and_mul(gu), w["down"])
        return residual + down


def run_chain(shapes, best, num_layers, device, dtype, dry, bw) -> None:
    layers = guarded("chain alloc", Layers, shapes, num_layers, device, dtype)
    if layers is None:
        return
    gem = {name: gemv_fn(best.get(name) or tuple(default_config(1, n, k, dtype))) for name, (k, n) in shapes.items()}
    cublas = {name: F.linear for name in shapes}
    variants = [("all cublas", cublas, None), ("all gemv, pdl", gem, True), ("all gemv, pdl off everywhere", gem, False),
                ("gemv qkv/o + cublas gate_up/down", {**cublas, "qkv": gem["qkv"], "o": gem["o"]}, True)]
    with pdl_mode(False):
        ref = layers.forward(cublas).float()
    for label, projs, pdl in variants:
        def one(label=label, projs=projs, pdl=pdl):
            with pdl_mode(pdl):
                err = rel_err(layers.forward(projs), ref)
                if not err < 5e-2:
                    raise AssertionError(f"chain output rel err {err:.2e} against the cuBLAS chain")
                t = time_graph(lambda i: layers.forward(projs), 1, dry, tries=7) / num_layers
            frac = layers.bytes / t / bw if t == t and bw == bw else float("nan")
            ROWS.append(f"chain    M=1   {label:34s} {t * 1e3:9.4f} ms/layer {frac * 100:6.1f}% of copy bw (err {err:.1e})")
            log(ROWS[-1])
        guarded(f"chain {label}", one)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    parser.add_argument("--skip-batch", action="store_true", help="skip M = 4 and 16")
    parser.add_argument("--num-layers", type=int, default=32)
    args = parser.parse_args()
    start = time.perf_counter()
    dry = args.dry
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    shapes, sweep = (DRY_SHAPES, DRY_SWEEP) if dry else (SHAPES, SWEEP)
    num_layers = 2 if dry else args.num_layers
    torch.manual_seed(0)
    if not dry:
        log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {__import__('triton').__version__}")
    bw = copy_bandwidth(dry)
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    best = sweep_shapes(shapes, sweep, device, dtype, dry, bw)
    if not args.skip_batch:
        batch_shapes(shapes, best, device, dtype, dry, bw)
    run_chain(shapes, best, num_layers, device, dtype, dry, bw)
    log("\n== summary (copy bandwidth %.3f TB/s, %.0f s)" % (bw / 1e12, time.perf_counter() - start))
    for row in ROWS:
        log(row)
    cfgs = {f"{name}_{shapes[name][1]}x{shapes[name][0]}": dict(zip(KEYS, cfg)) for name, cfg in best.items()}
    log("BEST_M1_PDL = " + repr(cfgs))


if __name__ == "__main__":
    main()
