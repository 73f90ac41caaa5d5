"""helios.kernels.mla_decode (the absorbed MLA decode over latent pages, the latent cache write) against its torch
references, and helios.layers.mla's layer on the Triton backend (the kernel for decode rows) against its torch path,
in Triton's CPU interpreter.

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_mla_decode_cuda.py. Block
tables are random permutations of the pool, lengths cross pages, the pool holds random values everywhere (a lane
reading past its mask shows), and a padded row (length 0, slot -1) must write nothing and output zeros.
"""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import MlaConfig
from helios.layers.attention import AttentionMetadata

# the interpreter (numpy) warns on exp overflow / log(0) where the GPU quietly gives inf / -inf
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# a tiny deepseek-style MLA (q latent, rope part) and a kimi_linear / glm5_next-style one (no q latent, NoPE)
ROPE = MlaConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=24,
                 softmax_scale=32**-0.5)
NOPE = MlaConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, softmax_scale=24**-0.5)


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def _randn(*shape, device, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def paged_tables(seq_lens: list[int], page_size: int, device, seed: int = 0, spare: int = 3):
    """(block tables [B, max_blocks] int32 over a shuffled pool, padded with 0 past each end, the pool's page count)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(blocks) + spare
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return tables.to(device), num_pages


def check_mla_decode(device, dtype, seq_lens=(37, 5, 70, 0, 1), page_size=4, num_splits=1, num_heads=20, rank=32,
                     rope_dim=16, block_h=16, block_n=None, tol=None):
    """The kernel = mla_decode_ref; 20 heads: two head blocks of 16, the second partly masked; length 0 = zeros."""
    from helios.kernels.mla_decode import mla_decode, mla_decode_ref

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    width = rank + rope_dim
    cache = _randn(1, num_pages, page_size, width, device=device, dtype=dtype, seed=1)
    q = _randn(len(seq_lens), num_heads, width, device=device, dtype=dtype, seed=2)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = (rank + rope_dim) ** -0.5
    out = mla_decode(q, cache, tables, lens, rank, scale, num_splits, block_h=block_h, block_n=block_n)
    torch.testing.assert_close(out, mla_decode_ref(q, cache, tables, lens, rank, scale), **(tol or TOL[dtype]))
    padded = [i for i, n in enumerate(seq_lens) if n == 0]
    assert torch.count_nonzero(out[padded]) == 0
    return out


def check_write_latent(device, dtype, page_size=4, rank=32, rope_dim=16):
    """Rows into their slots in the cache dtype, a -1 slot writing nothing, every other slot untouched."""
    from helios.kernels.mla_decode import write_latent, write_latent_ref

    cache = _randn(1, 6, page_size, rank + rope_dim, device=device, dtype=dtype)
    latent = _randn(5, rank, device=device, dtype=dtype, seed=1)  # the model's dtype is the cache's: a plain copy
    fused = _randn(5, 40 + rope_dim, device=device, dtype=dtype, seed=2)
    rope_key = fused[:, 40:]  # a strided view, as the layer's split of its projection gives it
    slots = torch.tensor([3, -1, 17, 0, 23], device=device)
    ours, ref = cache.clone(), cache.clone()
    write_latent(ours, latent, rope_key, slots)
    write_latent_ref(ref, latent, rope_key, slots)
    assert torch.equal(ours, ref)


def _bind_random(layers: list, device, dtype, seed: int = 0) -> None:
    """The same random weights in every layer (norm weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in layers[0].named_parameters():
        scale = 0.1 if "norm" in name else p.shape[-1] ** -0.5
        t = (torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0)).to(device, dtype)
        for layer in layers:
            owner, _, leaf = name.rpartition(".")
            (layer.get_submodule(owner) if owner else layer)._parameters[leaf] = torch.nn.Parameter(t.clone(), False)


def step_meta(tables: list[list[int]], chunks: list[tuple[int, int, int]], page_size: int, device) -> AttentionMetadata:
    """One step: chunks (sequence, first position, end position) in batch order; a sequence -1 is a padded graph row
    (length 0, slot -1, an all-zero table row)."""
    positions, slots, qsl, lens = [], [], [0], []
    for seq, start, end in chunks:
        positions += range(start, end) if seq >= 0 else [0]
        slots += ([tables[seq][p // page_size] * page_size + p % page_size for p in range(start, end)]
                  if seq >= 0 else [-1])
        qsl.append(qsl[-1] + max(end - start, 1))
        lens.append(end if seq >= 0 else 0)
    block_tables = torch.zeros(len(chunks), max(len(t) for t in tables), dtype=torch.int32)
    for row, (seq, _, _) in enumerate(chunks):
        if seq >= 0:
            block_tables[row, : len(tables[seq])] = torch.tensor(tables[seq])
    return AttentionMetadata(positions=torch.tensor(positions, device=device),
                             slot_mapping=torch.tensor(slots, device=device),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             block_tables=block_tables.to(device), query_start_loc_cpu=qsl, seq_lens_cpu=lens)


# three sequences: prefill chunks, then a mixed step (a continuation chunk beside two decode rows), then decode steps
# with a padded graph row; lengths cross 4-token pages
LENGTHS = (26, 10, 13)
STEPS = [[(0, 0, 20), (1, 0, 8), (2, 0, 11)], [(1, 8, 9), (0, 20, 25), (2, 11, 12)],
         [(0, 25, 26), (-1, 0, 0), (2, 12, 13), (1, 9, 10)]]


def check_layer_decode(device, dtype, config: MlaConfig, num_splits=None, tol=None, page_size=4, num_heads=20):
    """MlaAttention on the Triton backend (kernel write, decode rows through mla_decode) = its torch path, step by
    step (outputs and the latent pages), from the same weights and inputs; the padded row outputs zeros."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.mla import MlaAttention
    from helios.layers.rotary import RotaryEmbedding

    hidden = 48
    torch_layer = MlaAttention(hidden, num_heads, config)
    fused_layer = MlaAttention(hidden, num_heads, config, backend=TritonAttentionBackend(num_splits))
    assert fused_layer.decode_graph_safe and not torch_layer.decode_graph_safe
    _bind_random([torch_layer, fused_layer], device, dtype)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, hidden, generator=g).to(device, dtype) for n in LENGTHS]
    pages = torch.randperm(40, generator=g).tolist()
    tables = [[pages.pop() for _ in range(-(-n // page_size))] for n in LENGTHS]
    caches = [_randn(1, 40, page_size, config.cache_dim, device=device, dtype=dtype, seed=4) for _ in range(2)]
    rotary = RotaryEmbedding(config.qk_rope_head_dim, 10000.0) if config.q_lora_rank else None
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    for chunks in STEPS:
        meta = step_meta(tables, chunks, page_size, device)
        x = torch.cat([xs[seq][a:b] if seq >= 0 else torch.zeros(1, hidden, device=device, dtype=dtype)
                       for seq, a, b in chunks])
        cos_sin = rotary.cos_sin(meta.positions.cpu(), dtype) if rotary else None
        cos_sin = tuple(t.to(device) for t in cos_sin) if cos_sin else None
        real = [i for i, (seq, _, _) in enumerate(chunks) if seq >= 0]
        real_chunks = [chunks[i] for i in real]
        real_meta = step_meta(tables, real_chunks, page_size, device)
        real_rows = torch.tensor([r for i in real for r in range(meta.query_start_loc_cpu[i],
                                                                  meta.query_start_loc_cpu[i + 1])], device=device)
        with torch.inference_mode():
            got = fused_layer(x, caches[1], meta, cos_sin)
            real_cos_sin = tuple(t[real_rows] for t in cos_sin) if cos_sin else None
            want = torch_layer(x[real_rows], caches[0], real_meta, real_cos_sin)
        torch.testing.assert_close(got[real_rows], want, **tol)
        torch.testing.assert_close(caches[1], caches[0], **tol)
        padded = [meta.query_start_loc_cpu[i] for i, (seq, _, _) in enumerate(chunks) if seq < 0]
        assert torch.count_nonzero(got[padded]) == 0


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


# NOTE: float16, not bfloat16, here: the interpreter's bfloat16 dots give garbage (paged_attention's decode kernel
# too); tests/gpu runs bfloat16
@pytest.mark.parametrize("dtype, num_splits", [(torch.float32, 1), (torch.float32, 3), (torch.float16, 3)],
                         ids=["fp32", "fp32-3splits", "fp16-3splits"])
def test_decode_matches_the_reference(interpreter, dtype, num_splits):
    check_mla_decode("cpu", dtype, num_splits=num_splits, block_n=16)


def test_decode_without_rope_part_and_larger_pages(interpreter):
    """glm5_next's MLA keeps no rope part (dr = 0); 16-token pages, 32-key blocks spanning two of them."""
    check_mla_decode("cpu", torch.float32, seq_lens=(40, 0, 17), page_size=16, num_splits=2, rope_dim=0, num_heads=6)


def test_write_latent_skips_padded_rows(interpreter):
    check_write_latent("cpu", torch.float32)
    check_write_latent("cpu", torch.bfloat16, rope_dim=0)


@pytest.mark.parametrize("config, num_splits", [(NOPE, None), (ROPE, 3)], ids=["kimi-nope", "deepseek-rope-3splits"])
def test_layer_decode_on_the_triton_backend_equals_the_torch_path(interpreter, config, num_splits):
    check_layer_decode("cpu", torch.float32, config, num_splits)


def test_splits_follow_the_lengths_and_heads_at_least_the_pin():
    from helios.kernels.mla_decode import mla_num_splits

    cpu = torch.device("cpu")
    assert mla_num_splits(5, 100, 1, 128, cpu) == 5  # a pin (tests, a graph of short sequences) is a floor
    assert mla_num_splits(None, 200, 1, 128, cpu) == 1  # short: one split
    assert mla_num_splits(None, 8192, 1, 128, cpu) == 16  # 8 head blocks of one sequence: as many as allowed
    assert mla_num_splits(3, 8192, 1, 128, cpu) == 16  # a batch-1 graph's pin for 128 kv heads: too few here
    assert mla_num_splits(None, 8192, 64, 128, cpu) == 1  # 512 programs already


def test_cuda_graphs_take_mla_layers_only_on_the_triton_backend(interpreter):
    """A kimi_linear model (MLA layers only here) on the Triton backend: every MLA layer decodes through the kernel,
    so helios.runner.cuda_graphs accepts it; on the torch backend it refuses it for its MLA layers."""
    from helios.core.manifest import Architecture
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.attention import select_attention_backend
    from helios.models.kimi_linear import KimiLinearForCausalLM
    from helios.runner.cuda_graphs import attention_backends, unsupported_reason

    arch = Architecture(family="kimi_linear", vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=4, head_dim=24, rms_norm_eps=1e-5, rope_theta=0.0,
                        max_position_embeddings=512, tie_word_embeddings=False, layer_types=["full", "full"], mla=NOPE,
                        position_embedding="none")
    cuda = torch.device("cuda")  # a device object only: nothing runs there
    backend = TritonAttentionBackend()
    fused = KimiLinearForCausalLM(arch, backend, "meta")
    assert unsupported_reason(fused, arch, cuda) is None
    assert attention_backends(fused) == [backend]  # the graph runner pins its decode splits
    eager = KimiLinearForCausalLM(arch, select_attention_backend("torch"), "meta")
    assert unsupported_reason(eager, arch, cuda).startswith("MLA layers decode on the torch path")
