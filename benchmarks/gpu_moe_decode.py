"""H200 benchmark of the routed experts at one token (batch-1 decode; not `make test`): helios.kernels.fused_moe's
grouped-GEMM path (today's tiles, and BLOCK_N 16) against the one-token GEMV path (expert_outputs_one_token) over a
sweep of tiles, at three published MoE shapes (256 experts, top-8).

1. Copy bandwidth of this run (benchmarks/gpu_decode.copy_bandwidth): the ceiling.
2. Per shape: the dot path's two GEMMs as expert_outputs runs them, then at BLOCK_N 16; each GEMV tile of the sweep
   on gate_up alone, on down alone, and on both; the best gate_up tile with the best down tile (and
   one_token_config's pair) again with PDL forced off and on (on: the down launch's first weight chunk before its
   wait, then after). Each line: us per call, GB/s of the expert bytes read (k x (gate_up + down rows) x W x 2 B),
   % of the copy bandwidth, and whether the output has the dot path's bits (else the max abs difference).
Timing: `reps` calls captured in one CUDA graph, each with its own top-8 (consecutive calls take disjoint experts
of a permutation), every expert at full size: the working set (1.6 to 12.9 GB) is far past the 50 MB L2; median
of several replays (benchmarks/gpu_gemv.time_graph). Random data.
Usage: python3 benchmarks/gpu_moe_decode.py [--out PATH] [--budget SECONDS] [--shapes NAME ...] [--dry]
       (--dry: CPU, Triton interpreter, a tiny shape, no timing: proves the script runs)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_gemv import guarded, time_graph  # noqa: E402
from helios.kernels import fused_moe  # noqa: E402
from helios.kernels._triton import forced_pdl, next_power_of_2, use_pdl  # noqa: E402
from helios.kernels.fused_moe import ExpertGemvConfig  # noqa: E402

# (name, experts, top-k, hidden W, moe_intermediate F)
SHAPES = [("qwen3_5_moe", 256, 8, 2048, 512), ("kimi_linear", 256, 8, 2304, 1024),
          ("mimo_v2_flash", 256, 8, 4096, 2048)]
DRY_SHAPES = [("tiny", 16, 4, 64, 32)]
# GEMV tiles (block_n, block_k, num_warps, split_k, row_acc), block_k capped at K's power of two; each product's
# launch has k x n_out / block_n x split_k programs (qwen3_5_moe's gate_up at 8 rows: 512, down: 2048).
# Registers a thread on sm90 (ptxas, Triton 3.9; gate_up / down): 8x512 w4 167 / 95, with row_acc 128 / 72;
# 16x512 w4 row_acc 250 / 128; 8x1024 w4 row_acc 158 / 72; 16x512 w8 row_acc 128 / 80; 16x1024 w8 row_acc 252 / 80.
# Without row_acc, gated tiles of 16 x 512 on 4 warps (and 32 x 256, 16 x 1024 on 8) spill: left out
SWEEP = [(8, 512, 4, 1, False), (8, 512, 4, 1, True), (4, 512, 4, 1, True), (16, 512, 4, 1, True),
         (8, 1024, 4, 1, True), (8, 256, 4, 1, True), (8, 512, 8, 1, True), (16, 512, 8, 1, True),
         (32, 256, 8, 1, True), (16, 1024, 8, 1, True), (4, 1024, 4, 1, True), (8, 512, 4, 2, True),
         (16, 512, 8, 2, True), (8, 256, 4, 2, True)]
DRY_SWEEP = [(8, 512, 4, 1, False), (4, 16, 4, 1, True), (16, 32, 8, 1, True), (8, 16, 4, 2, True)]
NUM_CALLS = 64  # distinct top-8s captured in one graph


class Shape:
    """One MoE layer's experts at full size, NUM_CALLS top-8 choices and the inputs of both products."""

    def __init__(self, name, num_experts, top_k, hidden, inter, device, dry):
        self.name, self.top_k, self.hidden, self.inter = name, top_k, hidden, inter
        g = torch.Generator(device=device).manual_seed(0)
        dtype = torch.bfloat16
        self.w_in = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device, dtype=dtype)
        self.w_in.mul_(hidden**-0.5)
        self.w_down = torch.randn(num_experts, hidden, inter, generator=g, device=device, dtype=dtype)
        self.w_down.mul_(inter**-0.5)
        self.x = torch.randn(1, hidden, generator=g, device=device, dtype=dtype)
        self.h = torch.randn(top_k, inter, generator=g, device=device, dtype=dtype)  # down's input when alone
        perms = [torch.randperm(num_experts, generator=g, device=device)[: num_experts // top_k * top_k]
                 for _ in range(-(-NUM_CALLS * top_k // num_experts))]
        ids = torch.cat(perms).view(-1, top_k)[:NUM_CALLS].to(torch.int32)
        self.ids = [ids[i: i + 1] for i in range(NUM_CALLS)]  # [1, k] views of one captured buffer
        self.bytes = {"both": top_k * 3 * inter * hidden * 2, "gate_up": top_k * 2 * inter * hidden * 2,
                      "down": top_k * hidden * inter * 2}

    def calls(self, fn):
        """step(i) for time_graph: fn on call i's experts."""
        return lambda i: fn(self.ids[i % NUM_CALLS])


# --- the products ------------------------------------------------------------------------------------------


def dot_product(s: Shape, part: str, config: dict | None):
    """The grouped-GEMM path on one part (gate_up, down, both); config None: expert_outputs as it runs today."""
    cfg = config or fused_moe.gemm_config(s.top_k)

    def fn(ids):
        if part == "both" and config is None:
            return fused_moe.expert_outputs(s.x, ids, s.w_in, s.w_down, "silu")
        align = fused_moe.one_token_align(ids, cfg["BLOCK_M"])
        pdl = use_pdl(s.x, 1)
        k = s.top_k
        if part == "down":
            return fused_moe.expert_gemm(s.h, s.w_down, align, k, 1, config=cfg, pdl=pdl)
        h = fused_moe.expert_gemm(s.x, s.w_in, align, k, k, "silu", config=cfg, pdl=pdl)
        return h if part == "gate_up" else fused_moe.expert_gemm(h, s.w_down, align, k, 1, config=cfg, pdl=pdl)
    return fn


def dot_bn16(s: Shape) -> dict:
    """Today's one-token tile at 16 columns: twice the programs, each streaming half the rows."""
    return {**fused_moe.gemm_config(s.top_k), "BLOCK_N": 16}


def gemv_product(s: Shape, part: str, cfg_in: ExpertGemvConfig | None, cfg_down: ExpertGemvConfig | None,
                 early_down: bool = True):
    def fn(ids):
        flat = ids.reshape(-1)
        pdl = use_pdl(s.x, 1)
        if part == "gate_up":
            return fused_moe.expert_gemv(s.x, s.w_in, flat, s.top_k, "silu", config=cfg_in, pdl=pdl)
        if part == "down":
            return fused_moe.expert_gemv(s.h, s.w_down, flat, 1, config=cfg_down, pdl=pdl, early_weights=early_down)
        return fused_moe.expert_outputs_one_token(s.x, ids, s.w_in, s.w_down, "silu", config=(cfg_in, cfg_down),
                                                  early_down=early_down)
    return fn


def fitted(tile: tuple, k_dim: int) -> ExpertGemvConfig:
    """A sweep tile for a product over k_dim: block_k capped at k_dim's power of two, split_k at what is left."""
    block_n, block_k, warps, split_k, row_acc = tile
    block_k = min(block_k, next_power_of_2(k_dim))
    return ExpertGemvConfig(block_n, block_k, warps, max(1, min(split_k, k_dim // block_k)), row_acc)


def tile_label(tile) -> str:
    """8x512 w4 s1 r: rows x chunk, warps, K ranges, r for row_acc."""
    block_n, block_k, warps, split_k, row_acc = tile
    return f"{block_n}x{block_k} w{warps} s{split_k}{' r' if row_acc else ''}"


# --- one shape ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, bandwidth: float, dry: bool, budget_s: float, out):
        self.bandwidth, self.dry, self.budget_s, self.out = bandwidth, dry, budget_s, out
        self.start = time.perf_counter()

    def say(self, line: str) -> None:
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.budget_s

    def measure(self, s: Shape, part: str, label: str, fn, reference: torch.Tensor | None, pdl: bool | None):
        """Time fn over the calls (PDL forced to `pdl`; the interpreter has none) and print one line; returns
        (seconds, the output of call 0)."""
        with forced_pdl(None if self.dry else pdl):
            y = fn(s.ids[0])
            seconds = time_graph(s.calls(fn), NUM_CALLS, self.dry)
        if reference is None:
            same = "(the reference)"
        elif torch.equal(y, reference):
            same = "= dot bits"
        else:
            same = f"max|d| {(y.float() - reference.float()).abs().max().item():.2e}"
        rate = s.bytes[part] / seconds
        self.say(f"{s.name:13} {part:7} {label:52} {seconds * 1e6:8.2f} us {rate / 1e9:7.0f} GB/s "
                 f"{rate / self.bandwidth:6.1%} of copy  {same}")
        return seconds, y

    def shape(self, s: Shape, sweep: list[tuple]) -> None:
        bound = s.bytes["both"] / self.bandwidth
        self.say(f"--- {s.name}: k={s.top_k} W={s.hidden} F={s.inter}, {s.bytes['both'] / 1e6:.1f} MB of experts "
                 f"a call, copy-bandwidth bound {bound * 1e6:.2f} us")
        refs, best = {}, {}
        cfg = fused_moe.gemm_config(s.top_k)
        label = f"dot today {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}"
        for part in ("both", "gate_up", "down"):
            got = guarded(f"{s.name} {part} dot", self.measure, s, part, label, dot_product(s, part, None), None,
                          False)
            refs[part] = got[1] if got else None
            guarded(f"{s.name} {part} dot bn16", self.measure, s, part, "dot BLOCK_N 16",
                    dot_product(s, part, dot_bn16(s)), refs[part], False)
        for tile in sweep:
            if self.over_budget():
                self.say(f"budget of {self.budget_s:.0f} s spent: the rest of {s.name}'s sweep skipped")
                break
            cfg_in, cfg_down = fitted(tile, s.hidden), fitted(tile, s.inter)
            for part, cfgs in (("gate_up", (cfg_in, None)), ("down", (None, cfg_down)), ("both", (cfg_in, cfg_down))):
                label = f"gemv {tile_label(cfgs[0] or cfgs[1]) if part != 'both' else tile_label(tile)}"
                got = guarded(f"{s.name} {part} {label}", self.measure, s, part, label, gemv_product(s, part, *cfgs),
                              refs[part], False)
                if got and part != "both" and (part not in best or got[0] < best[part][0]):  # dry: the first
                    best[part] = (got[0], cfgs[0] or cfgs[1])
        pairs = {"default": (fused_moe.one_token_config(s.inter, s.hidden, s.top_k),
                             fused_moe.one_token_config(s.hidden, s.inter, s.top_k))}
        if "gate_up" in best and "down" in best:
            pairs["best"] = (best["gate_up"][1], best["down"][1])
        for name, (cfg_in, cfg_down) in pairs.items():
            label = f"gemv {name} {tile_label(cfg_in)} + {tile_label(cfg_down)}"
            for pdl, early in ((False, True), (True, True), (True, False)):
                mode = "pdl" + (" early down" if early else " down waits") if pdl else "no pdl"
                guarded(f"{s.name} {label} {mode}", self.measure, s, "both", f"{label} {mode}",
                        gemv_product(s, "both", cfg_in, cfg_down, early), refs["both"], pdl)
        for config, label in ((None, "dot today pdl"), (dot_bn16(s), "dot BLOCK_N 16 pdl")):
            guarded(f"{s.name} {label}", self.measure, s, "both", label, dot_product(s, "both", config),
                    refs["both"], True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, help="also write each line here as it is printed")
    p.add_argument("--budget", type=float, default=110.0, help="seconds after which the remaining sweeps are cut")
    p.add_argument("--shapes", nargs="*", help="only these shapes (qwen3_5_moe, kimi_linear, mimo_v2_flash)")
    p.add_argument("--dry", action="store_true")
    args = p.parse_args()
    out = args.out.open("w") if args.out else None
    if args.dry:
        device, bandwidth, shapes, sweep = "cpu", float("nan"), DRY_SHAPES, DRY_SWEEP
    else:
        from benchmarks.gpu_decode import copy_bandwidth

        device, bandwidth, shapes, sweep = "cuda", copy_bandwidth(), SHAPES, SWEEP
    bench = Bench(bandwidth, args.dry, args.budget, out)
    name = "dry run (interpreter)" if args.dry else torch.cuda.get_device_name()
    bench.say(f"{name}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write); {NUM_CALLS} calls a graph")
    for spec in [spec for spec in shapes if not args.shapes or spec[0] in args.shapes]:
        s = guarded(f"{spec[0]} alloc", Shape, *spec, device, args.dry)
        if s is None:
            continue
        bench.shape(s, sweep)
        del s
        if not args.dry:
            torch.cuda.empty_cache()
    bench.say(f"total {time.perf_counter() - bench.start:.1f} s")


if __name__ == "__main__":
    main()
