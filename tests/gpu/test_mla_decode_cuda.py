"""helios.kernels.mla_decode compiled on CUDA: the interpreter's checks (tests/kernels/test_mla_decode.py) in bfloat16,
float16 and float32 and at DeepSeek-V3's / Kimi's shape (128 heads, rank 512, rope 64, 16-token pages), the MLA
layer's Triton decode = its torch path, the layer's decode step captured in a CUDA graph and replayed over new
lengths and tables (device-side reads only) = the same step run eagerly, and tiny kimi_linear through the CUDA engine
with its decode graphs (MLA through the kernel) = the same engine without graphs.
"""

from __future__ import annotations

import pytest
import torch

from helios.layers.attention import AttentionMetadata
from tests.gpu.family_cuda import CUDA_MARKS, export_dtypes
from tests.kernels.test_mla_decode import (
    NOPE,
    ROPE,
    _bind_random,
    _randn,
    check_layer_decode,
    check_mla_decode,
    check_write_latent,
    paged_tables,
)

pytestmark = CUDA_MARKS

CUDA = "cuda"
F32_DEVICE = dict(atol=1e-4, rtol=1e-4)  # other reduction orders, exp2 on the device
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])


def _tol(dtype):
    return F32_DEVICE if dtype == torch.float32 else None


@DTYPES
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_the_reference(dtype, num_splits):
    check_mla_decode(CUDA, dtype, num_splits=num_splits, tol=_tol(dtype))
    check_mla_decode(CUDA, dtype, seq_lens=(40, 0, 17), page_size=16, num_splits=num_splits, rope_dim=0,
                     num_heads=6, tol=_tol(dtype))


@DTYPES
def test_decode_at_deepseek_shape(dtype):
    """128 heads (8 head blocks), rank 512 + rope 64, lengths across many pages, 16 splits and one; padded row."""
    lens = (1000, 1, 0, 257)
    for splits in (1, 16):
        check_mla_decode(CUDA, dtype, seq_lens=lens, page_size=16, num_splits=splits, num_heads=128, rank=512,
                         rope_dim=64, tol=_tol(dtype))


def test_write_latent_skips_padded_rows():
    for dtype in (torch.float32, torch.bfloat16):
        check_write_latent(CUDA, dtype)
        check_write_latent(CUDA, dtype, page_size=16, rank=512, rope_dim=64)


@pytest.mark.parametrize("config, num_splits", [(NOPE, None), (ROPE, 3)], ids=["kimi-nope", "deepseek-rope-3splits"])
def test_layer_decode_on_the_triton_backend_equals_the_torch_path(config, num_splits):
    check_layer_decode(CUDA, torch.float32, config, num_splits, tol=F32_DEVICE)


def _decode_meta(seq_lens: list[int], tables: torch.Tensor, page_size: int, bucket: int,
                 width: int) -> dict[str, torch.Tensor]:
    """A decode step's inputs padded to `bucket` rows (length 0, slot -1, table row 0 past the real ones) and tables
    to `width` columns."""
    num = len(seq_lens)
    lens = torch.zeros(bucket, dtype=torch.int32)
    lens[:num] = torch.tensor(seq_lens, dtype=torch.int32)
    positions = (lens.long() - 1).clamp(min=0)
    table = torch.zeros(bucket, width, dtype=torch.int32)
    table[:num, : tables.shape[1]] = tables.cpu()
    pages = table.gather(1, (positions // page_size)[:, None].long())[:, 0].long()
    slots = torch.where(lens > 0, pages * page_size + positions % page_size, torch.full_like(positions, -1))
    return {"positions": positions, "slot_mapping": slots, "seq_lens": lens, "block_tables": table}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_decode_graph_replay_equals_eager(dtype):
    """The layer's decode step on static inputs, captured once (its split count a constant of the capture) and
    replayed after the lengths, tables and slots change in place (longer sequences, other pages, a padded row): output
    and cache = an eager run of the same step on the same inputs."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.mla import MlaAttention

    page_size, bucket, hidden, num_heads, num_pages = 16, 4, 64, 16, 64
    layer = MlaAttention(hidden, num_heads, NOPE, backend=TritonAttentionBackend(decode_num_splits=3))
    _bind_random([layer], CUDA, dtype)
    cache = _randn(1, num_pages, page_size, NOPE.cache_dim, device=CUDA, dtype=dtype, seed=4)
    width = 20  # the static table's columns: room for the longer step replayed below
    first, _ = paged_tables([5, 40, 17], page_size, "cpu")
    static = {k: v.to(CUDA) for k, v in _decode_meta([5, 40, 17], first, page_size, bucket, width).items()}
    x = _randn(bucket, hidden, device=CUDA, dtype=dtype, seed=5)

    def meta() -> AttentionMetadata:  # the *_cpu lists are capture's (as cuda_graphs.StaticBuffers.metadata)
        return AttentionMetadata(query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=CUDA),
                                 query_start_loc_cpu=list(range(bucket + 1)), seq_lens_cpu=[1024] * bucket, **static)

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x, cache.clone(), meta())  # warm-up: compiles
        torch.cuda.current_stream().wait_stream(side)
        replayed_cache = cache.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, replayed_cache, meta())
        lens = [300, 2, 77]  # a new step: other lengths and pages, one row padded
        tables, _ = paged_tables(lens, page_size, "cpu", seed=9, spare=num_pages - 25)
        for name, t in _decode_meta(lens, tables, page_size, bucket, width).items():
            static[name].copy_(t)
        x.copy_(_randn(bucket, hidden, device=CUDA, dtype=dtype, seed=6))
        replayed_cache.copy_(cache)
        eager_cache = cache.clone()
        graph.replay()
        want = layer(x, eager_cache, meta())
    torch.cuda.synchronize()
    # the same kernels on the same inputs; the projections' cuBLAS may pick another algorithm under capture
    tol = F32_DEVICE if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(replayed_cache, eager_cache, **tol)
    assert torch.count_nonzero(out[3]) == 0  # the padded row


@pytest.fixture(scope="module")
def kimi_cores(tmp_path_factory):
    pytest.importorskip("fla")  # KDA's prefill (as tests/gpu/test_recurrent_kernels_cuda.py)
    from tests.models.kimi_linear_tiny import build_kimi_linear

    root = tmp_path_factory.mktemp("kimi_linear_mla")
    return export_dtypes(build_kimi_linear(root / "hf"), root, {"float32": torch.float32})


def test_kimi_linear_decode_graphs_equal_eager(kimi_cores):
    """Four requests' 24 greedy tokens through the CUDA engine, decode steps replayed as graphs (MLA through the
    kernel, splits fixed at capture) = the same engine with graphs off (the kernel eagerly, splits from the lengths)."""
    from tests.gpu.family_cuda import check_graphed_equals_eager

    core = kimi_cores["float32"]
    check_graphed_equals_eager(lambda graphs: hybrid_engine(core, cuda_graphs=graphs), prompt_step=61)


def hybrid_engine(core, cuda_graphs: bool, max_concurrency: int = 4):
    """tests/gpu/test_hybrid_cuda.py's cuda_engine (state slots for the KDA layers) with graphs on or off."""
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore
    from helios.runner.model_runner import ModelRunner
    from tests.models.hybrid_harness import PAGE_SIZE

    arch, num_pages = core.manifest.arch, 512
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=256, prefill_chunk_size=128,
                             page_size=PAGE_SIZE, num_pages=num_pages, max_model_len=num_pages * PAGE_SIZE,
                             num_state_slots=max_concurrency, state_chunk=arch.recurrent.chunk_size)
    runner = ModelRunner(arch, core.tensors, num_pages, PAGE_SIZE, device="cuda", num_state_slots=max_concurrency,
                         cuda_graphs=cuda_graphs)
    return EngineCore(config, runner)
