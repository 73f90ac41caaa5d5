"""Rotary position embeddings (HF "rotate_half" convention) with the default, linear, llama3 and yarn
frequency rules, computed exactly as transformers computes them (inv_freq in float32, cos/sin cast to
the activation dtype). No weights: the table is derived from the architecture on the target device.
"""

from __future__ import annotations

import math

import torch

from helios.core.manifest import RopeScaling


_TABLE_CHUNK = 1 << 16  # positions a RotaryEmbedding.tabulate pass computes at once


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:  # [head_dim // 2]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling, max_positions: int) -> torch.Tensor:
    old_context_len = s.original_max_position_embeddings or max_positions
    low_freq_factor = s.low_freq_factor if s.low_freq_factor is not None else 1.0
    high_freq_factor = s.high_freq_factor if s.high_freq_factor is not None else 4.0
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling, max_positions: int) -> tuple[torch.Tensor, float]:
    # HF defaults: beta_fast 32, beta_slow 1, truncate, attention factor 0.1 ln(factor) + 1.
    original = s.original_max_position_embeddings or max_positions
    factor = s.factor
    attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(32)), 0)
    high = min(math.ceil(correction_dim(1)), head_dim - 1)
    if low == high:
        high += 0.001  # HF avoids the singular ramp the same way
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


class RotaryEmbedding:
    """cos/sin for absolute positions; one instance per distinct (theta, scaling) of a model."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None = None,
        max_position_embeddings: int = 0,
        device: torch.device | str = "cpu",
        rotated_pairs: int | None = None,
    ):
        """rotated_pairs: proportional rope (gemma4's full layers): only the first rotated_pairs of the head_dim / 2
        frequencies turn (their HF values for head_dim), the rest are 0 (cos 1, sin 0: those dims pass); None: all."""
        self.head_dim = head_dim
        self.attention_scaling = 1.0
        inv_freq = _default_inv_freq(head_dim, theta)
        if rotated_pairs is not None:
            inv_freq[rotated_pairs:] = 0.0
        if scaling is not None:
            if scaling.type == "linear":
                inv_freq = inv_freq / scaling.factor
            elif scaling.type == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling, max_position_embeddings)
            elif scaling.type == "yarn":
                inv_freq, self.attention_scaling = _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
            else:
                # NOTE: dynamic NTK rescales with the current sequence length, which would make a
                # request's numerics depend on its batch neighbours; not served.
                raise NotImplementedError(f"rope scaling type {scaling.type!r} is not supported")
        self.inv_freq = inv_freq.to(device)  # [head_dim // 2] float32
        self.table: torch.Tensor | None = None  # [num_positions, 2, head_dim]: (cos, sin) rows (tabulate)

    def tabulate(self, num_positions: int, dtype: torch.dtype) -> None:
        """Compute the (cos, sin) rows of positions 0 .. num_positions - 1 once, with cos_sin's own ops on the
        inv_freq device, so cos_sin gathers a step's rows in one launch instead of ~9 elementwise ones (the
        CUDA path: the same elementwise kernels over the same inputs give the same bits). Every position a
        step can ask for must lie below num_positions (an out-of-range gather is a device-side assert). The
        runner tabulates at load unless the rope_table switch is off (helios.switches)."""
        self.table = None
        device = self.inv_freq.device
        table = torch.empty(num_positions, 2, self.head_dim, dtype=dtype, device=device)
        for start in range(0, num_positions, _TABLE_CHUNK):  # float32 temporaries of a chunk, not of the table
            positions = torch.arange(start, min(start + _TABLE_CHUNK, num_positions), device=device)
            cos, sin = self.cos_sin(positions, dtype)
            table[start : start + len(positions), 0] = cos
            table[start : start + len(positions), 1] = sin
        self.table = table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, head_dim] in `dtype` (rows of the table when one was
        made for dtype; views with a row stride of 2 * head_dim then)."""
        table = self.table
        if table is not None and table.dtype == dtype:
            rows = table.index_select(0, positions)
            return rows[:, 0], rows[:, 1]
        freqs = positions[:, None].to(torch.float32) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def tabulate_rope(model: torch.nn.Module, num_positions: int, dtype: torch.dtype) -> None:
    """RotaryEmbedding.tabulate for each distinct rotary embedding a model holds (global and local bases)."""
    ropes = {id(v): v for v in vars(model).values() if isinstance(v, RotaryEmbedding)}
    for rope in ropes.values():
        rope.tabulate(num_positions, dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # [T, num_heads, head_dim]
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
) -> torch.Tensor:
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def apply_rotary_inplace(
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place
    k: torch.Tensor | None,  # [T, num_kv_heads, head_dim], rotated in place; None: q alone
    cos: torch.Tensor,  # [T, head_dim]
    sin: torch.Tensor,  # [T, head_dim]
) -> None:
    """apply_rotary on q and k as one Triton launch (helios.kernels.rotary: the Triton backend's path, for a model
    module, which may not import helios.kernels). The rotation is done in float32 and rounded once (apply_rotary
    rounds each product, as HF does): equal in float32 within its rounding. q and k must be tensors of their own
    (a norm's output), not views another reader holds."""
    from helios.kernels.rotary import rotary_embedding

    rotary_embedding(q, k if k is not None else q[:, :0], cos, sin)
