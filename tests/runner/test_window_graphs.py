"""Decode graphs of a model with a window page group (helios/engine/kv_groups.py): the padded inputs and static
buffers carry the group's own tables and KV slots, and the graphed decode (the captured function run eagerly on the
CPU, Triton attention in the interpreter), with and without the speculative next step, gives the eager one-group
runner's tokens while the engine returns the pages before the window."""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.engine.messages import EngineRequest, SamplingParams, ScheduledRequest
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.cuda_graphs import SLOT_MAPPING, WINDOW_SLOTS, StaticBuffers, prepare_decode_inputs
from helios.runner.model_runner import ModelRunner
from tests.models.test_parity import FAMILIES, export_tiny, prompt

PAGE, NUM_PAGES, MAX_MODEL_LEN = 4, 48, 64
WINDOW = FAMILIES["gemma3"]["sliding_window"]

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")


def decode(req_id, num_computed, blocks, window_blocks):
    return ScheduledRequest(req_id=req_id, token_ids=[7], num_computed_tokens=num_computed, block_ids=blocks,
                            group_block_ids=[window_blocks], sample=True)


def test_decode_inputs_and_static_buffers_carry_the_window_tables():
    scheduled = [decode("a", 9, [7, 3, 5], [-1, 4, 6]), decode("b", 2, [9], [2])]
    inputs = prepare_decode_inputs(scheduled, PAGE, bucket=4)
    assert inputs.packed.shape == (5, 4)
    assert inputs.packed[WINDOW_SLOTS].tolist() == [6 * PAGE + 1, 2 * PAGE + 2, -1, -1]  # padded rows write nothing
    assert inputs.packed[SLOT_MAPPING].tolist() == [5 * PAGE + 1, 9 * PAGE + 2, -1, -1]
    assert inputs.window_tables.tolist() == [[0, 4, 6], [2, 0, 0]]  # the entry taken back reads page 0
    buf = StaticBuffers(max_num_seqs=8, max_blocks=16, vocab_size=10, device=torch.device("cpu"), window=WINDOW)
    buf.load(inputs)
    meta = buf.metadata(4, max_model_len=MAX_MODEL_LEN)
    view = meta.for_window(WINDOW)
    assert view.block_tables[:2, :3].tolist() == [[0, 4, 6], [2, 0, 0]]
    assert meta.block_tables[0, :3].tolist() == [7, 3, 5]
    assert view.slot_mapping.tolist() == [6 * PAGE + 1, 2 * PAGE + 2, -1, -1]
    assert view.slot_mapping.data_ptr() == buf.packed[WINDOW_SLOTS].data_ptr()  # views of the static buffers
    buf.pad_all()
    assert buf.packed[WINDOW_SLOTS].eq(-1).all()


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    _, core = export_tiny("gemma3", tmp_path_factory.mktemp("gemma3-graphs"), **FAMILIES["gemma3"])
    return core


def run(core, graphed: bool, decode_overlap: bool = False) -> tuple[dict, ModelRunner]:
    """Three greedy requests through an engine: graphed (window group, Triton, GraphRunner(capture=False)) or the
    eager one-group torch runner (the reference)."""
    window_pages = 3 * window_pages_per_request(WINDOW, PAGE, 64) if graphed else 0
    groups = dict(sliding_window=WINDOW, window_pages=window_pages) if graphed else {}
    config = SchedulerConfig(max_concurrency=3, max_num_batched_tokens=64, prefill_chunk_size=64, page_size=PAGE,
                             num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN, **groups)
    runner = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE, max_model_len=MAX_MODEL_LEN,
                         attention_backend="triton" if graphed else None, decode_overlap=decode_overlap,
                         window_pages=window_pages)
    if graphed:
        runner.graphs = runner.make_graphs([1, 2, 4], capture=False)
    engine = EngineCore(config, runner)
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    for i, n in enumerate((5, 11, 17)):
        engine.add_request(EngineRequest(req_id=f"r{i}", prompt_token_ids=prompt(n, seed=i), sampling=greedy))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        if graphed:
            pool = engine.scheduler.window_groups[0].pool
            assert pool.num_used_blocks <= 3 * (-(-WINDOW // PAGE) + 1)  # between steps: each request's window
    assert engine.error is None
    return tokens, runner


@needs_interpreter
@pytest.mark.parametrize("decode_overlap", [False, True])
def test_graphed_decode_with_a_window_group_gives_the_eager_tokens(core, decode_overlap):
    expected, _ = run(core, graphed=False)
    got, runner = run(core, graphed=True, decode_overlap=decode_overlap)
    assert got == expected
    assert runner.graphs.num_replays >= 10
    if decode_overlap:
        assert runner.overlap_hits >= 5 and runner.overlap_misses == 0
