"""Precompiled kernels of the hybrid families on the GPU: a tiny qwen3_5 / qwen3_5_moe checkpoint exported for this
device's target in bfloat16 carries its decode graphs' kernels (helios.runner.aot_trace), the runner loads them at
start (installed cache, then the traced keys put into Triton's in-memory cache) and captures every decode graph
without compiling a kernel."""

from __future__ import annotations

import pytest

from helios.core.load import load_core
from helios.switches import Switches
from tests.gpu.family_cuda import CUDA_MARKS
from tests.models.hybrid_tiny import build_hybrid

pytestmark = CUDA_MARKS

CONTEXT = 256


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_capture_compiles_nothing_with_precompiled_kernels(family, tmp_path):
    from helios.kernels.aot import device_target
    from helios.runner.model_runner import ModelRunner
    from ignition.export import ExportOptions, export_core

    target = device_target("cuda")
    src = build_hybrid(family, tmp_path / "hf")
    core = load_core(export_core(src, tmp_path / "core", ExportOptions(target=target, context_length=CONTEXT)))
    assert [k.target for k in core.manifest.kernels] == [target], "the export compiled no kernels"
    switches = Switches.from_environ({"HELIOS_KERNEL_CACHE": str(tmp_path / "cache")})
    runner = ModelRunner.from_core(core, device="cuda", num_pages=64, max_model_len=CONTEXT, switches=switches,
                                   num_state_slots=4)
    summary = runner.startup.summary()
    assert "precompiled kernels" in runner.startup.kernels and "compiled here" not in runner.startup.kernels, summary
    assert runner.startup.num_graphs > 0 and runner.startup.kernels_jit == 0, summary
