"""The mHC kernels in the families (helios.kernels.mhc, Triton interpreter): a model the Triton backend builds takes
them for every hyper-connection (and deepseek_v4's head); switched on over a torch-backend runner, the same prompt's
float32 logits equal the eager path's within the parity bound, every mHC going through the kernels (glm5_next's
"shared" variant: 4 streams, 5 Sinkhorn iterations; deepseek_v4: 2 streams, 20)."""

from __future__ import annotations

from collections import Counter

import pytest

from helios.core.load import load_core
from helios.kernels import mhc as mhc_kernels
from helios.layers.attention import select_attention_backend
from ignition.export import ExportOptions, export_core
from tests.models.deepseek_v4_tiny import build_deepseek_v4
from tests.models.glm5_next_tiny import build_glm5_next
from tests.models.hybrid_harness import check_fused_loop_equals_eager

BUILDERS = {"glm5_next": lambda out: build_glm5_next(out, "shared"), "deepseek_v4": build_deepseek_v4}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family_core(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, load_core(export_core(BUILDERS[request.param](root / "hf"), root / "core",
                                                ExportOptions(dtype="float32")))


def hyper_connections(model) -> list:
    return [hc for layer in model.layers for hc in (layer.attn_hc, layer.mlp_hc)]


def heads(model) -> list:
    return [model.hc_head] if hasattr(model, "hc_head") else []


def test_the_triton_backend_builds_fused_hyper_connections(family_core):
    from helios.models import deepseek_v4, glm5_next

    family, core = family_core
    cls = {"glm5_next": glm5_next.Glm5NextForCausalLM, "deepseek_v4": deepseek_v4.DeepseekV4ForCausalLM}[family]
    arch = core.manifest.arch
    assert not any(hc.fused for hc in hyper_connections(cls(arch, select_attention_backend("torch"))))
    model = cls(arch, select_attention_backend("triton"))
    assert all(hc.fused for hc in hyper_connections(model) + heads(model))


def test_the_fused_hyper_connections_give_the_eager_paths_logits(family_core, monkeypatch):
    family, core = family_core
    calls: Counter = Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for name in ("mhc_pre", "mhc_expand", "hyper_head"):
        monkeypatch.setattr(mhc_kernels, name, counted(name, getattr(mhc_kernels, name)))

    def fuse(model):
        for hc in hyper_connections(model) + heads(model):
            hc.fused = True

    def is_fused(model):
        return all(hc.fused for hc in hyper_connections(model) + heads(model))

    check_fused_loop_equals_eager(core, fuse, is_fused)
    num_hc = 2 * core.manifest.arch.num_layers
    assert calls == Counter(mhc_pre=num_hc, mhc_expand=num_hc, **({"hyper_head": 1} if family == "deepseek_v4"
                                                                   else {}))
