"""The paged decode attention of the 8B shape alone (helios.kernels.decode_qkv), timed over its tile choices.

At b=256 the H200's profile (benchmarks/RESULTS.md, session 24) spends 2.32 ms of an 8.87 ms step in
`_decode_qkv_kernel`: ~200 MB of KV a layer at ~192-token contexts in 72.6 us, 65% of the copy bandwidth. This
times one layer's launch at the engine's shapes (32 q / 8 kv heads of 128, 16-token pages, every sequence's pages
scattered over the pool as a busy server's are) for each (BLOCK_N, num_warps, splits) and prints the achieved
bandwidth against a device-to-device copy's, and the largest difference from the default tile's output.

  python benchmarks/gpu_decode_attention.py [--batches 64,256] [--contexts 192,1024] [--iters 20]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import copy_bandwidth  # noqa: E402 (read + write bytes a second of a device copy)
from helios.kernels import decode_qkv  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def inputs(batch: int, context: int, device: torch.device, gen: torch.Generator):
    lens = torch.randint(context * 2 // 3, context * 4 // 3 + 1, (batch,), generator=gen)
    blocks = (lens + PAGE - 1) // PAGE
    max_blocks = int(blocks.max())
    num_pages = int(blocks.sum()) + 64
    order = torch.randperm(num_pages, generator=gen)  # scattered pages, as a long-running pool hands them out
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks.tolist()):
        tables[i, :n] = order[cursor:cursor + n]
        cursor += n
    slots = torch.tensor([int(tables[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for i, n in enumerate(lens.tolist())])
    kv = torch.randn(2, num_pages, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(torch.bfloat16)
    angle = torch.rand(batch, HEAD_DIM // 2, generator=gen) * 6.28
    cos = torch.cat([angle.cos(), angle.cos()], 1).to(torch.bfloat16)
    sin = torch.cat([angle.sin(), angle.sin()], 1).to(torch.bfloat16)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * 2
    on = lambda t: t.to(device)  # noqa: E731
    return dict(qkv=on(qkv), cos=on(cos), sin=on(sin), kv_cache=on(kv), slot_mapping=on(slots.long()),
                block_tables=on(tables), seq_lens=on(lens.int())), kv_bytes


def run(args: dict, block_n: int, warps: int, splits: int) -> torch.Tensor:
    decode_qkv.NUM_WARPS = warps
    return decode_qkv.decode_attention_qkv(**args, num_heads=HEADS, scale=HEAD_DIM ** -0.5, num_splits=splits,
                                           block_n=block_n)


def time_variant(args: dict, block_n: int, warps: int, splits: int, iters: int) -> float:
    """Seconds a launch, from a CUDA graph of `iters` launches (timed eagerly, a short launch measures the host's
    launch path instead: ~100 us a call here, more than the kernel at b=64)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run(args, block_n, warps, splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            run(args, block_n, warps, splits)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="64,256")
    p.add_argument("--contexts", default="192,1024")
    p.add_argument("--block-n", default="16,32,64,128")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(device)}: copy {bw / 1e9:.0f} GB/s (read + write bytes, as gpu_decode.py)")
    default_warps = decode_qkv.NUM_WARPS
    for batch, context in itertools.product([int(x) for x in a.batches.split(",")],
                                            [int(x) for x in a.contexts.split(",")]):
        args, kv_bytes = inputs(batch, context, device, gen)
        cache = args["kv_cache"].clone()
        ref = run(args, decode_qkv.BLOCK_N, default_warps, 1).float()
        print(f"\nbatch {batch}, contexts ~{context} ({kv_bytes / 1e6:.0f} MB of KV)")
        print("block_n warps splits      us   GB/s  of copy   max |diff|")
        rows = []
        for block_n, warps, splits in itertools.product([int(x) for x in a.block_n.split(",")],
                                                        [int(x) for x in a.warps.split(",")],
                                                        [int(x) for x in a.splits.split(",")]):
            try:
                args["kv_cache"].copy_(cache)
                out = run(args, block_n, warps, splits).float()
                seconds = time_variant(args, block_n, warps, splits, a.iters)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory, registers)
                print(f"{block_n:7d} {warps:5d} {splits:6d}  failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            rate = kv_bytes / seconds
            diff = (out - ref).abs().max().item()
            rows.append((seconds, block_n, warps, splits))
            print(f"{block_n:7d} {warps:5d} {splits:6d} {seconds * 1e6:7.1f} {rate / 1e9:6.0f} {rate / bw:7.1%}"
                  f"   {diff:.2e}")
        best = min(rows)
        print(f"best: block_n {best[1]} warps {best[2]} splits {best[3]}: {best[0] * 1e6:.1f} us")
        decode_qkv.NUM_WARPS = default_warps


if __name__ == "__main__":
    main()
