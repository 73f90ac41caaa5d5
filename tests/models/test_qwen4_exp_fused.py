"""qwen4_exp's hyper-connection kernels in the model (helios.kernels.qwen4_hc, Triton interpreter): a model the Triton
backend builds takes them for every mix (each layer's two and hc_head); switched on over a torch-backend runner, the
same prompt's float32 logits equal the eager path's within the parity bound, every mix (and each add of a sublayer's
output, inside the next mix) going through the kernels, with and without PLE layers between."""

from __future__ import annotations

from collections import Counter

import pytest

from helios.kernels import qwen4_hc
from helios.layers.attention import select_attention_backend
from tests.models.hybrid_harness import check_fused_loop_equals_eager
from tests.models.test_qwen4_exp import export_qwen4_exp
from tests.models.qwen4_exp_tiny import VARIANTS


@pytest.fixture(scope="module", params=VARIANTS)
def core(request, tmp_path_factory):
    return export_qwen4_exp(request.param, tmp_path_factory.mktemp(request.param))[1]


def mixes(model) -> list:
    return [hc for layer in model.layers for hc in (layer.attn_hc, layer.mlp_hc)] + [model.hc_head]


def test_the_triton_backend_builds_fused_mixes(core):
    from helios.models.qwen4_exp import Qwen4ExpForCausalLM

    arch = core.manifest.arch
    assert not any(hc.fused for hc in mixes(Qwen4ExpForCausalLM(arch, select_attention_backend("torch"))))
    assert all(hc.fused for hc in mixes(Qwen4ExpForCausalLM(arch, select_attention_backend("triton"))))


def test_the_fused_mixes_give_the_eager_paths_logits(core, monkeypatch):
    calls: Counter = Counter()
    hc_mix = qwen4_hc.hc_mix

    def counted(*args, **kwargs):
        calls["hc_mix", kwargs.get("residual", args[7] if len(args) > 7 else None) is not None] += 1
        return hc_mix(*args, **kwargs)

    monkeypatch.setattr(qwen4_hc, "hc_mix", counted)

    def fuse(model):
        for hc in mixes(model):
            hc.fused = True

    check_fused_loop_equals_eager(core, fuse, lambda model: all(hc.fused for hc in mixes(model)))
    arch = core.manifest.arch
    # every mix takes the sublayer before's add, but the first layer's attn_hc and a PLE layer's (its add comes first)
    num_plain = len({0, *(arch.ple.layers if arch.ple is not None else ())})
    assert calls == Counter({("hc_mix", False): num_plain, ("hc_mix", True): 2 * arch.num_layers + 1 - num_plain})
