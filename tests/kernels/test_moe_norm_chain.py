"""helios.layers.moe.chain_moe_norms on a served model in Triton's CPU interpreter: mimo_v2_flash's tiny core (sliding
and full layers, sinks, narrow values, sigmoid-routed MoE layers) through the engine on the Triton backend, where
each MoE layer's combine launch takes the next layer's add and norm (the last: the final norm), gives the torch
backend's greedy tokens, prompts and decode steps."""

from __future__ import annotations

import pytest

from tests.kernels.interpreter import require_interpreter

require_interpreter()

from tests.models.hybrid_harness import generate, greedy_request, window_engine  # noqa: E402


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from helios.core.load import load_core
    from ignition.export import ExportOptions, export_core
    from tests.models.mimo_v2_flash_tiny import build_mimo

    root = tmp_path_factory.mktemp("mimo-chain")
    return load_core(export_core(build_mimo(root / "hf"), root / "core", ExportOptions()))


def test_the_chained_norms_give_the_torch_backends_tokens(core):
    from helios.models import build_model

    model = build_model(core.manifest.arch, core.tensors, attention_backend="triton")
    moe_layers = [layer for layer in model.layers if layer.is_moe]
    assert moe_layers and all(layer.norms_output is not None for layer in moe_layers)
    assert model.layers[-1].norms_output is model.norm
    reqs = [greedy_request("a", list(range(5, 40)), 6), greedy_request("b", list(range(9, 22)), 6)]
    want = generate(window_engine(core, attention_backend="torch"), reqs)
    got = generate(window_engine(core, attention_backend="triton"), reqs)
    assert got == want
