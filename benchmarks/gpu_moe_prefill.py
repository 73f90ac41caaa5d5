"""H200 sweep of helios.kernels.fused_moe's grouped GEMM tiles for prefill-sized batches (not `make test`): the routed
experts' two GEMMs (align, gate_up with the activation, down) of a 4096-token prompt at three published MoE shapes,
each tile config and program order (GROUP_M) timed (CUDA events, best of several tries after a warm-up) and checked
against the default config's output (then each GEMM alone under that tile: the two may want different ones), printed
as TFLOP/s of the two GEMMs (2 x entries x (gate_up + down) weights per entry) against the measured bf16 matmul rate.
BLOCK_K stays 128 in every candidate: an entry's products then sum their K chunks in one order at every batch size
(fused_moe.gemm_config's note). Last, the same GEMMs through torch's grouped GEMM (helios.kernels.moe_grouped, the
moe_prefill switch's "grouped"): its time and whether its bits are the Triton default's; before it, the engine's own
fused_moe.expert_outputs (gate_up at gemm_config's tile, down at down_config's).
Usage: python benchmarks/gpu_moe_prefill.py [--tokens 4096] [--out PATH] [--default-only]
(writes each line to PATH as it goes)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_decode import matmul_rate  # noqa: E402
from helios.kernels import fused_moe, moe_grouped  # noqa: E402

# (name, experts, top-k, hidden, moe_intermediate)
SHAPES = [("qwen3_5_moe", 256, 8, 2048, 512), ("kimi_linear", 256, 8, 2304, 1024),
          ("mimo_v2_flash", 256, 8, 4096, 2048)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M): GROUP_M 0 = blocks fastest (the order before session 18)
CANDIDATES = [(128, 64, 128, 8, 3, 0), (128, 64, 128, 8, 3, 4), (128, 64, 128, 8, 3, 8), (128, 64, 128, 8, 3, 16),
              (64, 64, 128, 4, 3, 8), (64, 128, 128, 8, 3, 8), (128, 128, 128, 8, 2, 8), (64, 64, 128, 4, 4, 16),
              (128, 64, 128, 4, 3, 8), (128, 128, 128, 8, 3, 8)]  # the last: the down GEMM only (one weight tile)


def timed(fn, tries: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(tries):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    return best


def run(config, x, topk_ids, w_in, w_down):
    align = fused_moe.moe_align(topk_ids, w_in.shape[0], config["BLOCK_M"])
    n = topk_ids.numel()
    h = fused_moe.expert_gemm(x, w_in, align, n, topk_ids.shape[1], "silu", config=config)
    return fused_moe.expert_gemm(h, w_down, align, n, 1, config=config)


def each_gemm(config, x, topk_ids, w_in, w_down, ref_h, reference) -> str:
    """The gated GEMM and the down GEMM timed apart under one config (fused_moe.gemm_config gives both the same tile;
    the down GEMM's K is the intermediate size, a few BLOCK_K steps, and it loads one weight tile where the gated one
    loads two): ms and TFLOP/s each, or why one failed; each output checked against the default tile's."""
    n, k = topk_ids.numel(), topk_ids.shape[1]
    align = fused_moe.moe_align(topk_ids, w_in.shape[0], config["BLOCK_M"])
    parts = []
    for name, fn, want, flops in (
        ("gate_up", lambda: fused_moe.expert_gemm(x, w_in, align, n, k, "silu", config=config), ref_h,
         2.0 * n * w_in.shape[1] * w_in.shape[2]),
        ("down", lambda: fused_moe.expert_gemm(ref_h, w_down, align, n, 1, config=config), reference,
         2.0 * n * w_down.shape[1] * w_down.shape[2]),
    ):
        try:
            same = torch.equal(fn(), want)
            seconds = timed(fn)
        except Exception as exc:  # shared memory: the gated GEMM holds two weight tiles a stage
            parts.append(f"{name} failed {type(exc).__name__}")
            continue
        verdict = "" if same else " (differs)"
        parts.append(f"{name} {seconds * 1e3:.3f} ms {flops / seconds / 1e12:.0f} TFLOP/s{verdict}")
    return ", ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", type=Path)
    p.add_argument("--default-only", action="store_true", help="time the default tile and the grouped GEMM only")
    args = p.parse_args()
    out = args.out.open("w") if args.out else None

    def say(line: str) -> None:
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
    rate = matmul_rate()
    say(f"{torch.cuda.get_device_name()}: bf16 matmul {rate / 1e12:.0f} TFLOP/s; default prefill config "
        f"{fused_moe.gemm_config(args.tokens * 8)}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, experts, k, hidden, inter in SHAPES:
        x = torch.randn(args.tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
        w_in = torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
        w_down = torch.randn(experts, hidden, inter, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
        logits = torch.randn(args.tokens, experts, generator=g, device="cuda")
        topk_ids = logits.topk(k, dim=-1).indices.to(torch.int32)
        flops = 2.0 * topk_ids.numel() * (2 * inter * hidden + hidden * inter)
        reference = run(fused_moe.gemm_config(topk_ids.numel()), x, topk_ids, w_in, w_down)  # the default tile
        default = fused_moe.gemm_config(topk_ids.numel())
        keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M")
        only = [tuple(default[key] for key in keys)]
        ref_h = fused_moe.expert_gemm(x, w_in, fused_moe.moe_align(topk_ids, experts, default["BLOCK_M"]),
                                      topk_ids.numel(), k, "silu", config=default)
        for candidate in only if args.default_only else CANDIDATES:
            config = dict(zip(keys, candidate))
            bm, bn, bk, warps, stages, group = candidate
            label = f"{name:14} {bm:3}x{bn:3}x{bk:3} w{warps} s{stages} g{group:<2}"
            try:
                y = run(config, x, topk_ids, w_in, w_down)
                seconds = timed(lambda: run(config, x, topk_ids, w_in, w_down))
            except Exception as exc:  # a config the device cannot hold (shared memory): say so, go on
                say(f"{label}: failed {type(exc).__name__}: {str(exc)[:120]}")
            else:
                same = torch.equal(y, reference)
                say(f"{label}: {seconds * 1e3:7.3f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s "
                    f"({flops / seconds / rate:.1%})  output {'= default' if same else 'differs from default'}")
            say(f"{'':14} {'':28}  each GEMM alone: {each_gemm(config, x, topk_ids, w_in, w_down, ref_h, reference)}")

        def engine_path():  # gemm_config's tile for gate_up, down_config's for down
            return fused_moe.expert_outputs(x, topk_ids, w_in, w_down, "silu")
        seconds = timed(engine_path)
        verdict = "= default" if torch.equal(engine_path(), reference) else "differs from default"
        columns = fused_moe.down_config(default, 2, fused_moe.shared_bytes_of("cuda"))["BLOCK_N"]
        say(f"{name:14} expert_outputs (down {columns} columns): {seconds * 1e3:7.3f} ms  "
            f"{flops / seconds / 1e12:6.1f} TFLOP/s "
            f"({flops / seconds / rate:.1%})  output {verdict}")
        label = f"{name:14} torch grouped GEMM"
        if moe_grouped.grouped_serves(x, w_in, w_down, topk_ids.numel()):
            def grouped():
                return moe_grouped.expert_outputs_grouped(x, topk_ids, w_in, w_down, "silu")
            y = grouped()
            seconds = timed(grouped)
            diff = (y.float() - reference.float()).abs().max().item()
            verdict = "= default" if torch.equal(y, reference) else f"differs from default (max {diff:.3g})"
            say(f"{label}: {seconds * 1e3:7.3f} ms  {flops / seconds / 1e12:6.1f} TFLOP/s "
                f"({flops / seconds / rate:.1%})  output {verdict}")
        else:
            say(f"{label}: not served on this device")
        del x, w_in, w_down
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
