"""nemotron_h's GPU path (the Mamba-2 mixer's conv, scan and gated-norm launches, relu2 in one launch in the MLP and
the shared expert, residual adds inside the norm kernels) = its eager path: one decode step of the tiny models in the
Triton interpreter, hidden states and updated caches."""

from __future__ import annotations

import pytest

from tests.models.hybrid_harness import check_fused_decode_step_equals_eager

PAGE = 4


@pytest.fixture(scope="module", params=["grouped", "latent"])
def core(request, tmp_path_factory):
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()
    from helios.core.load import load_core
    from ignition.export import ExportOptions, export_core
    from tests.models.nemotron_h_tiny import build_nemotron_h

    root = tmp_path_factory.mktemp(f"nemotron_h-fused-{request.param}")
    return load_core(export_core(build_nemotron_h(root / "hf", request.param), root / "core", ExportOptions()))


@pytest.mark.parametrize("positions", [[9], [5, 9, 17]])
def test_the_fused_decode_step_matches_eager(core, positions):
    from helios.layers.relu2 import FusedRelu2MLP
    from helios.models import build_model

    arch = core.manifest.arch
    eager = build_model(arch, core.tensors, attention_backend="torch")
    fused = build_model(arch, core.tensors, attention_backend="triton")
    assert (eager.path, fused.path) == ("eager", "fused")
    relu2_mlps = [m for m in fused.modules() if isinstance(m, FusedRelu2MLP)]
    assert relu2_mlps and all(m.fused for m in relu2_mlps)  # the MLPs' and the shared experts'
    check_fused_decode_step_equals_eager(arch, eager, fused, positions, PAGE)
