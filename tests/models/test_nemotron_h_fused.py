"""nemotron_h's GPU path (the Mamba-2 mixer's conv, scan and gated-norm launches, relu2 in one launch in the MLP and
the shared expert, residual adds inside the norm kernels) = its eager path: one decode step of the tiny models in the
Triton interpreter, hidden states and updated caches."""

from __future__ import annotations

import pytest
import torch

from helios.engine.messages import ScheduledRequest

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


def caches(arch, num_pages: int, num_slots: int, seed: int) -> list:
    """Random per-layer caches: Mamba-2 (conv, ssm) states, attention KV pages, None for an ffn layer."""
    gen = torch.Generator().manual_seed(seed)
    r = arch.recurrent
    out = []
    for kind in arch.layer_types:
        if kind == "linear":
            out.append((torch.randn(num_slots + 1, r.conv_kernel - 1, r.conv_dim, generator=gen),
                        0.1 * torch.randn(num_slots + 1, r.num_heads, r.key_head_dim, r.value_head_dim, generator=gen)))
        elif kind == "full":
            out.append(torch.randn(2, num_pages, PAGE, arch.num_kv_heads, arch.head_dim, generator=gen))
        else:
            out.append(None)
    return out


@pytest.mark.parametrize("positions", [[9], [5, 9, 17]])
def test_the_fused_decode_step_matches_eager(core, positions):
    from helios.layers.relu2 import FusedRelu2MLP
    from helios.models import build_model
    from helios.runner.input_batch import prepare_batch

    arch = core.manifest.arch
    eager = build_model(arch, core.tensors, attention_backend="torch")
    fused = build_model(arch, core.tensors, attention_backend="triton")
    assert (eager.path, fused.path) == ("eager", "fused")
    relu2_mlps = [m for m in fused.modules() if isinstance(m, FusedRelu2MLP)]
    assert relu2_mlps and all(m.fused for m in relu2_mlps)  # the MLPs' and the shared experts'
    scheduled = [ScheduledRequest(req_id=f"r{i}", token_ids=[11 + i], num_computed_tokens=p,
                                  block_ids=[8 * i + b for b in range(p // PAGE + 1)], sample=True, state_slot=2 - i)
                 for i, p in enumerate(positions)]
    batch = prepare_batch(scheduled, {}, PAGE, scratch_slot=3)
    want_caches, got_caches = caches(arch, 32, 3, seed=1), caches(arch, 32, 3, seed=1)
    with torch.inference_mode():
        want = eager.forward(batch.token_ids, batch.meta, want_caches)
        got = fused.forward(batch.token_ids, batch.meta, got_caches)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for w, g in zip(want_caches, got_caches):
        for a, b in zip(w if isinstance(w, tuple) else (w,), g if isinstance(g, tuple) else (g,)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
