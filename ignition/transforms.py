"""Pure tensor -> tensor weight transforms used by ignition/archs (fusing, stacking, casting, norm shifts).

Every function is a total function of its inputs: no I/O, no names, no config. Later: quantize, shard.
"""

from __future__ import annotations

import torch


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, contiguous (the writer serializes the storage as is)."""
    return t.to(dtype).contiguous()


def fuse_rows(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate along dim 0: q, k, v -> qkv; gate, up -> gate_up (weights and biases alike)."""
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"fuse_rows: mixed dtypes {[t.dtype for t in tensors]}")
    return torch.cat(tensors, dim=0)


def stack_experts(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[E] x [out, in] -> [E, out, in]."""
    return torch.stack(tensors, dim=0)


def add_one(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gemma norms compute x * (1 + w); store the multiplier, added in float32 then cast (as HF does)."""
    return cast(w.float() + 1.0, dtype)


def keep_float32(producer):
    """Mark a plan producer whose float32 tensor the core keeps in float32 whatever its dtype (ignition.write)."""
    producer.keep_float32 = True
    return producer


def round_to(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` and back: a scalar the runtime multiplies by in that dtype."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype).float())
