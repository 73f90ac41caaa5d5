"""minimax_m3 on the GPU: the tiny random checkpoint (the wrapper variant: sparse, full and sparse layers, a dense MLP
then experts) exported in float32 and bfloat16, run by the CUDA runner through the engine: the full layers through
the Triton attention backend, the sparse layers' prefill through their torch ops on the device and their decode steps
through helios.kernels.sparse_decode (index keys in pages beside the K/V), the MoE fused, so decode steps replay CUDA
graphs. greedy tokens (float32, bfloat16) = HF transformers' generate on the device; 16 batched = alone (float32)
(tests/gpu/family_cuda.py's checks); graphed decode = eager decode; the sparse decode kernels = their references and
the layer's torch path (tests/kernels/test_sparse_decode.py's checks on the device)."""

from __future__ import annotations

import pytest

import torch

from tests.gpu.family_cuda import (CUDA_MARKS, DTYPES, check_batched_on_cuda, check_graphed_equals_eager,
                                   check_greedy_on_cuda, check_layer_step_replay, cuda_engine, export_family)
from tests.models.minimax_m3_tiny import build_minimax_m3

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "minimax_m3", lambda hf: build_minimax_m3(hf, "wrapper"))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (38 blocks of 4, 4 kept per query) = HF generate on the device."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    src, cores = exported
    check_greedy_on_cuda(MiniMaxM3SparseForConditionalGeneration, src, cores[dtype])


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests together (prompts split into 64-token chunks beside decodes) = each alone."""
    check_batched_on_cuda(exported[1]["float32"])


def test_graphed_decode_equals_eager(exported):
    """Four requests' 24 greedy tokens through the CUDA engine, decode steps replayed as graphs (the sparse layers'
    selection and attention in helios.kernels.sparse_decode, the MoE fused) = the same engine with graphs off (the
    same kernels eagerly); prompts of 40 to 151 tokens: 10 to 38 blocks of 4, 4 kept."""
    core = exported[1]["float32"]
    check_graphed_equals_eager(lambda graphs: cuda_engine(core, max_concurrency=4, cuda_graphs=graphs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_decode_kernels_match_their_references(dtype):
    """tests/kernels/test_sparse_decode.py's checks compiled: the selection = the layer's (exact, ties to the earlier
    block), the attention = its reference (float32 1e-4; bfloat16 2e-2: probabilities rounded for the PV dot)."""
    from tests.kernels.test_sparse_decode import check_selection, check_sparse_decode

    # float32: other reduction orders and exp2 on the device, as tests/gpu/test_mla_decode_cuda.py allows
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    check_selection("cuda", dtype)
    check_selection("cuda", dtype, tied=True)
    check_sparse_decode("cuda", dtype, tol=tol)
    check_sparse_decode("cuda", dtype, 6, 3, num_splits=2, tol=tol)


def test_sparse_layer_decode_on_the_triton_backend_equals_the_torch_path():
    from tests.kernels.test_sparse_decode import check_layer_decode

    check_layer_decode("cuda", torch.float32, tol=dict(atol=1e-4, rtol=1e-4))


def test_sparse_decode_at_minimax_m3_shape():
    """MiniMax-M3's layer shape (64 query heads over 4 KV heads of 128, 4 index heads of 128, 128-token blocks, 16
    kept, 1 local; 16-token pages) over thousands of keys: the choice = the layer's, the attention = its references;
    splits as the layer takes them (sparse_num_splits: 4)."""
    import msgspec

    from helios.kernels.sparse_decode import sparse_num_splits
    from tests.kernels.test_sparse_decode import CONFIG, check_sparse_decode

    config = msgspec.structs.replace(CONFIG, num_heads=4, head_dim=128, block_size=128, num_blocks=16, local_blocks=1)
    for dtype, tol in ((torch.float32, dict(atol=1e-4, rtol=1e-4)), (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))):
        check_sparse_decode("cuda", dtype, 64, 4, config, sparse_num_splits(16, 128), tol, page_size=16, head_dim=128,
                            seq_lens=(5000, 1, 0, 2100, 129))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_layer_decode_graph_replay_equals_eager(dtype):
    """SparseAttention's decode step on static inputs (tests/gpu/test_mla_decode_cuda.py's construction), captured
    once and replayed after the lengths, tables, slots and hidden rows change in place (longer sequences, other
    pages, a padded row): output and both caches = an eager run of the same step on the same inputs."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.msa import SparseAttention
    from helios.layers.rotary import RotaryEmbedding
    from tests.kernels.test_mla_decode import _bind_random, _randn
    from tests.kernels.test_sparse_decode import CONFIG

    page_size, hidden, num_pages = 16, 64, 64
    layer = SparseAttention(hidden, 4, 2, 16, TritonAttentionBackend(), CONFIG, 1e-6, 8)
    _bind_random([layer], "cuda", dtype)
    rotary = RotaryEmbedding(8, 10000.0, device="cuda")
    caches = (_randn(2, num_pages, page_size, 2, 16, device="cuda", dtype=dtype, seed=4),
              _randn(1, num_pages, page_size, CONFIG.head_dim, device="cuda", dtype=dtype, seed=5))
    check_layer_step_replay(layer, rotary, caches, dtype, hidden, page_size)
