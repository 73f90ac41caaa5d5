"""deepseek_v4 on the GPU: the tiny random checkpoint (tests/models/deepseek_v4_tiny.py: sliding, CSA and HCA layers,
hash-routed and score-routed experts, mHC streams) exported in float32 and bfloat16, run by the CUDA runner through
the engine with the raw rows in the window page group, no prefix caching: greedy tokens (float32, bfloat16) = HF
transformers' generate on the device; 16 batched = alone (float32) (tests/gpu/family_cuda.py's checks). Decode steps
run helios.kernels.csa_decode (tests/kernels/test_csa_decode.py's checks compiled: the CSA choice = the layer's,
exactly; the sink attention over the window and the entries = its references, float32 and bfloat16; the layers on the
Triton backend = their torch path) and are graphed: a layer's decode step captured and replayed = eager, the engine's
graphed greedy tokens = its eager ones. Prefill stays on the torch reference."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS, DTYPES, check_batched_on_cuda, check_greedy_on_cuda, export_family
from tests.models.deepseek_v4_tiny import build_deepseek_v4

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "deepseek_v4", build_deepseek_v4)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (window 8, CSA keeping 3 entries) = HF generate on the device."""
    from transformers import DeepseekV4ForCausalLM

    src, cores = exported
    engine = check_greedy_on_cuda(DeepseekV4ForCausalLM, src, cores[dtype], prefix_caching=False)
    assert engine.runner.graphs is not None, engine.runner.startup.graphs  # csa_decode and the fused MoE


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    check_batched_on_cuda(exported[1]["float32"], prefix_caching=False)


F32_DEVICE = dict(atol=1e-4, rtol=1e-4)  # other reduction orders, exp2 on the device
BF16 = dict(atol=2e-2, rtol=2e-2)


def test_entry_selection_is_the_layers():
    from tests.kernels.test_csa_decode import check_selection

    check_selection("cuda", torch.float32)
    check_selection("cuda", torch.float32, tied=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind, num_splits", [("csa", 1), ("csa", 2), ("hca", 4), ("sliding", 1)])
def test_compressed_decode_matches_the_references(dtype, kind, num_splits):
    from tests.kernels.test_csa_decode import check_attention

    check_attention("cuda", dtype, kind, num_splits, tol=F32_DEVICE if dtype == torch.float32 else BF16)


def test_layer_decode_on_the_triton_backend_equals_the_torch_path():
    from tests.kernels.test_csa_decode import check_layer_decode

    check_layer_decode("cuda", torch.float32, tol=F32_DEVICE)


def test_graphed_decode_equals_eager(exported):
    """Four requests' 24 greedy tokens (prompts of 40 to 151 tokens: many CSA entries dropped, windows completing on
    decode steps), decode steps replayed as graphs = the same engine with graphs off (the same kernels eagerly)."""
    from tests.gpu.family_cuda import check_graphed_equals_eager, cuda_engine

    core = exported[1]["float32"]
    check_graphed_equals_eager(lambda graphs: cuda_engine(core, prefix_caching=False, cuda_graphs=graphs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compressed_layers_decode_graph_replay_equals_eager(dtype):
    """A sliding, a CSA and an HCA CompressedAttention, their decode step on static inputs (tests/gpu/
    test_mla_decode_cuda.py's construction; the rows in group 0's pages) captured once and replayed after the lengths,
    tables, slots and hidden rows change in place (longer sequences, other pages, a padded row; lengths whose token
    completes a CSA window, CSA's window 0 and an HCA window): outputs and both caches = an eager run of the same step
    on the same inputs."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.compressed_attention import CompressedAttention, InterleavedRope
    from tests.gpu.family_cuda import check_step_replay
    from tests.kernels.test_csa_decode import CONFIG, HEAD_DIM
    from tests.kernels.test_mla_decode import _bind_random, _randn

    c, page_size, bucket, hidden, num_pages, width = CONFIG, 16, 4, 32, 64, 24
    layers = [CompressedAttention(hidden, 4, HEAD_DIM, kind, c, 1e-6, backend=TritonAttentionBackend())
              for kind in c.layer_kinds]
    for layer in layers:
        _bind_random([layer], "cuda", dtype)
    rope = InterleavedRope(c.rope_dim, 10000.0, None, 4096, "cuda")
    compress_rope = InterleavedRope(c.rope_dim, c.compress_rope_theta, None, 4096, "cuda")
    caches = [(_randn(1, num_pages, page_size, c.raw_dim(kind, HEAD_DIM), device="cuda", dtype=dtype, seed=4 + j),
               _randn(1, num_pages, page_size, c.entry_row_dim(kind, HEAD_DIM, page_size), device="cuda",
                      dtype=dtype, seed=9 + j)) for j, kind in enumerate(c.layer_kinds)]
    def forward(x, flat, meta):
        return [layer(x, flat[2 * j : 2 * j + 2], meta, rope, compress_rope) for j, layer in enumerate(layers)]

    # lengths whose token completes a CSA window, CSA's window 0 and an HCA window
    check_step_replay(forward, tuple(t for pair in caches for t in pair), dtype, hidden, page_size, bucket, width,
                      lens=(296, 4, 77))
