"""RMSNorm as the HF families compute it: statistics in float32, weights stored as the multiplier.

Two orders of the final multiply exist upstream and differ only below float32 (bf16/fp16):
llama/qwen cast the normalized value back to the input dtype before multiplying by the weight;
gemma multiplies in float32 and casts afterwards. `multiply_in_float32` picks the gemma order. Weightless and
input-scaled (muse_spark) norms are RMSNorm modules too, so the Triton backend's switch (`kernel`) reaches them;
`post_norm_add` is a sandwich block's post-norm, residual add and next norm, `norm_rotate_heads` the q and k heads'
norms and rotary, each one launch on the Triton path.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.layers.rotary import apply_rotary, apply_rotary_inplace


def rms_norm(
    x: torch.Tensor,  # [..., dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
    multiply_in_float32: bool = False,
) -> torch.Tensor:
    """y = x / rms(x) * weight, normalized in float32 like HF."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if multiply_in_float32:
        return (h * weight.to(torch.float32)).to(input_dtype)
    return weight * h.to(input_dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., dim]
    """x / rms(x) in float32, rounded to x's dtype: a norm without a weight (HF's weightless norms, muse_spark)."""
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Holds `weight` [dim] (bound from the core) and applies `rms_norm`; with scale_first, norm(x * weight) instead
    (muse_spark's input-scaled norm: the product in float32, rounded to x's dtype, then normalized); without a weight
    (has_weight False: HF's weightless norms) x / rms(x) rounded to x's dtype (`rms_normalize`). With `kernel`
    (helios.models.use_layer_kernels: a model on the Triton backend) forward runs helios.kernels.rmsnorm's one launch
    where its output is torch's dtype, else torch's five."""

    kernel = False

    def __init__(self, dim: int, eps: float, multiply_in_float32: bool = False, scale_first: bool = False,
                 has_weight: bool = True):
        super().__init__()
        if scale_first and not has_weight:
            raise ValueError("an input-scaled norm has a weight")
        self.eps = eps
        self.multiply_in_float32 = multiply_in_float32
        self.scale_first = scale_first
        if has_weight:
            # NOTE: meta until the model binds the core's tensor; never allocated here.
            self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self.kernel and self._kernel_takes(x):
            return self._kernel(x)
        if self.weight is None:
            return rms_normalize(x, self.eps)
        if self.scale_first:
            return rms_normalize((x.float() * self.weight.float()).to(x.dtype), self.eps)
        return rms_norm(x, self.weight, self.eps, self.multiply_in_float32)

    def forward_gated(
        self,
        x: torch.Tensor,  # [T, N, dim] or [T, dim]
        gate: torch.Tensor,  # x's shape and dtype; rows may be strided
        fused: bool,
    ) -> torch.Tensor:  # self(x) * torch.sigmoid(gate), x's shape
        """The norm times a sigmoid gate (muse_spark's attention output); `fused`: one Triton launch, same roundings."""
        if fused and self._kernel_takes(x) and gate.shape == x.shape and gate.dtype == x.dtype and gate.stride(-1) == 1:
            return self._kernel(x, sigmoid_gate=gate)
        return self(x) * torch.sigmoid(gate)

    def _kernel(self, x: torch.Tensor, sigmoid_gate: torch.Tensor | None = None) -> torch.Tensor:
        from helios.kernels.rmsnorm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, self.weight, self.eps, self.multiply_in_float32, scale_first=self.scale_first,
                               sigmoid_gate=sigmoid_gate)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel gives what forward's torch ops give: rows of a 2-d or 3-d tensor with unit last stride,
        and an output in x's dtype (torch's 16-bit x times a float32 weight, unless multiplied in float32, is
        float32; a weightless or input-scaled norm's is always x's)."""
        w = self.weight
        return (x.dim() in (2, 3) and x.stride(-1) == 1
                and (w is None or (w.is_contiguous()
                                   and (self.scale_first or self.multiply_in_float32 or w.dtype == x.dtype))))

    def forward_add_gemv(
        self,
        x: torch.Tensor,  # [1, dim]
        residual: torch.Tensor | None,  # [1, dim]; None for the first layer
        weight: torch.Tensor,  # [N, dim], the projection that reads the normed row
        allow_pdl: bool = True,  # the gemv_pdl switch (helios.switches)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual) @ weight.T, x + residual)
        """forward_add then the projection, in one GEMV launch (batch-1 decode on the GPU path)."""
        from helios.kernels.gemv import gemv_add_rms_norm

        return gemv_add_rms_norm(x, residual, self.weight, self.eps, weight, self.multiply_in_float32,
                                 allow_pdl=allow_pdl)

    def forward_add(
        self,
        x: torch.Tensor,  # [T, dim]
        residual: torch.Tensor | None,  # [T, dim]; None for the first layer
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual), x + residual)
        """The residual add and the norm; `fused` runs both in one Triton kernel (GPU path), same values."""
        if fused:
            from helios.kernels.rmsnorm import fused_add_rms_norm

            if residual is None:
                return self._kernel(x), x
            assert self.weight is not None and not self.scale_first, "the fused add knows the weighted norms only"
            return fused_add_rms_norm(x, residual, self.weight, self.eps, self.multiply_in_float32)
        x = x if residual is None else x + residual
        return self(x), x


def pre_norm_stack(x: torch.Tensor, layers, caches: list, meta, norm: RMSNorm, fused: bool, *inputs) -> torch.Tensor:
    """x through a stack of pre-norm blocks and the final norm: each `layer(x, *inputs, cache, meta)` returning its
    output with the residual added (eager), or, with `fused`, `layer.forward_fused(x, residual, *inputs, cache,
    meta)` returning (its output, the stream before the add), each add then taken with the next norm in one launch
    (RMSNorm.forward_add). inputs: what every layer reads besides its cache (a rotary table)."""
    if not fused:
        for layer, cache in zip(layers, caches):
            x = layer(x, *inputs, cache, meta)
        return norm(x)
    residual = None
    for layer, cache in zip(layers, caches):
        x, residual = layer.forward_fused(x, residual, *inputs, cache, meta)
    if getattr(layers[-1], "norms_output", None) is norm:  # the last layer's launch took the final norm
        return x
    return norm.forward_add(x, residual, fused=True)[0]


def post_norm_add(
    h: torch.Tensor,  # [T, dim] a sublayer's output
    residual: torch.Tensor | None,  # [T, dim] the stream; None: the stream is post(h)
    post: RMSNorm,
    pre: RMSNorm | None,  # the next block's norm of the stream (a weighted one); None: none
    fused: bool,
    *,
    gate: torch.Tensor | None = None,  # [2, dim] (alpha, beta): alpha * residual + beta * post(h) in float32
    scale: torch.Tensor | None = None,  # [1]: the stream times it (gemma4's layer scalar)
) -> tuple[torch.Tensor | None, torch.Tensor]:  # (pre(stream) or None, stream)
    """A sandwich block's tail: stream = residual + post(h) (with `gate`, muse_spark's residual gate, rounded once),
    times `scale`, then the next block's pre(stream). `fused` (the Triton path): one launch
    (helios.kernels.norm_fused.norm_add_norm) where it gives torch's dtypes, else each step as below."""
    if fused and _one_launch_takes(h, residual, post, pre, gate, scale):
        from helios.kernels.norm_fused import norm_add_norm

        return norm_add_norm(h, residual, post.weight, post.eps, pre.weight if pre is not None else None,
                             pre.eps if pre is not None else 0.0, post_multiply_in_float32=post.multiply_in_float32,
                             post_scale_first=post.scale_first,
                             pre_multiply_in_float32=pre is not None and pre.multiply_in_float32, gate=gate,
                             scale=scale)
    s = post(h)
    if residual is not None and gate is not None:
        alpha, beta = gate.float()
        s = (alpha * residual.float() + beta * s.float()).to(residual.dtype)
    elif residual is not None:
        s = residual + s
    if scale is not None:
        s = s * scale
    return (pre(s) if pre is not None else None), s


def _one_launch_takes(h, residual, post: RMSNorm, pre: RMSNorm | None, gate, scale) -> bool:
    """Whether norm_add_norm gives post_norm_add's torch values and dtypes: 2-d rows of one dtype with unit last
    stride, norms whose kernel keeps that dtype, a weighted pre-norm, a contiguous [2, dim] gate, a scalar of h's
    dtype (a float32 one would promote the stream)."""
    return (h.dim() == 2 and h.stride(-1) == 1 and post._kernel_takes(h)
            and (residual is None or (residual.shape == h.shape and residual.dtype == h.dtype
                                      and residual.stride(-1) == 1))
            and (pre is None or (pre.weight is not None and not pre.scale_first and pre._kernel_takes(h)))
            and (gate is None or (residual is not None and gate.shape == (2, h.shape[1]) and gate.is_contiguous()))
            and (scale is None or (scale.numel() == 1 and scale.dtype == h.dtype)))


def norm_rotate_heads(
    x: torch.Tensor,  # [T, Nq + Nk, D]: q's heads, then k's (adjacent in the projection's output; rows may be strided)
    num_q_heads: int,
    q_norm: RMSNorm,
    k_norm: RMSNorm | None,  # None: x holds q's heads only
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,  # each [T, r], r <= D (partial rotary below D); None: none
    fused: bool,
    round_products: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (q [T, Nq, D], k [T, Nk, D]), each normed and rotated
    """q_norm over the first num_q_heads heads, k_norm over the rest, then the rotary of both (apply_rotary) over
    each head's leading r dims, the rest passed. `fused` (the Triton path): one launch
    (helios.kernels.norm_fused.rms_norm_rope: the rotation in float32, rounded once, as apply_rotary_inplace) where
    both norms are of one kind and keep x's dtype, else each norm as its module and the rotation in place. With
    round_products the fused path rounds as apply_rotary does (each product, then the sum: the torch path's bits),
    in the launch or, where it cannot serve, through apply_rotary itself."""
    norms = [q_norm] if k_norm is None else [q_norm, k_norm]
    if fused and _rope_launch_takes(x, norms, cos_sin):
        from helios.kernels.norm_fused import rms_norm_rope

        cos, sin = cos_sin if cos_sin is not None else (None, None)
        out = rms_norm_rope(x, q_norm.weight, q_norm.eps, q_norm.multiply_in_float32, weight2=norms[-1].weight,
                            num_first=num_q_heads, cos=cos, sin=sin, round_products=round_products)
        return out[:, :num_q_heads], out[:, num_q_heads:]
    q = q_norm(x[:, :num_q_heads])
    k = k_norm(x[:, num_q_heads:]) if k_norm is not None else x[:, num_q_heads:]
    if cos_sin is None:
        return q, k
    r = cos_sin[0].shape[-1]
    if fused and not round_products:  # the norms' outputs: tensors of their own
        apply_rotary_inplace(q[..., :r], k[..., :r] if k_norm is not None else None, *cos_sin)
        return q, k

    def rotate(h: torch.Tensor) -> torch.Tensor:
        turned = apply_rotary(h[..., :r], *cos_sin)
        return turned if r == h.shape[-1] else torch.cat([turned, h[..., r:]], dim=-1)

    return rotate(q), (rotate(k) if k_norm is not None else k)


def _rope_launch_takes(x: torch.Tensor, norms: list[RMSNorm], cos_sin) -> bool:
    """Whether rms_norm_rope gives norm_rotate_heads' torch values and dtypes: 3-d rows of unit last stride and even
    width, norms of one kind (weightless, or weights of one dtype multiplied alike; one eps) whose kernel keeps x's
    dtype, cos/sin rows [T, r] (r even, <= D) of x's dtype."""
    first = norms[0]
    same = all(n.eps == first.eps and not n.scale_first and (n.weight is None) == (first.weight is None)
               and n.multiply_in_float32 == first.multiply_in_float32
               and (n.weight is None or (n.weight.dtype == first.weight.dtype and n._kernel_takes(x))) for n in norms)
    rotary_dim = x.shape[-1] if cos_sin is None else cos_sin[0].shape[-1]
    rope_ok = cos_sin is None or all(t.shape == (x.shape[0], rotary_dim) and t.dtype == x.dtype
                                     and t.stride(-1) == 1 for t in cos_sin)
    return (x.dim() == 3 and x.stride(-1) == 1 and rotary_dim % 2 == 0 and rotary_dim <= x.shape[-1] and same
            and rope_ok)
