"""An opt-in pytest plugin for a GPU diagnosis: `pytest -p tests.gpu.fla_ieee ...` runs flash-linear-attention's
float32 dots in IEEE precision, where fla 0.6 takes TF32 on sm80+ (its solve_tril's explicit `tf32` constants, and
Triton's default for every other float32 dot). The question it answers (session 26, not yet run): do
tests/gpu/test_recurrent_families_cuda.py's three older failures (kimi_linear's and qwen3_next's 16 requests
together against alone in float32, at top-2 logprob gaps of ~5e-4; qwen3_next's bfloat16 greedy against HF's torch
path) come from fla's TF32 rounding? If they pass under it, float32 cores want these settings in helios itself
(chosen once a process, before fla compiles: Triton refuses a kernel whose globals changed after its compile)."""

from __future__ import annotations

import os

os.environ["TRITON_F32_DEFAULT"] = "ieee"


def pytest_configure(config):
    import triton.language as tl

    import fla.ops.gated_delta_rule.chunk_fwd as gated_delta
    import fla.ops.kda.chunk_intra as kda

    for module in (gated_delta, kda):
        module.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
