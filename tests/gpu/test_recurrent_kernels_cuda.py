"""helios.kernels.kda and helios.kernels.mamba compiled on CUDA: the interpreter's checks
(tests/kernels/test_recurrent_kernels.py) at small and at released shapes, fla's chunk_kda prefill (GPU only), both
layers' fused path = their torch path (prefill, decode, a mixed step), the decode steps inside a CUDA graph, and the
kimi_linear, glm5_next and nemotron_h tiny families through the CUDA engine: greedy = transformers' generate on the
device (which takes fla's KDA kernels there when fla is installed; nemotron_h's torch path: no mamba_ssm), and 16
batched requests = each alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, export_dtypes
from tests.gpu.test_hybrid_cuda import check_batched_equals_alone_on_the_gpu, check_greedy_on_the_gpu
from tests.kernels.test_gated_delta import make_batch
from tests.kernels.test_recurrent_kernels import (
    KDA,
    KDA_SAFE,
    MAMBA,
    _kda_decode_inputs,
    check_kda_decode,
    check_kda_prefill,
    check_kda_step,
    check_layer,
    check_mamba2_scan,
)

pytestmark = CUDA_MARKS

DTYPE = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
CUDA = "cuda"
KIMI = dict(num_heads=32, dk=128, dv=128)  # Kimi-Linear-48B-A3B's KDA heads
NEMOTRON = dict(num_heads=128, num_groups=8, head_dim=64, state_dim=128)  # Nemotron-H-8B's Mamba-2 heads
FLA_TOL = dict(atol=2e-2, rtol=2e-2)  # fla's chunked kernels: tf32 / bf16 dots


# --- KDA ---------------------------------------------------------------------------------------------------------


@DTYPE
@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["kimi", "safe"])
@pytest.mark.parametrize("num_splits", [None, 1, 2])
def test_kda_decode(dtype, lower_bound, num_splits):
    check_kda_decode(CUDA, dtype, lower_bound=lower_bound, num_splits=num_splits)


@DTYPE
@pytest.mark.parametrize("num_splits", [1, 4])
def test_kda_decode_real_shape(dtype, num_splits):
    check_kda_decode(CUDA, dtype, lower_bound=-5.0, num_splits=num_splits, starts=(0, 5, 1, 130, 0, 7, 2, 9),
                     steps=3, **KIMI)
    check_kda_decode(CUDA, dtype, num_splits=num_splits, starts=(3, 0), **KIMI)


@DTYPE
def test_kda_step(dtype):
    check_kda_step(CUDA, dtype)
    check_kda_step(CUDA, dtype, **KIMI)


@DTYPE
@pytest.mark.parametrize("lower_bound, safe_gate", [(None, False), (-5.0, False), (-5.0, True)])
def test_kda_prefill_fla(dtype, lower_bound, safe_gate):
    pytest.importorskip("fla")
    check_kda_prefill(CUDA, dtype, lower_bound=lower_bound, safe_gate=safe_gate)
    check_kda_prefill(CUDA, dtype, query_lens=(200, 64, 1, 3), starts=(0, 128, 5, 64), lower_bound=lower_bound,
                      safe_gate=safe_gate, **KIMI)


def test_kda_decode_in_a_cuda_graph_matches_eager():
    """Captured at a bucket of 8 rows (2 padded on the scratch slot), replayed over fresh inputs copied into the
    static buffers: outputs and real slots equal eager launches on the same inputs, bit for bit."""
    from helios.kernels.kda import kda_decode

    rows, scratch = 8, 9
    batch = make_batch([1] * rows, [5, 0, 3, 1, 9, 2, 0, 0], CUDA, num_slots=scratch)
    batch.slots[6:] = scratch  # padded rows
    batch.num_slots = scratch + 1
    inputs = _kda_decode_inputs(CUDA, torch.bfloat16, 32, 128, 128, 4, batch)
    inputs["state"] = inputs["state"].nan_to_num(0.0)  # the scratch slot starts clean here
    inputs["conv_state"] = inputs["conv_state"].nan_to_num(0.0)
    static = {k: v.clone() for k, v in inputs.items()}
    eager = {k: v.clone() for k, v in inputs.items()}
    call = dict(slots=batch.slots, starts=batch.starts, lower_bound=-5.0, num_splits=4)
    kda_decode(**{k: v.clone() for k, v in inputs.items()}, **call)  # warm-up: compile, counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_decode(**static, **call)
    real = torch.arange(scratch, device=CUDA)
    for step in range(3):
        fresh = _kda_decode_inputs(CUDA, torch.bfloat16, 32, 128, 128, 4, batch, seed=10 * (step + 1))
        for name in ("mixed_qkv", "f", "b"):
            static[name].copy_(fresh[name])
            eager[name].copy_(fresh[name])
        graph.replay()
        expected = kda_decode(**eager, **call)
        torch.cuda.synchronize()
        assert torch.equal(out[:6], expected[:6])
        assert torch.equal(static["state"][real], eager["state"][real])
        assert torch.equal(static["conv_state"][real], eager["conv_state"][real])


# --- Mamba-2 -------------------------------------------------------------------------------------------------------


@DTYPE
def test_mamba2_scan(dtype):
    check_mamba2_scan(CUDA, dtype)
    check_mamba2_scan(CUDA, dtype, query_lens=(5, 1, 12), starts=(0, 3, 8), num_groups=1, head_dim=20,
                      dt_limit=(0.05, 0.8))
    check_mamba2_scan(CUDA, dtype, query_lens=(37, 20, 1), starts=(5, 0, 9), head_dim=8, chunk_size=16,
                      dt_limit=(0.0, 0.9))


@DTYPE
@pytest.mark.parametrize("chunk_size", [None, 16, 128], ids=["sequential", "chunk16", "chunk32"])
def test_mamba2_scan_real_shape(dtype, chunk_size):
    check_mamba2_scan(CUDA, dtype, query_lens=(300, 1, 64, 3), starts=(0, 9, 64, 2), steps=3, chunk_size=chunk_size,
                      **NEMOTRON)
    check_mamba2_scan(CUDA, dtype, query_lens=(1,) * 8, starts=(0, 5, 1, 130, 0, 7, 2, 9), **NEMOTRON)


def test_mamba_decode_in_a_cuda_graph_matches_eager():
    """The fused layer's decode step (conv kernel + scan) captured at 8 rows (2 padded on the scratch slot) and
    replayed over fresh rows: outputs and real slots = eager launches, bit for bit."""
    from helios.kernels.gated_delta import causal_conv
    from helios.kernels.mamba import mamba2_scan

    rows, scratch, h, g, p, n, width = 8, 9, 128, 8, 64, 128, 4
    batch = make_batch([1] * rows, [5, 0, 3, 1, 9, 2, 0, 0], CUDA, num_slots=scratch)
    batch.slots[6:] = scratch
    channels = h * p + 2 * g * n
    gen = torch.Generator(device=CUDA).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=CUDA).to(dtype)

    weights = dict(weight=randn(channels, width) * 0.5, bias=randn(channels) * 0.1)
    params = dict(A_log=randn(h) * 0.5, D=randn(h), dt_bias=randn(h) * 0.5)
    states = {name: (randn(scratch + 1, width - 1, channels), randn(scratch + 1, h, p, n, dtype=torch.float32))
              for name in ("static", "eager")}
    states["eager"] = tuple(t.copy_(s) for t, s in zip(states["eager"], states["static"]))
    inputs = {name: (randn(rows, channels), randn(rows, h)) for name in ("static", "eager")}
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=CUDA)

    def step(name):
        xbc, dt = inputs[name]
        conv_state, ssm = states[name]
        y = causal_conv(xbc, weights["weight"], conv_state, batch.slots, qsl, batch.starts, bias=weights["bias"])
        x, b, c = y.split([h * p, g * n, g * n], dim=-1)
        return mamba2_scan(x.view(rows, h, p), dt, params["A_log"], b.view(rows, g, n), c.view(rows, g, n),
                           params["D"], params["dt_bias"], ssm, batch.slots, qsl, batch.starts)

    step("eager")  # warm-up: compile (on copies: the eager states advance with the static ones below)
    states["eager"] = tuple(t.copy_(s) for t, s in zip(states["eager"], states["static"]))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step("static")
    real = torch.arange(scratch, device=CUDA)
    for _ in range(3):
        for t, s in zip(inputs["static"], inputs["eager"]):
            s.copy_(randn(*s.shape))
            t.copy_(s)
        graph.replay()
        expected = step("eager")
        torch.cuda.synchronize()
        assert torch.equal(out[:6], expected[:6])
        for ours, ref in zip(states["static"], states["eager"]):
            assert torch.equal(ours[real], ref[real])


# --- the layers: fused = torch path on the device -------------------------------------------------------------------


@pytest.mark.parametrize("config", [KDA, KDA_SAFE], ids=["kimi", "safe"])
def test_kda_layer_matches_the_torch_path(config):
    pytest.importorskip("fla")
    check_layer(config, CUDA, fused_prefill=True, tol=FLA_TOL)
    check_layer(config, CUDA, torch.bfloat16, fused_prefill=True, tol=dict(atol=6e-2, rtol=6e-2))


def test_mamba_layer_matches_the_torch_path():
    check_layer(MAMBA, CUDA, fused_prefill=True, tol=dict(atol=1e-4, rtol=1e-4))
    check_layer(MAMBA, CUDA, torch.bfloat16, fused_prefill=True, tol=dict(atol=3e-2, rtol=3e-2))


# --- the families through the engine --------------------------------------------------------------------------------


def _hf_class(family: str):
    import transformers

    if family == "glm5_next":  # the multimodal wrapper, used text only (as tests/models/test_glm5_next.py)
        return transformers.Glm5NextForConditionalGeneration
    return transformers.AutoModelForCausalLM


def _build(family: str, out_dir):
    if family == "kimi_linear":
        from tests.models.kimi_linear_tiny import build_kimi_linear

        return build_kimi_linear(out_dir)
    if family == "glm5_next":
        from tests.models.glm5_next_tiny import build_glm5_next

        return build_glm5_next(out_dir)
    from tests.models.nemotron_h_tiny import build_nemotron_h

    return build_nemotron_h(out_dir, chunk_size=32)  # prefill through the chunked scan kernel (the default 8: the
    # sequential one, which the decode steps take anyway)


@pytest.fixture(scope="module", params=["kimi_linear", "glm5_next", "nemotron_h"])
def exported(request, tmp_path_factory):
    if request.param != "nemotron_h":
        pytest.importorskip("fla")  # KDA's prefill
    root = tmp_path_factory.mktemp(request.param)
    src = _build(request.param, root / "hf")
    return request.param, src, export_dtypes(src, root)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    family, src, cores = exported
    check_greedy_on_the_gpu(src, cores[dtype], _hf_class(family))


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    check_batched_equals_alone_on_the_gpu(exported[2]["float32"])  # float32: see family_cuda.check_batched_on_cuda
