"""qwen4_exp on the GPU: the tiny random checkpoint (the plain variant: GDN and QSA-indexed layers alternating,
hyper-connections, the MoE with a gated shared expert; 8 index heads, tests/models/test_qwen4_exp.TIE_FREE says why)
exported in float32 and bfloat16, run by the CUDA runner through the engine: the GDN layers on their Triton path, the
QSA layers' prefill through their torch ops on the device and their decode steps through helios.kernels.qsa_decode
(raw index keys in pages beside the K/V), the MoE fused, so decode steps replay CUDA graphs. greedy tokens (float32,
bfloat16) = HF transformers' generate on the device; 16 batched = alone (float32) (tests/gpu/family_cuda.py's
checks); graphed decode = eager decode; the QSA decode kernels = the layer's selection and attention and the layer's
torch path (tests/kernels/test_qsa_decode.py's checks on the device); the layer's decode step captured and replayed =
eager."""

from __future__ import annotations

import pytest

import torch

from tests.gpu.family_cuda import (CUDA_MARKS, DTYPES, check_batched_on_cuda, check_graphed_equals_eager,
                                   check_greedy_on_cuda, check_layer_step_replay, cuda_engine, export_family)
from tests.models.qwen4_exp_tiny import build_qwen4_exp
from tests.models.test_qwen4_exp import TIE_FREE

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "qwen4_exp", lambda hf: build_qwen4_exp("plain", hf, **TIE_FREE))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (37 blocks of 4, 2 kept per query, and the tail) = HF generate on the
    device."""
    from transformers import Qwen4ExpForCausalLM

    src, cores = exported
    check_greedy_on_cuda(Qwen4ExpForCausalLM, src, cores[dtype])


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone.

    NOTE: prompts from seed 30, not the other families' 10: at 10, r8's token at position 197 routes within 3.4e-6 of
    a tie between its k-th and next-best expert in layer 1 (float32 router logits on the CPU; every other routing and
    QSA block choice of both runs keeps >= 5.9e-5), and on the GPU the decode rows' router GEMV (a decode step) and
    cuBLAS (a mixed step's rows) round differently: the runs parted at r8's output 10 in every GPU run. At 30 every
    choice keeps >= 3.2e-5 (`python tests/gpu/diagnose_qsa_batched.py --device cpu --seed 30` prints the margins;
    without --device, the same on the GPU, where the choices that differ between the runs are listed)."""
    check_batched_on_cuda(exported[1]["float32"], seed=30)


def test_graphed_decode_equals_eager(exported):
    """Four requests' 24 greedy tokens through the CUDA engine, decode steps replayed as graphs (the QSA layers'
    block scores, choice and attention in helios.kernels.qsa_decode, the GDN and the MoE on their kernels) = the same
    engine with graphs off (the same kernels eagerly); prompts of 40 to 151 tokens: 10 to 37 blocks of 4, 2 kept."""
    core = exported[1]["float32"]
    check_graphed_equals_eager(lambda graphs: cuda_engine(core, max_concurrency=4, cuda_graphs=graphs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qsa_decode_kernels_match_the_layer(dtype):
    """tests/kernels/test_qsa_decode.py's checks compiled: the scores = the layer's (bfloat16 2e-2), the choice = the
    layer's select (float32, exact; ties to the earlier block in every dtype), the attention = the layer's masked
    SDPA (float32 1e-4: other reduction orders and exp2 on the device; bfloat16 2e-2: probabilities rounded for the
    PV dot)."""
    from tests.kernels.test_qsa_decode import check_qsa_decode, check_selection

    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    check_selection("cuda", dtype)
    check_selection("cuda", dtype, tied=True)
    check_qsa_decode("cuda", dtype, tol=tol)
    check_qsa_decode("cuda", dtype, 6, 3, tol=tol)


@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
def test_qsa_layer_decode_on_the_triton_backend_equals_the_torch_path(tied):
    from tests.kernels.test_qsa_decode import check_layer_decode

    check_layer_decode("cuda", torch.float32, tol=dict(atol=1e-4, rtol=1e-4), tied=tied)


def test_qsa_decode_at_a_large_shape():
    """A large layer shape (HF's Qwen4ExpTextConfig defaults for the attention: 16 query heads over 2 KV heads of
    256; QSA's sizes assumed, no published config: 16 index heads of 128, 64-token blocks, 32 kept, rotary over 64
    dims; 16-token pages) over thousands of keys: the choice = the layer's, the attention = its masked SDPA."""
    from helios.core.manifest import IndexerConfig
    from tests.kernels.test_qsa_decode import check_qsa_decode

    config = IndexerConfig(num_heads=16, head_dim=128, block_size=64, num_blocks=32)
    for dtype, tol in ((torch.float32, dict(atol=1e-4, rtol=1e-4)), (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))):
        check_qsa_decode("cuda", dtype, 16, 2, tol, page_size=16, head_dim=256, seq_lens=(5000, 1, 0, 2100, 129),
                         config=config, rotary_dim=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qsa_layer_decode_graph_replay_equals_eager(dtype):
    """IndexedAttention's decode step on static inputs, captured once and replayed after the lengths, tables, slots
    and hidden rows change in place: output and both caches = an eager run (family_cuda.check_layer_step_replay)."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.qsa import IndexedAttention
    from helios.layers.rotary import RotaryEmbedding
    from tests.kernels.test_mla_decode import _bind_random, _randn
    from tests.kernels.test_qsa_decode import CONFIG, ROTARY_DIM

    hidden, page_size, num_pages = 64, 16, 64
    rotary = RotaryEmbedding(ROTARY_DIM, 10000.0, device="cuda")
    layer = IndexedAttention(hidden, 4, 2, 16, CONFIG, 1e-6, rotary, backend=TritonAttentionBackend())
    _bind_random([layer], "cuda", dtype)
    caches = (_randn(2, num_pages, page_size, 2, 16, device="cuda", dtype=dtype, seed=4),
              _randn(1, num_pages, page_size, CONFIG.head_dim, device="cuda", dtype=dtype, seed=5))
    check_layer_step_replay(layer, rotary, caches, dtype, hidden, page_size)
