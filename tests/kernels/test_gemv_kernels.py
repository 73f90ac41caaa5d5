"""The small-batch GEMV kernel vs gemv_ref (Triton interpreter): masked tails, split-K, the dot path."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

from helios.kernels.gemv import default_config, gemv, gemv_ref  # noqa: E402

# float32 accumulation in another order, then one rounding: within an ulp of the output dtype
_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def check_gemv(device, dtype, m, n, k, seed=0, **config):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # poison: every element must be written
    gemv(x, weight, out, **config)
    ref = gemv_ref(x, weight)
    assert not out.isnan().any(), "unwritten output elements"
    tol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    again = gemv(x, weight, **config)
    assert torch.equal(out, again), "not reproducible run to run"
    return out


SHAPES = [(1, 40, 300), (2, 33, 200), (3, 64, 1024), (4, 17, 96), (5, 20, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_gemv_default_config(dtype, m, n, k):
    check_gemv("cpu", dtype, m, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "m, n, k, config",
    [
        (1, 40, 300, dict(block_n=8, block_k=64)),  # N and K tails
        (1, 64, 1024, dict(block_n=16, block_k=128)),  # even: the unmasked path
        (1, 64, 1024, dict(block_n=8, block_k=64, split_k=4)),  # even split-K
        (3, 33, 200, dict(block_n=8, block_k=32, split_k=3)),  # split-K with a short last split
        (2, 48, 256, dict(block_n=16, block_k=64, split_k=2, num_warps=2)),
        (5, 20, 100, dict(block_k=32)),  # M > 4: tl.dot, block_n raised to 16
        (17, 48, 256, dict(block_k=32, split_k=2)),  # two M blocks
    ],
)
def test_gemv_configs(dtype, m, n, k, config):
    check_gemv("cpu", dtype, m, n, k, **config)


def test_gemv_strided_x_and_out():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3, 300, generator=g)
    x = big[:, 50:250]  # rows strided by 300
    weight = torch.randn(24, 200, generator=g)
    buf = torch.full((3, 40), float("nan"))
    out = buf[:, 8:32]
    gemv(x, weight, out, block_n=8, block_k=64)
    torch.testing.assert_close(out, gemv_ref(x, weight), rtol=2e-5, atol=2e-5)
    assert buf[:, :8].isnan().all() and buf[:, 32:].isnan().all()  # nothing outside out written


def test_default_config_fills_the_chip_on_small_n():
    assert default_config(1, 4096, 4096).split_k == 1  # 512 tiles already
    assert default_config(1, 512, 4096).split_k > 1
    # a tile a SM or more: no split, so no reduce launch (qwen3_5_moe's out projections: 256 tiles)
    assert default_config(1, 2048, 4096).split_k == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(
    "m, n, k, config",
    [
        (1, 40, 300, dict(block_n=8, block_k=64)),  # tails
        (1, 64, 1024, dict(block_n=16, block_k=128)),  # the unmasked path
        (2, 33, 200, dict(block_n=8, block_k=32, split_k=3)),
    ],
)
def test_gated_gemv_is_the_activation_then_the_product(dtype, gated, m, n, k, config):
    """gated=: x is [gate | up] (2K wide); the GEMV must see exactly the activation kernel's rounded values,
    so its result equals the plain GEMV over that kernel's output, bit for bit."""
    from helios.kernels.activation import gelu_tanh_and_mul, silu_and_mul

    g = torch.Generator().manual_seed(11)
    x = (torch.randn(m, 2 * k, generator=g) * 2).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    gemv(x, weight, out, gated=gated, **config)
    act = (gelu_tanh_and_mul if gated == "gelu_tanh" else silu_and_mul)(x)
    assert torch.equal(out, gemv(act, weight, **config))
    tol = 2 * _TOL[dtype]  # the activation kernel's own rounding against torch's comes on top
    torch.testing.assert_close(out.float(), gemv_ref(x, weight, gated).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "first"])
@pytest.mark.parametrize("in_float32", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("n, k, config", [(40, 300, dict(block_n=8, block_k=64)), (64, 1024, dict(block_n=16, block_k=128)),
                                          (48, 256, dict(block_n=8, block_k=64, split_k=2))])
def test_gemv_with_the_add_and_rms_norm_folded_in(dtype, with_residual, in_float32, n, k, config):
    """gemv_add_rms_norm == fused_add_rms_norm then gemv: the same new residual bit for bit, and the product of
    the normed row within a rounding of the statistics (the row's sum of squares is reduced in another order)."""
    from helios.kernels.gemv import gemv_add_rms_norm
    from helios.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(13)
    x = torch.randn(1, k, generator=g).to(dtype)
    residual = torch.randn(1, k, generator=g).to(dtype) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    out, new_residual = gemv_add_rms_norm(x, residual, norm_w, 1e-6, weight, in_float32, **config)
    if with_residual:
        normed, expected_residual = fused_add_rms_norm(x, residual, norm_w, 1e-6, in_float32)
        assert torch.equal(new_residual, expected_residual)
    else:
        normed, expected_residual = rms_norm(x, norm_w, 1e-6, in_float32), x
        assert new_residual is x
    tol = 2 * _TOL[dtype]
    torch.testing.assert_close(out.float(), gemv_ref(normed, weight).float(), rtol=tol, atol=tol)
    again, _ = gemv_add_rms_norm(x, residual, norm_w, 1e-6, weight, in_float32, **config)
    assert torch.equal(out, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", [None, "silu", "gelu_tanh"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row-norm"])
@pytest.mark.parametrize("n, k, config", [(40, 300, dict(block_n=8, block_k=64)), (64, 256, dict(block_n=16, block_k=128))])
def test_gemv_add_adds_into_the_stream_and_hands_on_its_sum_of_squares(dtype, gated, scaled, n, k, config):
    """gemv_add == gemv_add_ref (x times its rstd, the product, + add; rounded as torch rounds), one float32 sum of
    squares of the written row per program; split-K is never taken (a program owns whole output rows)."""
    from helios.kernels.gemv import RowNorm, gemv_add, gemv_add_ref

    g = torch.Generator().manual_seed(21)
    x = (4 * torch.randn(1, 2 * k if gated else k, generator=g)).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    add = torch.randn(1, n, generator=g).to(dtype)
    row_norm = RowNorm(torch.rand(7, generator=g) * 40 + 1, 2 * k if gated else k, 1e-5) if scaled else None
    out, partials = gemv_add(x, weight, add, gated=gated, row_norm=row_norm, split_k=4, **config)
    expected, sum_squares = gemv_add_ref(x, weight, add, gated, row_norm)
    tol = 2 * _TOL[dtype]
    # the add may cancel the product: an absolute tolerance at the product's scale (its rounding before the add)
    scale = (expected.float() - add.float()).abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * max(1.0, scale))
    assert partials.dtype == torch.float32 and partials.shape == (-(-n // config["block_n"]),)
    torch.testing.assert_close(partials.sum(), out.float().square().sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(partials.sum(), sum_squares[0], rtol=0.05, atol=0)
    again, again_partials = gemv_add(x, weight, add, gated=gated, row_norm=row_norm, **config)
    assert torch.equal(out, again) and torch.equal(partials, again_partials), "not reproducible run to run"


@pytest.mark.parametrize("num_parts", [1, 7, 38, 300, 1000])
def test_row_sum_squares_splits_an_embedding_row_into_partials(num_parts):
    from helios.kernels.rmsnorm import row_sum_squares

    x = torch.randn(1, 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    sums = row_sum_squares(x, num_parts)
    assert sums.shape == (min(num_parts, 300),) and sums.dtype == torch.float32
    torch.testing.assert_close(sums.sum(), x.float().square().sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value, mode", [(None, "narrow"), ("all", "all"), ("1", "all"), ("narrow", "narrow"),
                                         ("square", "square"), ("nowide", "nowide"), ("0", "off"), ("off", "off")])
def test_the_gemv_switch_picks_which_one_row_products_take_the_gemv(monkeypatch, value, mode):
    """HELIOS_GEMV: narrow (default: weights with no more rows than columns, o and down, and small ones), all,
    square, nowide or off; the device rule beside it in gemv_serves needs CUDA tensors (tests/gpu); the interpreter
    never takes the one-row path."""
    import helios.kernels.gemv as gemv_module
    from helios.switches import Switches

    switches = Switches.from_environ({} if value is None else {"HELIOS_GEMV": value})
    assert switches.gemv == mode
    qkv, o, shared_down = (6144, 4096), (4096, 4096), (2048, 512)
    assert gemv_module.gemv_admits(mode, *o) == (mode != "off")
    assert gemv_module.gemv_admits(mode, *qkv) == (mode in ("all", "nowide"))
    # a small weight (a MoE shared expert's down, 4x as many rows as columns) takes the GEMV but in square and off
    assert gemv_module.gemv_admits(mode, *shared_down) == (mode in ("all", "narrow", "nowide"))
    assert gemv_module.gemv_admits(mode, 8192, 1024) == (mode == "all")  # 8M elements: wide and not small
    monkeypatch.setattr(gemv_module, "HAS_TRITON", True)
    monkeypatch.setattr(gemv_module, "interpret_mode", lambda: False)
    assert gemv_module.gemv_available("cuda", torch.bfloat16) and not gemv_module.gemv_available("cpu", torch.bfloat16)
    assert not gemv_module.gemv_available("cuda", torch.float32)
    monkeypatch.setattr(gemv_module, "interpret_mode", lambda: True)
    assert not gemv_module.gemv_available("cuda", torch.bfloat16)


@pytest.mark.parametrize("mode", ["off", "narrow", "square", "nowide", "all"])
def test_start_up_loads_only_the_gemv_shapes_the_gemv_switch_admits(mode):
    from helios.kernels.aot_shapes import KernelShape, runtime_shape

    qkv, o, gate_up, down, head = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)
    shape = KernelShape(dtype=torch.bfloat16, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        page_size=16, layer_kinds=((None, None),), decode_splits=(1, 4),
                        projections=(qkv, o, gate_up, down, head), projections_ffn=14336,
                        norm_projections=(qkv, gate_up), norm_free=True)
    # the norm-free layers need the GEMV for o and down; they send every other one-row product there too
    norm_free = runtime_shape(shape, mode)
    assert norm_free.norm_free == (mode in ("narrow", "nowide", "all"))
    if norm_free.norm_free:  # but the plain o and down forms: theirs add into the stream (gemv_add)
        wide = shape.projections if mode == "all" else (qkv, gate_up, head)
        assert norm_free.projections == wide and norm_free.plain_down == (mode == "all")
    loaded = runtime_shape(shape, mode, defer_norms=False)
    assert not loaded.norm_free
    expected = {"off": ((), ()), "narrow": ((o, down), ()), "square": ((o,), ()), "nowide": ((qkv, o, down), (qkv,)),
                "all": (shape.projections, shape.norm_projections)}
    assert (loaded.projections, loaded.norm_projections) == expected[mode]
    assert loaded.decode_splits == shape.decode_splits and loaded.projections_ffn == 14336
    # one decode attention path (the fused_decode switch, on by default) and no unfused cache write at start
    assert loaded.decode_paths == ("fused",) and not loaded.cache_write and shape.decode_paths == ("fused", "split")
    split = runtime_shape(shape, mode, fused_decode=False)
    assert split.decode_paths == ("split",) and not split.norm_free  # the norm-free layers decode in one launch


def test_ahead_of_time_launchers_cover_the_norm_free_layer():
    """run_launchers with norm_free launches what helios.models.llama's norm-free layer does (interpreted here on
    small shapes, so every launcher's arguments are checked): the embedding's statistic, both gemv_add forms, and
    decode attention scaled by a RowNorm of one and of many partials."""
    from helios.kernels import aot_shapes, decode_qkv, gemv as gemv_module, rmsnorm

    calls = []

    def spy(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls.append((name, kwargs.get("gated"), None if kwargs.get("row_norm") is None
                          else kwargs["row_norm"].partials.numel()))
            return real(*args, **kwargs)
        return wrapper

    shape = aot_shapes.KernelShape(dtype=torch.float16, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                                   page_size=16, layer_kinds=((None, None),), decode_splits=(1,),
                                   projections=((128, 64), (64, 128)), projections_ffn=96, norm_free=True,
                                   decode_paths=("fused",), cache_write=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemv_module, "gemv_add", spy(gemv_module, "gemv_add"))
        mp.setattr(rmsnorm, "row_sum_squares", spy(rmsnorm, "row_sum_squares"))
        mp.setattr(decode_qkv, "decode_attention_qkv", spy(decode_qkv, "decode_attention_qkv"))
        aot_shapes._norm_free_launchers(shape, "cpu")
    programs = -(-64 // default_config(1, 64, 128).block_n)
    assert calls == [("row_sum_squares", None, None), ("gemv_add", None, None), ("gemv_add", "silu", programs),
                     ("decode_attention_qkv", None, programs)]
