"""helios.kernels.csa_compress (deepseek_v4's compressor decode step: the entry of the window a token completes, mixed,
normed, turned and written over the window's entry rows in one launch) against its torch reference, in Triton's CPU
interpreter; and CompressedAttention's decode on the Triton backend with tabulated ropes (the kernels reading the
table's rows) against its torch path.

Rows of a batch: tokens completing window 0 (no leading half), a later window, windows that are not complete, a padded
graph row (length 0); everything else in the entry pages stays as it was.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_mla_decode import _randn, paged_tables

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

HEAD_DIM, INDEX_DIM, ROPE_DIM, PAGE_SIZE = 32, 16, 8, 4
# (position of the step's token, length): csa rate 4 completes at 3 (window 0), 11, 23; hca rate 8 at 7, 23
ROWS = ((3, 4), (11, 12), (23, 24), (9, 10), (0, 0), (7, 8))


@pytest.fixture
def interpreter():
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()


def check_compress_step(device, dtype, kind, table, block_m=None):
    """compress_step = compress_step_ref (every compressor of the layer in one launch); only the completing rows'
    entry spans change. block_m: places per tile (2: the softmax and the mix over several tiles, as a long window)."""
    from helios.kernels.csa_compress import Compressed, compress_step, compress_step_ref
    from helios.layers.compressed_attention import InterleavedRope

    rate, rows_in_span = (4, 4) if kind == "csa" else (8, 4)
    lens = [n for _, n in ROWS]
    window_tables, num_window_pages = paged_tables(lens, PAGE_SIZE, device, seed=1)
    tables, num_pages = paged_tables(lens, PAGE_SIZE, device, seed=2)
    width = 2 * HEAD_DIM if kind == "csa" else HEAD_DIM
    raw_dim = HEAD_DIM + 2 * width + (4 * INDEX_DIM if kind == "csa" else 0)
    rows = _randn(1, num_window_pages, PAGE_SIZE, raw_dim, device=device, dtype=dtype, seed=3)
    e = 16 if kind == "csa" else 8  # (32 + 16) / 4 = 12 used: 16 leaves padding; hca 32 / 4 = 8, none
    entries = _randn(1, num_pages, PAGE_SIZE, e, device=device, dtype=dtype, seed=4)
    positions = torch.tensor([p for p, _ in ROWS], device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    rope = InterleavedRope(ROPE_DIM, 160000.0, None, 512, device)
    if table:
        rope.rotary.tabulate(64, dtype)
        cos, sin = rope.table(dtype)
    else:
        cos, sin = rope.cos_sin(positions // rate * rate, dtype)
    compressors = [Compressed(_randn(rate, width, device=device, dtype=dtype, seed=5),
                              _randn(HEAD_DIM, device=device, dtype=dtype, seed=7), HEAD_DIM, 0, 1e-6)]
    if kind == "csa":  # the indexer's: its kv and gate after the main compressor's, its key after the entry's
        compressors.append(Compressed(_randn(rate, 2 * INDEX_DIM, device=device, dtype=torch.float32, seed=6),
                                      _randn(INDEX_DIM, device=device, dtype=dtype, seed=8), HEAD_DIM + 2 * width,
                                      HEAD_DIM, 1e-5))
    got, want = entries.clone(), entries.clone()
    entry_dim = HEAD_DIM + (INDEX_DIM if kind == "csa" else 0)
    kwargs = dict(table=table, rate=rate, entry_rows=rows_in_span, overlap=kind == "csa", pad_from=entry_dim)
    compress_step(rows, got, window_tables, tables, positions, seq_lens, cos, sin, compressors, block_m=block_m,
                  **kwargs)
    compress_step_ref(rows, want, window_tables, tables, positions, seq_lens, cos, sin, compressors, **kwargs)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    written = (got != entries).any(-1)[0]  # [pages, page_size]: the rows the step changed
    completing = [i for i, (p, n) in enumerate(ROWS) if n and (p + 1) % rate == 0]
    assert int(written.sum()) == rows_in_span * len(completing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("table", [False, True])
def test_compress_step_matches_the_reference(interpreter, dtype, kind, table):
    check_compress_step("cpu", dtype, kind, table)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_compress_step_over_several_tiles_of_places(interpreter, kind):
    check_compress_step("cpu", torch.float32, kind, True, block_m=2)


def test_layer_decode_with_rope_tables_equals_the_torch_path(interpreter, monkeypatch):
    """tests/kernels/test_csa_decode's layer check with every rope tabulated (as the runner does on CUDA): the decode
    kernels read the tables' rows, the torch path computes cos/sin; outputs and both caches agree."""
    import helios.layers.compressed_attention as ca
    from tests.kernels.test_csa_decode import check_layer_decode

    class Tabulated(ca.InterleavedRope):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rotary.tabulate(64, torch.float32)

    monkeypatch.setattr(ca, "InterleavedRope", Tabulated)
    check_layer_decode("cpu", torch.float32)
