"""An opt-in pytest plugin for a GPU diagnosis: `pytest -p tests.gpu.fla_ieee ...` runs flash-linear-attention's
float32 dots in IEEE precision, where fla 0.6 takes TF32 on sm80+ (its solve_tril's explicit `tf32` constants, and
Triton's default for every other float32 dot): whether a float32 failure comes from fla's TF32 rounding.
Session 27: that rounding was behind kimi_linear's 16 requests together != alone in float32 (a mixed step sent its
decode rows through fla, a decode step through helios' one-token kernel); helios.layers.linear_attention.mixed_rows
now keeps decode rows on the one-token kernel. What fla's TF32 still rounds is each prompt's own chunked rule.
Were float32 cores to want IEEE there, helios would choose it once a process, before fla compiles (Triton refuses a
kernel whose globals changed after its compile)."""

from __future__ import annotations

import os

os.environ["TRITON_F32_DEFAULT"] = "ieee"


def pytest_configure(config):
    import triton.language as tl

    import fla.ops.gated_delta_rule.chunk_fwd as gated_delta
    import fla.ops.kda.chunk_intra as kda

    for module in (gated_delta, kda):
        module.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")
