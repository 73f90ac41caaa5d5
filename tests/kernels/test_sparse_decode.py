"""helios.kernels.sparse_decode (minimax_m3's block-sparse decode: block scores, the top-k choice, attention over the
chosen blocks) against its torch references and helios.layers.msa's own selection, and SparseAttention on the Triton
backend (decode-only steps through the kernels) against its torch path, in Triton's CPU interpreter.

The check_* functions build their inputs on `device` and are shared with tests/gpu/test_minimax_m3_cuda.py. Sequences
of different lengths share a batch (one shorter than the kept blocks, one just past a block edge), a padded graph row
(length 0, slot -1) must write nothing and output zeros, and the pools hold random values everywhere.
"""

from __future__ import annotations

import pytest
import torch

from helios.core.manifest import MsaConfig
from tests.kernels.test_mla_decode import _bind_random, _randn, paged_tables, step_meta

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp2(-inf) and friends

# 4-token index blocks, 3 kept, 1 local (the wrapper variant's shape, fewer kept so the choice bites sooner)
CONFIG = MsaConfig(num_heads=2, head_dim=16, block_size=4, num_blocks=3, local_blocks=1, layers=[0])
SEQ_LENS = (37, 5, 0, 9, 1, 22)  # 10 blocks; 2 blocks (< kept); a padded row; one key past a block edge; 1 key


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def reference_masks(q: torch.Tensor, index_cache: torch.Tensor, tables: torch.Tensor, seq_lens, config: MsaConfig):
    """helios.layers.msa.LightningIndexer.select of each sequence's last (decode) query: [Ni, S] bool, None for a
    padded row."""
    from helios.layers.msa import LightningIndexer

    indexer = LightningIndexer(8, config, 1e-6)
    page_size = index_cache.shape[2]
    masks = []
    for i, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            masks.append(None)
            continue
        keys = index_cache[0, tables[i, : -(-seq_len // page_size)].long()].flatten(0, 1)[:seq_len]
        masks.append(indexer.select(q[i : i + 1], keys)[0])
    return masks


def chosen_mask(chosen_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:  # [Ni, K] -> [Ni, S]
    blocks = torch.arange(seq_len, device=chosen_row.device) // block_size
    return (blocks[None, None, :] == chosen_row[:, :, None].long()).any(dim=1)


def check_selection(device, dtype, config=CONFIG, seq_lens=SEQ_LENS, page_size=4, tied=False):
    """block_scores = block_scores_ref (float32 tolerance, -inf past each end) and select_blocks' keys = the layer's
    select for the decode query of every sequence, exactly; a padded row chooses nothing. tied: every key of a
    sequence the same vector, so every block scores the same: the earlier blocks must win, in both."""
    from helios.kernels.sparse_decode import block_scores, block_scores_ref, select_blocks

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    di = config.head_dim
    index_cache = _randn(1, num_pages, page_size, di, device=device, dtype=dtype, seed=1)
    if tied:
        index_cache[:] = _randn(di, device=device, dtype=dtype, seed=5)
    q = _randn(len(seq_lens), config.num_heads, di, device=device, dtype=dtype, seed=2)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scores = block_scores(q, index_cache, tables, lens, config.block_size)
    torch.testing.assert_close(scores, block_scores_ref(q, index_cache, tables, lens, config.block_size),
                               atol=1e-5, rtol=1e-5)
    chosen = select_blocks(scores, lens, config.block_size, config.num_blocks, config.local_blocks)
    for i, (seq_len, want) in enumerate(zip(seq_lens, reference_masks(q, index_cache, tables, seq_lens, config))):
        if want is None:
            assert bool((chosen[i] == -1).all()), chosen[i]
            continue
        assert torch.equal(chosen_mask(chosen[i], seq_len, config.block_size), want), (i, chosen[i])
        if tied:  # the earlier blocks beside the local ones
            nb = -(-seq_len // config.block_size)
            local = set(range(max(0, nb - config.local_blocks), nb))
            earliest = [b for b in range(nb) if b not in local][: config.num_blocks - len(local)]
            assert set(chosen[i, 0].tolist()) - {-1} == local | set(earliest)
    return scores, chosen


def check_sparse_decode(device, dtype, num_heads=4, num_kv_heads=2, config=CONFIG, num_splits=1, tol=None,
                        page_size=4, head_dim=16, seq_lens=SEQ_LENS):
    """The attention over the chosen blocks = sparse_decode_ref and = the layer's masked SDPA (attend_masked under
    select's mask); the padded row outputs zeros."""
    from helios.kernels.sparse_decode import sparse_decode, sparse_decode_ref
    from helios.layers.qsa import attend_masked

    tables, num_pages = paged_tables(list(seq_lens), page_size, device)
    _, chosen = check_selection(device, torch.float32, config, seq_lens, page_size=page_size)
    kv_cache = _randn(2, num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, seed=3)
    q = _randn(len(seq_lens), num_heads, head_dim, device=device, dtype=dtype, seed=4)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    out = sparse_decode(q, kv_cache, tables, lens, chosen, config.block_size, scale, num_splits)
    torch.testing.assert_close(out, sparse_decode_ref(q, kv_cache, tables, lens, chosen, config.block_size, scale),
                               **tol)
    group = num_heads // config.num_heads
    for i, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            assert torch.count_nonzero(out[i]) == 0
            continue
        pages = tables[i, : -(-seq_len // page_size)].long()
        keys, values = (kv_cache[j, pages].flatten(0, 1)[:seq_len] for j in (0, 1))
        heads = chosen_mask(chosen[i], seq_len, config.block_size).repeat_interleave(group, dim=0)[:, None, :]
        torch.testing.assert_close(out[i], attend_masked(q[i : i + 1], keys, values, heads, scale)[0], **tol)


# prefill chunks (seq 3 shorter than the kept blocks), a mixed step (torch path), then decode-only steps with a
# padded graph row; lengths cross 4-token pages and blocks
LENGTHS = (34, 11, 20, 4)
STEPS = [[(0, 0, 30), (1, 0, 9), (2, 0, 17), (3, 0, 2)], [(1, 9, 10), (0, 30, 32), (2, 17, 18)],
         [(0, 32, 33), (-1, 0, 0), (2, 18, 19), (3, 2, 3)], [(3, 3, 4), (1, 10, 11), (0, 33, 34), (2, 19, 20)]]


def check_layer_decode(device, dtype, num_heads=4, num_kv_heads=2, config=CONFIG, tol=None, page_size=4):
    """SparseAttention on the Triton backend (decode-only steps through helios.kernels.sparse_decode) = on the torch
    backend, step by step: outputs and both caches (K/V, index keys: within rounding, the fused path's q/k norms and
    rotary one launch each); the padded row outputs zeros, writes nothing."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.attention import TorchAttentionBackend
    from helios.layers.msa import SparseAttention
    from helios.layers.rotary import RotaryEmbedding

    hidden, head_dim, rotary_dim = 32, 16, 8
    layers = [SparseAttention(hidden, num_heads, num_kv_heads, head_dim, backend, config, 1e-6, rotary_dim)
              for backend in (TorchAttentionBackend(), TritonAttentionBackend())]
    assert [layer.decode_graph_safe for layer in layers] == [False, True]
    _bind_random(layers, device, dtype)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, hidden, generator=g).to(device, dtype) for n in LENGTHS]
    pages = torch.randperm(40, generator=g).tolist()
    tables = [[pages.pop() for _ in range(-(-n // page_size))] for n in LENGTHS]
    caches = [(_randn(2, 40, page_size, num_kv_heads, head_dim, device=device, dtype=dtype, seed=4),
               _randn(1, 40, page_size, config.head_dim, device=device, dtype=dtype, seed=5)) for _ in layers]
    rotary = RotaryEmbedding(rotary_dim, 10000.0)
    tol = tol or dict(atol=1e-5, rtol=1e-5)
    for chunks in STEPS:
        real = [c for c in chunks if c[0] >= 0]
        x = torch.cat([xs[seq][a:b] if seq >= 0 else torch.zeros(1, hidden, device=device, dtype=dtype)
                       for seq, a, b in chunks])
        meta, real_meta = (step_meta(tables, c, page_size, device) for c in (chunks, real))
        rows = torch.tensor([r for r, keep in zip(range(x.shape[0]), _row_is_real(chunks)) if keep])
        cos_sin = tuple(t.to(device) for t in rotary.cos_sin(meta.positions.cpu(), dtype))
        with torch.inference_mode():
            got = layers[1](x, cos_sin, caches[1], meta)
            want = layers[0](x[rows], tuple(t[rows] for t in cos_sin), caches[0], real_meta)
        torch.testing.assert_close(got[rows], want, **tol)
        for ours, ref in zip(caches[1], caches[0]):  # K and the index keys: norms summed in the kernel's order
            torch.testing.assert_close(ours, ref, **tol)
        padded = [r for r, keep in zip(range(x.shape[0]), _row_is_real(chunks)) if not keep]
        assert torch.count_nonzero(got[padded]) == 0


def _row_is_real(chunks) -> list[bool]:
    return [seq >= 0 for seq, a, b in chunks for _ in range(max(b - a, 1))]


# --- CPU: kernels in the interpreter --------------------------------------------------------------------------


def test_selection_is_the_layers(interpreter):
    check_selection("cpu", torch.float32)


def test_tied_blocks_go_to_the_earlier_one_in_both(interpreter):
    check_selection("cpu", torch.float32, tied=True)


@pytest.mark.parametrize("num_heads, num_kv_heads, num_splits", [(4, 2, 1), (6, 3, 2)],
                         ids=["gqa-1split", "run1-2splits"])
def test_sparse_decode_matches_the_reference(interpreter, num_heads, num_kv_heads, num_splits):
    """(6, 3) with 2 index heads: each program holds one head (kv group 2, index group 3)."""
    check_sparse_decode("cpu", torch.float32, num_heads, num_kv_heads, num_splits=num_splits)


def test_layer_decode_on_the_triton_backend_equals_the_torch_path(interpreter):
    check_layer_decode("cpu", torch.float32)


def test_splits_come_from_the_config_alone():
    from helios.kernels.sparse_decode import sparse_num_splits

    assert sparse_num_splits(3, 4) == 1  # 12 keys
    assert sparse_num_splits(16, 128) == 4  # minimax_m3: 2048 keys in 512-key splits
    assert sparse_num_splits(2, 4096) == 2  # never more splits than blocks


def test_graphs_admit_the_kernel_indexers_and_still_refuse_the_others(interpreter, tmp_path):
    """unsupported_reason on the Triton backend: minimax_m3 (SparseAttention's kernels, fused MoE), glm5_next
    (DsaAttention's kernels, KDA's and the MoE's) and qwen4_exp (IndexedAttention's qsa_decode, GDN's and the MoE's)
    are graphed; a sparse or QSA layer off its kernel path keeps the indexed-attention refusal."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.msa import SparseAttention
    from helios.layers.qsa import IndexedAttention
    from helios.runner.cuda_graphs import unsupported_reason
    from tests.kernels.moe_cases import family_arch, unbound_model

    cuda = torch.device("cuda")  # a device object only: nothing runs there
    models = {}
    for family in ("minimax_m3", "glm5_next", "qwen4_exp"):
        arch = family_arch(family, tmp_path / family)
        models[family] = (unbound_model(arch, TritonAttentionBackend()), arch)
    assert unsupported_reason(*models["minimax_m3"], cuda) is None
    assert unsupported_reason(*models["glm5_next"], cuda) is None
    assert unsupported_reason(*models["qwen4_exp"], cuda) is None
    model, arch = models["qwen4_exp"]
    next(m for m in model.modules() if isinstance(m, IndexedAttention)).decode_graph_safe = False
    reason = unsupported_reason(model, arch, cuda)
    assert reason.startswith("indexed attention layers (IndexedAttention)"), reason
    model, arch = models["minimax_m3"]
    next(m for m in model.modules() if isinstance(m, SparseAttention)).decode_graph_safe = False
    assert unsupported_reason(model, arch, cuda).startswith("indexed attention layers (SparseAttention)")
