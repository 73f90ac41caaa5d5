"""Architecture.float32_norms (qwen3_5): a bfloat16 core keeps the zero-centred norms' multipliers 1 + w in float32,
exactly as HF computes them, and the model binds them so; every other tensor takes the core's dtype."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.models import build_model
from helios.layers.norm import RMSNorm
from tests.models.hybrid_tiny import build_hybrid


@pytest.fixture(scope="module")
def bf16_core(tmp_path_factory):
    from ignition.export import ExportOptions, export_core

    root = tmp_path_factory.mktemp("f32norms")
    src = build_hybrid("qwen3_5", root / "hf")
    return src, load_core(export_core(src, root / "core", ExportOptions(dtype="bfloat16")))


def test_the_norm_multipliers_stay_float32_and_exact(bf16_core):
    from safetensors.torch import load_file

    src, core = bf16_core
    assert core.manifest.arch.float32_norms
    hf = {}
    for f in sorted(src.glob("*.safetensors")):
        hf.update(load_file(f))
    kept = {name for name, t in core.tensors.items() if t.dtype == torch.float32}
    gemma_norms = {n for n in core.tensors if n == "norm.weight" or n.endswith(("attn_norm.weight", "mlp_norm.weight",
                                                                                 "q_norm.weight", "k_norm.weight"))}
    assert kept == gemma_norms  # the GDN's gated norm (plain w) and every projection take the core's dtype
    one_plus_w = hf["model.norm.weight"].float() + 1.0
    assert torch.equal(core.tensors["norm.weight"], one_plus_w)
    model = build_model(core.manifest.arch, core.tensors, dtype=torch.bfloat16)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.multiply_in_float32]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)
    assert model.embed.weight.dtype == torch.bfloat16
