"""KDA and Mamba-2 on the GPU: helios.kernels.kda's decode step and helios.kernels.mamba's scans against the
recurrent-state bytes a decode step must move (read once, written once, float32) and the device's copy bandwidth;
prefill time of one long prompt per layer (Mamba-2: the sequential and the chunked kernel; KDA: fla's chunk_kda
on the slot-gathered state). Never part of `make test`.

Shapes: Kimi-Linear-48B-A3B's KDA layers (32 heads, dk = dv = 128: 2 MiB of state per request per layer) and
Nemotron-H-8B's Mamba-2 layers (128 heads of 64, state 128, 8 groups: 4 MiB). Decode variants are timed as one
CUDA graph over a stack of layers (together past the 50 MiB L2), replayed (benchmarks/gpu_gated_delta.py's timer).
Usage: python benchmarks/gpu_recurrent.py [--batches 1,8,64,256] [--prefill 4096] [--iters 20]
On the lent H200 (fla-core and einops wheels in .whl/, carried):
  PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_recurrent.py
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_gated_delta import copy_bandwidth, graph_time  # noqa: E402
from helios.kernels import gated_delta, kda, mamba  # noqa: E402

KIMI = dict(H=32, D=128, WIDTH=4)
NEMOTRON = dict(H=128, P=64, N=128, G=8, WIDTH=4, CHUNK=128)
STACK_BYTES = 256 << 20  # state bytes per graph at least
BF16 = dict(device="cuda", dtype=torch.bfloat16)


def _layers(batch: int, state_bytes: int) -> int:
    return max(2, min(48, math.ceil(STACK_BYTES / state_bytes)))


def kda_decode(batch: int, iters: int) -> tuple[float, int]:
    """(seconds per layer, state bytes moved per layer) of kda_decode with the safe gate."""
    h, d, width = KIMI["H"], KIMI["D"], KIMI["WIDTH"]
    channels, state_bytes = 3 * h * d, batch * h * d * d * 4
    layers = [dict(conv_weight=torch.randn(channels, width, **BF16) * 0.5,
                   conv_state=torch.randn(batch + 1, width - 1, channels, **BF16),
                   A_log=torch.rand(h, device="cuda"), dt_bias=torch.randn(h * d, device="cuda"),
                   state=torch.randn(batch + 1, h, d, d, device="cuda") * 0.05)
              for _ in range(_layers(batch, state_bytes))]
    slots = torch.randperm(batch + 1, device="cuda")[:batch].to(torch.int32)
    starts = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    x, f, b = torch.randn(batch, channels, **BF16), torch.randn(batch, h * d, **BF16), torch.randn(batch, h, **BF16)

    def step():
        for layer in layers:
            kda.kda_decode(x, f=f, b=b, slots=slots, starts=starts, lower_bound=-5.0, **layer)

    return graph_time(step, iters) / len(layers), 2 * state_bytes


def _mamba_layer(batch: int, num_slots: int) -> dict:
    h, p, n, g, width = (NEMOTRON[k] for k in ("H", "P", "N", "G", "WIDTH"))
    channels = h * p + 2 * g * n
    return dict(weight=torch.randn(channels, width, **BF16) * 0.5, bias=torch.randn(channels, **BF16) * 0.1,
                conv_state=torch.randn(num_slots, width - 1, channels, **BF16),
                A_log=torch.rand(h, **BF16), D=torch.randn(h, **BF16), dt_bias=torch.randn(h, **BF16),
                state=torch.randn(num_slots, h, p, n, device="cuda") * 0.05)


def mamba_step(xbc, dt, layer, slots, qsl, starts, chunk_size):
    """The fused layer's mixer: the conv kernel, then the scan (as helios.layers.mamba._mix_fused)."""
    h, p, n, g = (NEMOTRON[k] for k in ("H", "P", "N", "G"))
    y = gated_delta.causal_conv(xbc, layer["weight"], layer["conv_state"], slots, qsl, starts, bias=layer["bias"])
    x, b, c = y.split([h * p, g * n, g * n], dim=-1)
    rows = xbc.shape[0]
    return mamba.mamba2_scan(x.view(rows, h, p), dt, layer["A_log"], b.view(rows, g, n), c.view(rows, g, n),
                             layer["D"], layer["dt_bias"], layer["state"], slots, qsl, starts, chunk_size=chunk_size)


def mamba_decode(batch: int, iters: int) -> tuple[float, int]:
    h, p, n, g = (NEMOTRON[k] for k in ("H", "P", "N", "G"))
    state_bytes = batch * h * p * n * 4
    layers = [_mamba_layer(batch, batch + 1) for _ in range(_layers(batch, state_bytes))]
    slots = torch.randperm(batch + 1, device="cuda")[:batch].to(torch.int32)
    starts = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    xbc, dt = torch.randn(batch, h * p + 2 * g * n, **BF16), torch.randn(batch, h, **BF16)

    def step():
        for layer in layers:
            mamba_step(xbc, dt, layer, slots, qsl, starts, NEMOTRON["CHUNK"])

    return graph_time(step, iters) / len(layers), 2 * state_bytes


def eager_time(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def prefill(tokens: int) -> None:
    """One fresh prompt of `tokens` through one layer: seconds and tokens/s per layer."""
    h, p, n, g = (NEMOTRON[k] for k in ("H", "P", "N", "G"))
    layer = _mamba_layer(1, 2)
    slots, starts = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    xbc, dt = torch.randn(tokens, h * p + 2 * g * n, **BF16), torch.randn(tokens, h, **BF16)
    for name, chunk in (("sequential", None), ("chunked", NEMOTRON["CHUNK"])):
        seconds = eager_time(lambda: mamba_step(xbc, dt, layer, slots, qsl, starts, chunk))
        print(f"mamba2 prefill {tokens} tokens, {name:<10s} {seconds * 1e3:8.2f} ms/layer "
              f"{tokens / seconds / 1e3:8.0f} k tok/s", flush=True)
    hk, d = KIMI["H"], KIMI["D"]
    q, k, v = (torch.randn(tokens, hk, d, **BF16) for _ in range(3))
    g_kda = -torch.rand(tokens, hk, d, device="cuda")
    beta = torch.rand(tokens, hk, **BF16)
    state = torch.zeros(2, hk, d, d, device="cuda")
    seconds = eager_time(lambda: kda.kda_rule(q, k, v, g_kda, beta, state, slots, qsl, starts))
    print(f"kda prefill {tokens} tokens (fla chunk_kda) {seconds * 1e3:8.2f} ms/layer "
          f"{tokens / seconds / 1e3:8.0f} k tok/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s; GB/s = state bytes read + written "
          f"/ time", flush=True)
    with torch.inference_mode():
        for batch in (int(s) for s in args.batches.split(",")):
            for name, bench in (("kda decode", kda_decode), ("mamba2 decode", mamba_decode)):
                seconds, moved = bench(batch, args.iters)
                gbs = moved / seconds / 1e9
                print(f"b={batch:<4d} {name:<14s} {seconds * 1e6:9.2f} us/layer {gbs:8.0f} GB/s "
                      f"{100 * gbs / copy_gbs:5.1f}% of copy", flush=True)
        prefill(args.prefill)


if __name__ == "__main__":
    main()
