"""MLA decode on the GPU: helios.kernels.mla_decode (the absorbed form over the paged latent cache) against the latent
bytes a decode step must read (every token's R + dr values once, bf16) and the device's copy bandwidth, beside the
torch absorbed form the layer runs without the kernel (a gather of the pages, matmuls, softmax). Never part of
`make test`.

Shapes: DeepSeek-V3 / Kimi-K2's MLA (rank 512, rope 64; 128 heads, or 64 with --heads 64), 16-token pages on a
shuffled pool. Each variant is timed as one CUDA graph over a stack of layers (their caches together past the 50 MiB
L2), replayed (benchmarks/gpu_gated_delta.py's timer); block_h is how many heads one program serves per key row read
(the kernel reads each row once per head block), block_n the keys per loop step, splits as the runner picks them
eagerly (mla_num_splits).
Usage: python benchmarks/gpu_mla.py [--batches 1,64] [--context 4096] [--heads 128] [--iters 20]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_gated_delta import copy_bandwidth, graph_time  # noqa: E402
from helios.kernels.aot_shapes import graph_decode_splits  # noqa: E402
from helios.kernels.mla_decode import mla_decode, mla_num_splits  # noqa: E402

RANK, ROPE, PAGE = 512, 64, 16
STACK_BYTES = 256 << 20  # cache bytes per graph at least
BF16 = dict(device="cuda", dtype=torch.bfloat16)


def layer_inputs(batch: int, context: int, heads: int, num_layers: int) -> list[dict]:
    """Per layer: its latent pool (every sequence's pages, shuffled), block tables, lengths and absorbed queries."""
    blocks = math.ceil(context / PAGE)
    layers = []
    for _ in range(num_layers):
        perm = torch.randperm(batch * blocks, device="cuda").to(torch.int32)
        layers.append(dict(cache=torch.randn(1, batch * blocks, PAGE, RANK + ROPE, **BF16),
                           block_tables=perm.view(batch, blocks).contiguous(),
                           seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
                           q=torch.randn(batch, heads, RANK + ROPE, **BF16)))
    return layers


def kernel_time(layers: list[dict], heads: int, context: int, block_h: int, block_n: int | None,
                iters: int, splits: int | None = None) -> tuple[float, int]:
    """(seconds per layer, the kernel's split count) of mla_decode over the stack; splits None: the eager rule's."""
    batch = layers[0]["q"].shape[0]
    splits = splits or mla_num_splits(None, context, batch, heads, torch.device("cuda"), block_h)
    outs = [torch.empty(batch, heads, RANK, **BF16) for _ in layers]

    def step():
        for layer, out in zip(layers, outs):
            mla_decode(layer["q"], layer["cache"], layer["block_tables"], layer["seq_lens"], RANK, 0.1, splits,
                       out=out, block_h=block_h, block_n=block_n)

    return graph_time(step, iters) / len(layers), splits


def torch_time(layers: list[dict], iters: int) -> float:
    """Seconds per layer of the torch absorbed form (helios.layers.mla.mla_absorbed's attention, all keys valid)."""

    def step():
        for layer in layers:
            rows = layer["cache"][0, layer["block_tables"].long()].flatten(1, 2)  # [B, S, R + dr]
            scores = torch.matmul(layer["q"], rows.transpose(1, 2)) * 0.1
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
            torch.matmul(p, rows[..., :RANK])

    return graph_time(step, iters) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    copy = copy_bandwidth()
    print(f"copy bandwidth (read + write): {copy:.0f} GB/s; MLA rank {RANK} + rope {ROPE}, {args.heads} heads, "
          f"context {args.context}, {PAGE}-token pages, bf16")
    for batch in (int(b) for b in args.batches.split(",")):
        cache_bytes = batch * args.context * (RANK + ROPE) * 2
        num_layers = max(2, min(61, math.ceil(STACK_BYTES / cache_bytes)))
        layers = layer_inputs(batch, args.context, args.heads, num_layers)
        for block_h, block_n in ((16, None), (16, 32), (32, None), (64, None)):  # None: the launcher's default
            try:
                seconds, splits = kernel_time(layers, args.heads, args.context, block_h, block_n, args.iters)
            except Exception as exc:  # noqa: BLE001  (a head block too large for the chip's registers / memory)
                print(f"b={batch:3d} block_h={block_h:2d} block_n={block_n}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rate = cache_bytes / seconds / 1e9
            print(f"b={batch:3d} block_h={block_h:2d} block_n={block_n or 'default'} splits={splits:2d}: "
                  f"{seconds * 1e6:8.1f} us/layer, "
                  f"{rate:6.0f} GB/s of latents = {100 * rate / copy:5.1f}% of copy ({num_layers} layers)")
        # the split count a CUDA graph pins on the attention backend, sized for (rows x kv heads) programs (an MLA
        # arch's kv heads = its heads): what the layer would launch if it took the pin as is (it takes at least its
        # own rule's count, mla_num_splits)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        pinned = graph_decode_splits(batch, args.heads, args.context, num_sms)
        seconds, _ = kernel_time(layers, args.heads, args.context, 16, None, args.iters, pinned)
        print(f"b={batch:3d} block_h=16 the backend's graph pin as is, splits={pinned:2d}: "
              f"{seconds * 1e6:8.1f} us/layer, "
              f"{100 * cache_bytes / seconds / 1e9 / copy:5.1f}% of copy")
        del layers
        torch.cuda.empty_cache()
        layers = layer_inputs(batch, args.context, args.heads, min(num_layers, 8))
        seconds = torch_time(layers, max(3, args.iters // 4))
        print(f"b={batch:3d} torch absorbed form: {seconds * 1e6:8.1f} us/layer "
              f"({cache_bytes / seconds / 1e9:.0f} GB/s of latents)")
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
