"""The Triton backend's RMSNorms (helios.layers.norm.use_norm_kernels): a model built for that backend runs every
norm through helios.kernels.rmsnorm, one launch where torch's ops are five (a decode graph's kernel count is what a
batch-1 step on the GPU pays for: benchmarks/decode_launches.py), with torch's values; where the kernel's output
dtype would not be torch's (a float32 multiplier on 16-bit rows, multiplied in the rows' dtype), torch's ops stay.
The kernels run in Triton's interpreter here."""

from __future__ import annotations

import pytest
import torch

from helios.layers.norm import RMSNorm, norm_rotate_heads, post_norm_add
from helios.layers.rotary import RotaryEmbedding
from helios.runner.model_runner import ModelRunner
from tests.kernels.interpreter import require_interpreter
from tests.models.hybrid_harness import PAGE_SIZE, export_float32, prompt
from tests.models.mimo_v2_flash_tiny import build_mimo


def norm(dim: int, dtype: torch.dtype, multiply_in_float32: bool = False, weight_dtype=None) -> RMSNorm:
    module = RMSNorm(dim, 1e-6, multiply_in_float32)
    gen = torch.Generator().manual_seed(dim)
    module.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(dim, generator=gen)).to(weight_dtype or dtype),
                                       requires_grad=False)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("multiply_in_float32", [False, True])
def test_the_kernel_gives_torchs_norm(dtype, multiply_in_float32):
    require_interpreter()
    module = norm(96, dtype, multiply_in_float32)
    x = torch.randn(5, 3, 2 * 96, generator=torch.Generator().manual_seed(1)).to(dtype)[..., :96]  # strided rows
    want = module(x)
    module.kernel = True
    got = module(x)
    assert got.dtype == want.dtype == dtype
    # the kernel sums the squares in another order: float32 within rounding; 16-bit outputs within two roundings
    # (the interpreter's cast to bf16 truncates)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -6)
    torch.testing.assert_close(got, want, **tol)


def test_a_float32_multiplier_on_16_bit_rows_keeps_torchs_float32_product():
    module = norm(64, torch.bfloat16, weight_dtype=torch.float32)
    module.kernel = True
    x = torch.randn(4, 64).bfloat16()
    assert not module._kernel_takes(x)
    assert module(x).dtype == torch.float32  # weight * h.to(bf16) promotes, as HF's norm does


# the kernel sums the squares in another order: float32 within rounding; 16-bit outputs within two roundings
# (the interpreter's cast to bf16 truncates)
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -6)}


def rows(shape, dtype, seed: int) -> torch.Tensor:
    """Random rows of `shape` with a row stride of twice the last dim (the kernels read strided rows)."""
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=torch.Generator().manual_seed(seed))
    return x.to(dtype)[..., : shape[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["weightless", "scale_first", "scale_first_float32_weight"])
def test_the_weightless_and_input_scaled_kernels_give_torchs_norm(dtype, kind):
    """muse_spark's norms: x / rms(x), and norm(x * w) with the product rounded to x's dtype (a float32 weight too:
    torch's output is x's dtype either way, so the kernel takes it)."""
    require_interpreter()
    if kind == "weightless":
        module = RMSNorm(96, 1e-6, has_weight=False)
        assert dict(module.named_parameters()) == {}
    else:
        module = norm(96, dtype, weight_dtype=torch.float32 if kind.endswith("float32_weight") else None)
        module.scale_first = True
    x = rows((5, 3, 96), dtype, seed=2)
    want = module(x)
    module.kernel = True
    assert module._kernel_takes(x)
    got = module(x)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sigmoid_gated_kernel_gives_torchs_norm_times_the_gate(dtype):
    """muse_spark's attention output: norm(o) * sigmoid(gate), the gate a strided view of the projection's rows."""
    require_interpreter()
    module = RMSNorm(32, 1e-6, has_weight=False)
    o = rows((4, 3, 32), dtype, seed=3)
    gate = rows((4, 3 * 32), dtype, seed=4).view(4, 3, 32)
    want = module.forward_gated(o, gate, fused=False)
    got = module.forward_gated(o, gate, fused=True)
    torch.testing.assert_close(want, module(o) * torch.sigmoid(gate), atol=0, rtol=0)
    torch.testing.assert_close(got, want, **TOL[dtype])


def sandwich(dtype, post_kind: str):
    """(post, pre) norms of width 64: post weighted (gemma4's), weightless or input-scaled (muse_spark's)."""
    if post_kind == "weightless":
        post = RMSNorm(64, 1e-5, has_weight=False)
    else:
        post = norm(64, dtype, multiply_in_float32=post_kind == "weighted")
        post.scale_first = post_kind == "scale_first"
    pre = norm(64, dtype, multiply_in_float32=True)
    pre.weight = torch.nn.Parameter(pre.weight.flip(0), requires_grad=False)
    return post, pre


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["weighted", "weighted_scale", "weighted_no_pre", "weightless_gate",
                                  "scale_first_gate", "weightless_alone"])
def test_one_launch_post_norm_add_gives_the_torch_steps(dtype, case):
    """post_norm_add's fused launch (helios.kernels.norm_fused.norm_add_norm) = its torch steps: gemma4's post-norm, add,
    layer scalar and next norm; muse_spark's weightless or input-scaled post-norm and residual gate; the embedding's
    weightless norm with no residual. Both outputs, x's dtype."""
    require_interpreter()
    post, pre = sandwich(dtype, case.split("_")[0] if not case.startswith("scale_first") else "scale_first")
    h, residual = rows((6, 64), dtype, seed=5), rows((6, 64), dtype, seed=6)
    options = {}
    if case.endswith("gate"):
        options["gate"] = (1 + 0.2 * torch.randn(2, 64, generator=torch.Generator().manual_seed(7))).to(dtype)
    if case == "weighted_scale":
        options["scale"] = torch.tensor([0.75], dtype=dtype)
    if case == "weighted_no_pre":
        pre = None
    if case == "weightless_alone":
        residual = None
    want = post_norm_add(h, residual, post, pre, False, **options)
    got = post_norm_add(h, residual, post, pre, True, **options)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype == dtype and g.is_contiguous()
        # 16-bit: up to three truncated roundings (product, post-norm, sum) before the sum of values near 1
        torch.testing.assert_close(g, w, **(TOL[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=2 ** -6)))


def test_post_norm_add_keeps_torchs_steps_where_one_launch_would_change_a_dtype():
    """A float32 layer scalar on 16-bit rows promotes torch's stream to float32: the fused call keeps the torch steps
    (each norm as its own module) and their dtype."""
    post, pre = sandwich(torch.bfloat16, "weighted")
    h, residual = rows((2, 64), torch.bfloat16, seed=8), rows((2, 64), torch.bfloat16, seed=9)
    scale = torch.tensor([0.5])
    normed, stream = post_norm_add(h, residual, post, pre, True, scale=scale)
    assert stream.dtype == torch.float32
    torch.testing.assert_close(stream, (residual + post(h)) * scale, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["q_and_k", "q_and_k_in_dtype", "weightless", "q_alone", "no_rotary"])
def test_one_launch_norm_rotate_heads_gives_the_norms_then_the_rotary(dtype, case):
    """norm_rotate_heads' fused launch (helios.kernels.norm_fused.rms_norm_rope) = q_norm and k_norm over their heads of
    a strided projection row, then apply_rotary's torch ops: gemma4's weighted q/k norms (a KV-shared layer's q
    alone), muse_spark's weightless ones (NoPE layers without rotary), the llama multiply order too."""
    require_interpreter()
    num_q, num_k, d = 4, 2, 32
    if case == "weightless":
        q_norm = k_norm = RMSNorm(d, 1e-6, has_weight=False)
    else:
        q_norm = norm(d, dtype, multiply_in_float32=case != "q_and_k_in_dtype")
        k_norm = norm(d, dtype, multiply_in_float32=case != "q_and_k_in_dtype")
        k_norm.weight = torch.nn.Parameter(k_norm.weight.flip(0), requires_grad=False)
    if case == "q_alone":
        k_norm, num_k = None, 0
    rope = RotaryEmbedding(d, 10000.0)
    rope.tabulate(64, dtype)
    cos_sin = None if case == "no_rotary" else rope.cos_sin(torch.tensor([3, 17, 40]), dtype)  # strided table rows
    x = rows((3, (num_q + num_k + 1) * d), dtype, seed=10)[:, : (num_q + num_k) * d].view(3, num_q + num_k, d)
    want = norm_rotate_heads(x, num_q, q_norm, k_norm, cos_sin, fused=False)
    got = norm_rotate_heads(x, num_q, q_norm, k_norm, cos_sin, fused=True)
    if k_norm is not None:  # one launch: q and k are views of its one output
        assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape
        # the rotation in float32 rounded once, apply_rotary rounding each product: 16-bit within three roundings
        torch.testing.assert_close(g, w, **(TOL[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=2 ** -6)))


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    from transformers import MiMoV2FlashForCausalLM

    root = tmp_path_factory.mktemp("norm-kernels")
    return export_float32(MiMoV2FlashForCausalLM, build_mimo(root / "hf"), root)[1]


def test_a_model_on_the_triton_backend_runs_every_norm_as_the_kernel_with_torchs_logits(mimo):
    """mimo_v2_flash (no fused layer loop of its own: its block norms, q/k-free attention and final norm are plain
    RMSNorms): on the Triton backend each norm is the kernel; float32 logits of every position = the torch
    backend's within the parity bound."""
    require_interpreter()
    arch = mimo.manifest.arch
    runners = {name: ModelRunner(arch, mimo.tensors, 16, PAGE_SIZE, attention_backend=name)
               for name in ("torch", "triton")}
    norms = {name: [m for m in r.model.modules() if isinstance(m, RMSNorm)] for name, r in runners.items()}
    assert len(norms["triton"]) == 2 * arch.num_layers + 1
    assert all(m.kernel for m in norms["triton"]) and not any(m.kernel for m in norms["torch"])
    ids = prompt(12, seed=5)
    torch.testing.assert_close(runners["triton"].forward_logits(ids), runners["torch"].forward_logits(ids),
                               atol=1e-4, rtol=1e-4)
