"""GDN decode on the GPU: helios.kernels.gated_delta's decode step against the recurrent-state bytes it must move
(read once, written once, float32), beside fla's fused_recurrent_gated_delta_rule (fla-core 0.6.0) on gathered
states, and the device's measured copy bandwidth. Never part of `make test`.

Shape: Qwen3.5-27B's GDN layers, 16 key heads, 48 value heads, dk = dv = 128, conv kernel 4. transformers'
Qwen3_5TextConfig defaults (16 key / 32 value heads, hidden 4096, 32 layers) are not the 27B's: its config.json is
not readable here, so 48 value heads (hidden 5120) is assumed. State per request per layer: 48 x 128 x 128 x 4 B
= 3 MiB. Each variant is timed as one CUDA graph over a stack of layers (distinct state tensors, together well
past the 50 MiB L2), replayed: per-layer time includes the graph's launch gaps, as the engine's decode replays.

Variants: fused = gated_delta_decode (conv + silu + gate + l2norm + rule + output, one launch), per split count;
step = gated_delta_rule's one-token path (q/k/v/g/beta given: the same work as fla's kernel); fla = fla's kernel
on states already gathered per request (its input and output state tensors: same bytes); fla+gather = index_select
the slots, fla, index_copy back (what using fla for decode costs in a slot-indexed cache).
Usage: python benchmarks/gpu_gated_delta.py [--batches 1,8,64,256] [--iters 20] [--value-heads 48]
On the lent H200 (fla-core and einops wheels in .whl/, carried), after the GPU tests:
  PARTS=tests TEST_PATHS=tests/gpu/test_gated_delta_cuda.py bash benchmarks/h200_run.sh
  PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_gated_delta.py
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helios.kernels import gated_delta as gd  # noqa: E402

HK, HV, DK, DV, WIDTH = 16, 48, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV
STACK_BYTES = 256 << 20  # state bytes per graph at least (layers stacked up to 48)


def copy_bandwidth(num_bytes: int = 2 << 30, iters: int = 10) -> float:
    """GB/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * num_bytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def graph_time(fn, iters: int) -> float:
    """Seconds per call of fn, replayed as one CUDA graph (after eager warm-up: compiles, counters)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def make_layers(batch: int, num_layers: int, dtype=torch.bfloat16):
    slots = torch.randperm(batch + 1, device="cuda")[:batch].to(torch.int32)  # slot `batch` may be the scratch one
    layers = []
    for _ in range(num_layers):
        layers.append(dict(
            conv_weight=torch.randn(CHANNELS, WIDTH, device="cuda", dtype=dtype) * 0.5,
            conv_state=torch.randn(batch + 1, WIDTH - 1, CHANNELS, device="cuda", dtype=dtype),
            A_log=torch.rand(HV, device="cuda"),
            dt_bias=torch.randn(HV, device="cuda"),
            state=torch.randn(batch + 1, HV, DK, DV, device="cuda") * 0.05,
        ))
    return slots, layers


def run(batch: int, iters: int, copy_gbs: float, dtype=torch.bfloat16) -> list[tuple[str, float, float]]:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    state_bytes = 2 * batch * HV * DK * DV * 4
    num_layers = max(2, min(48, math.ceil(STACK_BYTES / (state_bytes / 2))))
    slots, layers = make_layers(batch, num_layers, dtype)
    starts = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    x = torch.randn(batch, CHANNELS, device="cuda", dtype=dtype)
    a = torch.randn(batch, HV, device="cuda", dtype=dtype)
    b = torch.randn(batch, HV, device="cuda", dtype=dtype)
    q = torch.nn.functional.silu(torch.randn(batch, HK, DK, device="cuda", dtype=dtype))
    k = torch.nn.functional.silu(torch.randn(batch, HK, DK, device="cuda", dtype=dtype))
    v = torch.randn(batch, HV, DV, device="cuda", dtype=dtype)
    g = -torch.rand(batch, HV, device="cuda")
    beta = torch.rand(batch, HV, device="cuda", dtype=dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    index = slots.long()
    gathered = [layer["state"].index_select(0, index) for layer in layers]  # fla's per-request input states
    results = []

    def record(name, seconds):
        gbs = state_bytes / seconds / 1e9
        results.append((name, seconds, gbs))
        print(f"b={batch:<4d} {name:<22s} {seconds * 1e6:9.2f} us/layer {gbs:8.0f} GB/s "
              f"{100 * gbs / copy_gbs:5.1f}% of copy   ({num_layers} layers)", flush=True)

    def fused_variant(block_v, state_first, splits):
        gd.BLOCK_V, gd.STATE_FIRST = block_v, state_first

        def fused():
            for layer in layers:
                gd.gated_delta_decode(x, layer["conv_weight"], layer["conv_state"], a, b, layer["A_log"],
                                      layer["dt_bias"], layer["state"], slots, starts, HK, num_splits=splits)

        try:
            seconds = graph_time(fused, iters) / num_layers
        finally:
            gd.BLOCK_V, gd.STATE_FIRST = saved
        mark = "*" if (block_v, state_first, splits) == (saved[0], False, default) else ""
        record(f"fused bv{block_v}{' sf' if state_first else ''} s{splits}{mark}", seconds)
        return seconds

    saved = gd.BLOCK_V, gd.STATE_FIRST  # the default tile width (gated_delta.block_v) and order
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = gd.decode_splits(batch, HK, HV // HK * -(-DV // saved[0]), num_sms)
    split_times = {}
    for width in (32, 64):
        tiles = HV // HK * -(-DV // width)
        for splits in [s for s in range(1, tiles + 1) if tiles % s == 0]:
            if batch * HK * splits <= 64 * 132 or (width, splits) == (saved[0], default):  # not far past the chip
                split_times[width, splits] = fused_variant(width, False, splits)
    best32 = min((s for w, s in split_times if w == 32), key=lambda s: split_times[32, s])
    for splits in sorted({best32, default if saved[0] == 32 else best32}):
        fused_variant(32, True, splits)  # state first: tried at 32 columns only (at 64 it spills)

    def step():
        for layer in layers:
            gd.gated_delta_rule(q, k, v, g, beta, layer["state"], slots, qsl, starts)

    record("step (no conv)", graph_time(step, iters) / num_layers)

    def fla_call(h0):
        return fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                                                scale=DK**-0.5, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)

    def fla_kernel():
        for h0 in gathered:
            fla_call(h0)

    def fla_gather():
        for layer in layers:
            _, final = fla_call(layer["state"].index_select(0, index))
            layer["state"].index_copy_(0, index, final)

    record("fla kernel", graph_time(fla_kernel, iters) / num_layers)
    record("fla + gather/scatter", graph_time(fla_gather, iters) / num_layers)

    # sanity: our one-token step and fla from the same states agree
    state = layers[0]["state"]
    h0 = state.index_select(0, index)
    o_fla, s_fla = fla_call(h0)
    o_ours = gd.gated_delta_rule(q, k, v, g, beta, state, slots, qsl, starts)
    print(f"b={batch:<4d} step vs fla: output max |diff| {(o_ours.float() - o_fla[:, 0].float()).abs().max():.2e}, "
          f"state {(state[index] - s_fla).abs().max():.2e}", flush=True)
    return results


def main() -> None:
    global HV, CHANNELS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--value-heads", type=int, default=HV,
                        help="value heads (48: the 27B, assumed; 32: transformers' Qwen3_5TextConfig, gpu_hybrid's qwen3_5)")
    args = parser.parse_args()
    HV, CHANNELS = args.value_heads, 2 * HK * DK + args.value_heads * DV
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; shape Hk={HK} Hv={HV} dk={DK} dv={DV} "
          f"K={WIDTH}, bf16 activations, float32 state ({HV * DK * DV * 4 >> 20} MiB per request per layer); "
          f"GB/s = state bytes read + written / time; * = the default split", flush=True)
    best = {}
    with torch.inference_mode():
        for batch in (int(s) for s in args.batches.split(",")):
            results = run(batch, args.iters, copy_gbs)
            fused = [r for r in results if r[0].startswith("fused")]
            default = [r for r in fused if r[0].endswith("*")]
            best[batch] = (max(fused, key=lambda r: r[2]), default[0] if default else None,
                           {r[0]: r for r in results if not r[0].startswith("fused")})
    print("\nsummary (GB/s, % of copy):")
    for batch, (top, default, others) in best.items():
        line = f"b={batch:<4d} fused best {top[0]} {top[2]:.0f} ({100 * top[2] / copy_gbs:.1f}%)"
        if default:
            line += f", default {default[0]} {default[2]:.0f} ({100 * default[2] / copy_gbs:.1f}%)"
        for name in ("step (no conv)", "fla kernel", "fla + gather/scatter"):
            line += f"; {name} {others[name][2]:.0f} ({100 * others[name][2] / copy_gbs:.1f}%)"
        print(line)


if __name__ == "__main__":
    main()
