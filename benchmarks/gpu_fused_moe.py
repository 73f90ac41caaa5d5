"""H200 microbenchmark of helios.kernels.fused_moe on a 35B-A3B layer shape (256 experts top-8, hidden 2048,
moe_intermediate 512, bf16; not `make test`): the fused routed experts (route, align, gate_up, down, combine) of a
SparseMoe at decode batches, against the bandwidth bound of the expert weights the step reads (b=1: the 8 active
experts; larger b: the experts its tokens touch), and each stage alone.
Timing: `reps` steps captured in a CUDA graph over `copies` layer-weight sets (working set far past the 50 MB L2),
replays timed with CUDA events, median of several tries. Random data.
Usage: python benchmarks/gpu_fused_moe.py [--batches 1 8 64 256] [--tiles BM,BN,BK,warps,stages ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helios.kernels import fused_moe  # noqa: E402

E, K, H, F = 256, 8, 2048, 512
EXPERT_BYTES = (2 * F * H + H * F) * 2  # gate_up + down, bf16


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read + written."""
    a = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * 2 / min(times) / 1e9


def timed(fn, reps: int, tries: int = 5) -> float:
    """Seconds per call: `reps` calls in one captured graph, replays timed, median of `tries`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(tries):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / 1e3 / reps)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 256])
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--tiles", nargs="*", default=[], help="BM,BN,BK,warps,stages configs to sweep")
    args = p.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = [torch.randn(E, 2 * F, H, generator=g, device="cuda").bfloat16() / H**0.5 for _ in range(args.copies)]
    w2 = [torch.randn(E, H, F, generator=g, device="cuda").bfloat16() / F**0.5 for _ in range(args.copies)]
    router = torch.randn(E, H, generator=g, device="cuda").bfloat16() / H**0.5
    configs = [None] + [dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
                                 map(int, t.split(",")))) for t in args.tiles]
    for b in args.batches:
        x = torch.randn(b, H, generator=g, device="cuda").bfloat16()
        logits = x @ router.T
        weights, ids = fused_moe.moe_route(logits, K, renorm=True, weights_dtype=logits.dtype)
        touched = int(ids.unique().numel())
        bound = touched * EXPERT_BYTES / (bw * 1e9)
        for cfg in configs:
            c = cfg or fused_moe.gemm_config(b * K)
            align = fused_moe.moe_align(ids, E, c["BLOCK_M"])

            def experts(i, c=c, align=align):
                h = fused_moe.expert_gemm(x, w1[i % args.copies], align, b * K, K, "silu", config=c)
                return fused_moe.expert_gemm(h, w2[i % args.copies], align, b * K, 1, config=c)

            def whole(i):
                wt, ix = fused_moe.moe_route(logits, K, renorm=True, weights_dtype=logits.dtype)
                y = fused_moe.expert_outputs(x, ix, w1[i % args.copies], w2[i % args.copies], "silu")
                return fused_moe.moe_combine(y, wt, ix)

            t_gemm = timed(experts, reps=64)
            line = f"b={b:4d} touched={touched:3d} bound={bound * 1e6:7.1f}us  gemms={t_gemm * 1e6:7.1f}us " \
                   f"({bound / t_gemm:5.1%})  cfg={c}"
            if cfg is None:
                t_all = timed(whole, reps=64)
                t_route = timed(lambda i: fused_moe.moe_route(logits, K, renorm=True), reps=64)
                t_align = timed(lambda i: fused_moe.moe_align(ids, E, c["BLOCK_M"]), reps=64)
                t_comb = timed(lambda i: fused_moe.moe_combine(torch.empty(b * K, H, device="cuda",
                                                                           dtype=torch.bfloat16), weights, ids),
                                                    reps=64)
                line += (f"\n        whole={t_all * 1e6:7.1f}us ({bound / t_all:5.1%})  route={t_route * 1e6:.1f}us "
                         f"align={t_align * 1e6:.1f}us combine={t_comb * 1e6:.1f}us")
            print(line, flush=True)


if __name__ == "__main__":
    main()
