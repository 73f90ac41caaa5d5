"""qwen3_5's GPU path (residual adds inside the norm kernels, the GDN's fused decode step) = its eager path, on one
decode step of a tiny model in the Triton interpreter: the hidden states and the updated recurrent states."""

from __future__ import annotations

import pytest

from tests.models.hybrid_harness import check_fused_decode_step_equals_eager

PAGE = 4


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def core(request, tmp_path_factory):
    """qwen3_5_moe: each MoE layer's combine launch also takes the next layer's add and norm (the last: the final
    norm), helios.models.qwen3_5.chain_moe_norms."""
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()
    from helios.core.load import load_core
    from ignition.export import ExportOptions, export_core
    from tests.models.hybrid_tiny import build_hybrid

    root = tmp_path_factory.mktemp(f"{request.param}-fused")
    return load_core(export_core(build_hybrid(request.param, root / "hf"), root / "core", ExportOptions()))


@pytest.mark.parametrize("positions", [[9], [5, 9, 17]])
def test_the_fused_decode_step_matches_eager(core, positions):
    from helios.models import build_model

    arch = core.manifest.arch
    eager = build_model(arch, core.tensors, attention_backend="torch")
    fused = build_model(arch, core.tensors, attention_backend="triton")
    assert (eager.path, fused.path) == ("eager", "fused")
    if arch.moe is not None:  # every layer's MoE norms for the next, and the last for the model
        assert all(layer.norms_output is not None for layer in fused.layers)
        assert fused.layers[-1].norms_output is fused.norm and fused.layers[1].input_normed
    check_fused_decode_step_equals_eager(arch, eager, fused, positions, PAGE)
