"""glm5_next's DSA decode on the GPU: helios.kernels.dsa_decode compiled (tests/kernels/test_dsa_decode.py's checks:
the pool choice = the layer's, exactly, ties to the earlier pool; the absorbed attention over the chosen pools and the
tail = its references, float32 and bfloat16; DsaAttention on the Triton backend = its torch path, a shared layer
reusing the pool lists), and the tiny checkpoint (the "shared" variant: KDA, full and shared DSA layers, experts)
through the CUDA engine with its decode graphs (KDA's and the MoE's kernels, DSA through dsa_decode) = the same engine
without graphs. Prefill stays on the torch reference in both."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS, check_graphed_equals_eager, export_dtypes

pytestmark = CUDA_MARKS

F32_DEVICE = dict(atol=1e-4, rtol=1e-4)  # other reduction orders, exp2 on the device


def test_pool_selection_is_the_layers():
    from tests.kernels.test_dsa_decode import check_pool_selection

    check_pool_selection("cuda", torch.float32)
    check_pool_selection("cuda", torch.float32, tied=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rope, num_splits", [(False, 1), (True, 2)], ids=["nope-1split", "rope-2splits"])
def test_sparse_mla_decode_matches_the_reference(dtype, rope, num_splits):
    from tests.kernels.test_dsa_decode import NOPE, ROPE, check_sparse_mla_decode

    tol = F32_DEVICE if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    check_sparse_mla_decode("cuda", dtype, ROPE if rope else NOPE, num_splits=num_splits, tol=tol)


def test_layer_decode_on_the_triton_backend_equals_the_torch_path():
    from tests.kernels.test_dsa_decode import check_layer_decode

    check_layer_decode("cuda", torch.float32, tol=F32_DEVICE)


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    pytest.importorskip("fla")  # KDA's prefill (as tests/gpu/test_mla_decode_cuda.py's kimi_linear)
    from tests.models.glm5_next_tiny import build_glm5_next

    root = tmp_path_factory.mktemp("glm5_next")
    return export_dtypes(build_glm5_next(root / "hf", "shared"), root, {"float32": torch.float32})["float32"]


def test_graphed_decode_equals_eager(core):
    """Four requests' 24 greedy tokens (prompts of 40 to 151 tokens: most pools dropped), decode steps replayed as
    graphs = the same engine with graphs off (the same kernels eagerly)."""
    from tests.gpu.test_mla_decode_cuda import hybrid_engine

    check_graphed_equals_eager(lambda graphs: hybrid_engine(core, cuda_graphs=graphs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dsa_layers_decode_graph_replay_equals_eager(dtype):
    """A full DsaAttention and a shared one (the pool lists passed on inside the graph), their decode step on static
    inputs (tests/gpu/test_mla_decode_cuda.py's construction) captured once and replayed after the lengths, tables,
    slots and hidden rows change in place (longer sequences, other pages, a padded row): outputs and every cache = an
    eager run of the same step on the same inputs."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.dsa import DsaAttention
    from tests.gpu.family_cuda import check_step_replay
    from tests.kernels.test_dsa_decode import DSA, NOPE
    from tests.kernels.test_mla_decode import _bind_random, _randn

    page_size, bucket, hidden, num_pages, width = 16, 4, 32, 64, 24
    layers = [DsaAttention(hidden, 4, NOPE, DSA, shared, backend=TritonAttentionBackend()) for shared in (False, True)]
    for layer in layers:
        _bind_random([layer], "cuda", dtype)
    caches = [(_randn(1, num_pages, page_size, NOPE.cache_dim, device="cuda", dtype=dtype, seed=4 + 2 * j),
               _randn(1, num_pages, page_size, DSA.cache_dim, device="cuda", dtype=dtype, seed=5 + 2 * j))
              for j in (0, 1)]
    def forward(x, flat, meta):  # the shared layer reads the full one's pool lists inside the graph
        y, pools = layers[0](x, flat[0:2], meta)
        return [y, layers[1](x, flat[2:4], meta, pools)[0]]

    check_step_replay(forward, tuple(t for pair in caches for t in pair), dtype, hidden, page_size, bucket, width)
