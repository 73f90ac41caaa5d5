"""helios.kernels.fused_moe's one-token GEMV path (expert_outputs_one_token) in Triton's CPU interpreter against
expert_outputs_ref: silu, gelu_tanh, relu2, the two clamps and SwiGLU-OAI's alpha, float32 and bfloat16, with the
products whole and split over K (float32 partials, the activation after the reduce), in even and masked tiles;
expert_outputs' one_token switch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

from helios.kernels import fused_moe  # noqa: E402  (after the interpreter check: kernels decorate on import)
from helios.kernels.fused_moe import ExpertGemvConfig  # noqa: E402

NUM_EXPERTS, HIDDEN, INTER = 8, 48, 24
IDS = torch.tensor([[6, 1, 4]], dtype=torch.int32)
# (gate_up's config, down's): "whole" tiles divide both products (no masks), one K range each; "split" takes
# 2 ranges of gate_up (24 rows in tiles of 16: masked) and 3 of down; each product with and without row_acc
CONFIGS = {
    "whole": (ExpertGemvConfig(8, 16, 4, 1), ExpertGemvConfig(16, 8, 4, 1, row_acc=True)),
    "split": (ExpertGemvConfig(16, 16, 4, 2, row_acc=True), ExpertGemvConfig(8, 8, 4, 3)),
}
# act, limit, clamp_after_act, alpha: a limit of 0.5 clamps many of these O(1) pre-activations
CASES = {
    "silu": ("silu", None, False, None),
    "gelu_tanh": ("gelu_tanh", None, False, None),
    "relu2": ("relu2", None, False, None),
    "clamp": ("silu", 0.5, False, None),
    "clamp_after_act": ("silu", 0.5, True, None),
    "alpha": ("silu", 0.5, False, 1.702),
}
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def weights(act: str, dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, W], w_in [E, 2F or F, W], w_down [E, W, F], scaled so every product is O(1)."""
    g = torch.Generator().manual_seed(seed)
    rows = INTER if act == "relu2" else 2 * INTER
    x = torch.randn(1, HIDDEN, generator=g)
    w_in = torch.randn(NUM_EXPERTS, rows, HIDDEN, generator=g) / HIDDEN**0.5
    w_down = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    return x.to(dtype), w_in.to(dtype), w_down.to(dtype)


@pytest.mark.parametrize("split", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_one_token_gemv_matches_the_reference(case, dtype, split):
    act, limit, clamp_after_act, alpha = CASES[case]
    x, w_in, w_down = weights(act, dtype)
    got = fused_moe.expert_outputs_one_token(x, IDS, w_in, w_down, act, limit, clamp_after_act, alpha,
                                             config=CONFIGS[split])
    want = fused_moe.expert_outputs_ref(x, IDS, w_in, w_down, act, limit, clamp_after_act, alpha)
    assert got.shape == (IDS.shape[1], HIDDEN) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])
    if limit is not None:  # the clamp is there: without it the outputs move
        unclamped = fused_moe.expert_outputs_ref(x, IDS, w_in, w_down, act, None, False, alpha)
        assert not torch.allclose(want, unclamped, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_reduce_gives_the_whole_product(dtype):
    """Split over K, each product's float32 partials summed in a fixed order before the activation: within one
    rounding of the whole-K launch, and the same bits on a second run."""
    x, w_in, w_down = weights("silu", dtype, seed=5)
    whole = fused_moe.expert_outputs_one_token(x, IDS, w_in, w_down, "silu", config=CONFIGS["whole"])
    split = fused_moe.expert_outputs_one_token(x, IDS, w_in, w_down, "silu", config=CONFIGS["split"])
    torch.testing.assert_close(split, whole, **TOL[dtype])
    again = fused_moe.expert_outputs_one_token(x, IDS, w_in, w_down, "silu", config=CONFIGS["split"])
    assert torch.equal(split, again)


def test_the_default_config_splits_k_to_fill_the_chip():
    """one_token_config: 8-row tiles of 1 KB chunks summed per chunk; a launch of few tiles splits K (qwen3_5_moe's
    gate_up has 8 x 64 tiles: whole; a 4-expert, 512-row product over 4096 has 256: split in two)."""
    assert fused_moe.one_token_config(512, 2048, 8) == ExpertGemvConfig(8, 512, 4, 1, True)
    assert fused_moe.one_token_config(512, 4096, 4) == ExpertGemvConfig(8, 512, 4, 2, True)
    assert fused_moe.one_token_config(24, 48, 3, torch.float32) == ExpertGemvConfig(8, 64, 4, 1, True)


def test_expert_outputs_takes_the_gemv_for_one_token_only():
    """one_token="gemv": one token goes through expert_outputs_one_token (its defaults), more tokens through the
    grouped GEMMs as before; "dot" (the default) keeps the GEMMs at one token."""
    x, w_in, w_down = weights("silu", torch.bfloat16, seed=7)
    gemv = fused_moe.expert_outputs(x, IDS, w_in, w_down, "silu", one_token="gemv")
    assert torch.equal(gemv, fused_moe.expert_outputs_one_token(x, IDS, w_in, w_down, "silu"))
    dot = fused_moe.expert_outputs(x, IDS, w_in, w_down, "silu")
    torch.testing.assert_close(gemv, dot, **TOL[torch.bfloat16])
    xs = torch.cat([x, -x])
    ids = torch.cat([IDS, IDS.flip(1)])
    assert torch.equal(fused_moe.expert_outputs(xs, ids, w_in, w_down, "silu", one_token="gemv"),
                       fused_moe.expert_outputs(xs, ids, w_in, w_down, "silu"))


def test_the_moe_decode_switch_takes_a_block_s_one_token_through_the_gemv(monkeypatch):
    """HELIOS_MOE_DECODE=gemv (helios.switches) reaches SparseMoe's fused path: one token's output is the torch
    path's within bf16 rounding, and the dot path's within the same."""
    from helios.layers.moe import SparseMoe
    from helios.switches import Switches
    from tests.kernels.moe_cases import bind_random, inputs

    def block(fused: bool, mode: str = "dot") -> SparseMoe:
        return SparseMoe(HIDDEN, NUM_EXPERTS, INTER, 3, True, "silu", Switches(moe_decode=mode), fused=fused)

    layers = [block(False), block(True), block(True, "gemv")]
    bind_random(layers, 0, torch.bfloat16, "cpu")
    assert layers[2].one_token == "gemv"
    x = inputs(1, HIDDEN, torch.bfloat16, seed=5)
    calls = []
    one_token = fused_moe.expert_outputs_one_token
    monkeypatch.setattr(fused_moe, "expert_outputs_one_token", lambda *a, **k: calls.append(1) or one_token(*a, **k))
    want, dot, gemv = (layer(x).float() for layer in layers)
    assert len(calls) == 1  # the gemv block's token only
    torch.testing.assert_close(gemv, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gemv, dot, atol=2e-2, rtol=2e-2)
