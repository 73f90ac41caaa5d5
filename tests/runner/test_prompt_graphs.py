"""Prompt-step graphs (helios/runner/prompt_graphs.py): which steps replay one, their padded static inputs, and
tokens identical to the eager runner's.

On the CPU a PromptGraphs with capture=False runs the function a capture records (static buffers, padded tokens
and sequences) through the Triton backend in the interpreter; the gpu-marked test captures real graphs.
"""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.messages import SamplingParams, ScheduledRequest
from helios.runner import model_runner
from helios.runner.input_batch import RequestState, layout_batch, prepare_batch
from helios.runner.model_runner import ModelRunner
from helios.runner.prompt_graphs import LOGITS_INDICES, POSITIONS, SLOT_MAPPING, TOKEN_IDS, prompt_graph_reason
from helios.switches import Switches
from tests.models.test_parity import export_tiny, prompt
from tests.runner.test_cuda_graphs import MAX_MODEL_LEN, PAGE_SIZE, arrivals_tokens, needs_interpreter


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    _, core = export_tiny("llama", tmp_path_factory.mktemp("llama-prompt-graphs"))
    return core


@pytest.fixture(scope="module")
def gemma3_core(tmp_path_factory):  # sliding-window layers (window 4) and soft-capped logits
    _, core = export_tiny("gemma3", tmp_path_factory.mktemp("gemma3-prompt-graphs"))
    return core


def chunk(req_id, tokens, num_computed, blocks, *, sample=True, logprobs=False):
    return ScheduledRequest(req_id=req_id, token_ids=tokens, num_computed_tokens=num_computed, block_ids=blocks,
                            sample=sample, want_prompt_logprobs=logprobs)


def graphed_runner(core, *, captured: tuple[int, ...] = (), **kw) -> ModelRunner:
    """A runner with decode graphs and prompt graphs that record nothing (their functions run eagerly); the prompt
    buckets `captured` taken as the engine's idle captures would. Without `switches`, the two-pass mixed steps
    (one_pass off: the decode graph plus a prompt graph); the one-pass tests pass Switches(one_pass=True)."""
    kw.setdefault("switches", Switches(one_pass=False))
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE,
                         attention_backend="triton", max_model_len=MAX_MODEL_LEN, **kw)
    runner.graphs = runner.make_graphs([1, 2, 4, 8], capture=False)
    runner.prompt_graphs = runner.make_prompt_graphs(capture=False)
    runner.decode_threads = None  # as on CUDA: no CPU thread policy takes the steps graphs do not
    for bucket in captured:
        runner.capture_pending(prompt_bucket=bucket)
    return runner


def test_only_a_few_short_chunks_without_prompt_logprobs_take_a_bucket(core):
    graphs = graphed_runner(core).prompt_graphs
    assert graphs.buckets == [32, 64, 128, 256, 512] and graphs.max_seqs == 8

    requests = {"a": RequestState("a", [1] * 8, SamplingParams())}  # the prompt a logprobs layout reads

    def bucket(scheduled):
        return graphs.bucket_for(scheduled, layout_batch(scheduled, requests, PAGE_SIZE))

    assert bucket([chunk("a", [1] * 5, 0, [0, 1])]) == 32
    assert bucket([chunk("a", [1] * 30, 0, list(range(8))), chunk("b", [2] * 3, 0, [9])]) == 64
    assert bucket([chunk("a", [1] * 60, 0, list(range(15)))]) == 64
    assert bucket([chunk(f"r{i}", [1] * 4, 0, [i]) for i in range(9)]) is None  # nine sequences
    assert bucket([chunk("a", [1] * 8, 0, [0, 1], logprobs=True)]) is None  # a logits row per prompt token
    assert bucket([chunk("a", [1] * 4, 0, list(range(17)))]) is None  # a table past the static width (16 pages)
    graphs.width = 1024
    assert bucket([chunk("a", [1] * 513, 0, list(range(129)))]) is None  # past the largest bucket


def test_padded_inputs_hold_the_eager_batch_then_padding(core):
    runner = graphed_runner(core)
    graphs = runner.prompt_graphs
    for req_id, tokens in (("a", [5, 6, 7]), ("b", [8, 9])):
        runner.requests[req_id] = RequestState(req_id, tokens, SamplingParams(temperature=0.0))
    scheduled = [chunk("a", [5, 6, 7], 0, [3]), chunk("b", [9], 1, [7], sample=True)]
    layout = layout_batch(scheduled, runner.requests, PAGE_SIZE)
    graphs._load(scheduled, layout, 32)
    eager = prepare_batch(scheduled, runner.requests, PAGE_SIZE, "cpu", layout)
    packed = graphs.packed
    assert packed[TOKEN_IDS, :4].tolist() == eager.token_ids.tolist() and packed[TOKEN_IDS, 4:32].eq(0).all()
    assert packed[POSITIONS, :4].tolist() == [0, 1, 2, 1] and packed[POSITIONS, 4:32].eq(0).all()
    assert packed[SLOT_MAPPING, :4].tolist() == [12, 13, 14, 29] and packed[SLOT_MAPPING, 4:32].eq(-1).all()
    assert packed[LOGITS_INDICES, :8].tolist() == [2, 3, 0, 0, 0, 0, 0, 0]
    starts, lens, tables = graphs._tables(graphs.packed32)
    assert starts.tolist() == [0, 3, 4, 4, 4, 4, 4, 4, 4]  # padded sequences hold zero queries
    assert lens.tolist() == [3, 2, 0, 0, 0, 0, 0, 0]
    assert tables[:2, :2].tolist() == [[3, 0], [7, 0]] and tables[2:].eq(0).all()


def test_prompt_graphs_need_decode_graphs_and_a_shape_driven_dense_family(core, tmp_path):
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=16, page_size=PAGE_SIZE)
    assert runner.prompt_graphs is None  # the CPU: no decode graphs
    assert prompt_graph_reason(runner.model, runner.arch, runner) == "no decode graphs"
    runner.graphs = runner.make_graphs([1, 2], capture=False)
    assert prompt_graph_reason(runner.model, runner.arch, runner) is None
    _, moe = export_tiny("qwen3_moe", tmp_path / "moe")
    moe_runner = ModelRunner(moe.manifest.arch, moe.tensors, num_pages=16, page_size=PAGE_SIZE)
    moe_runner.graphs = object()
    assert prompt_graph_reason(moe_runner.model, moe_runner.arch, moe_runner) == "MoE, recurrent or PLE layers"


@needs_interpreter
@pytest.mark.parametrize("family_core", ["core", "gemma3_core"])
def test_arrivals_beside_decodes_replay_prompt_graphs_with_the_eager_tokens(family_core, request, monkeypatch):
    """Requests arriving one a step while others decode: the mixed steps replay the decode rows' bucket and the
    prompt chunks' token bucket (the first step, with no decode rows, too); every request's greedy tokens are the
    all-eager runner's. A chunked prompt's later chunk (num_computed > 0) reads the keys its earlier chunk wrote."""
    core = request.getfixturevalue(family_core)
    monkeypatch.setattr(model_runner, "SPLIT_MIN_DECODE_ROWS", 2)
    config = SchedulerConfig(max_concurrency=8, max_num_batched_tokens=64, prefill_chunk_size=16,
                             page_size=PAGE_SIZE, num_pages=64, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [prompt(5 + 4 * i, seed=i) for i in range(5)]  # the last two are chunked (21 and 25 > 16 tokens)

    def run(runner):
        return arrivals_tokens(runner, config, prompts, greedy)

    expected = run(ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE))
    graphed = graphed_runner(core, captured=(32, 64))
    assert run(graphed) == expected
    assert graphed.prompt_graphs.num_replays == graphed.launches["prompt_graph"] >= 4  # chunks, some steps share
    assert graphed.launches["eager"] == 0 and graphed.launches["graph"] > 0  # every prompt step fit a bucket
    # a bucket not captured yet: its steps run eagerly, and nothing is captured inside a step
    pending = graphed_runner(core, captured=(64,))
    assert run(pending) == expected
    assert pending.launches["eager"] > 0 and pending.prompt_graphs.pending == [32, 128, 256, 512]
    assert pending.step_capture_s == 0.0


@needs_interpreter
def test_idle_capture_takes_decode_buckets_then_prompt_buckets(core):
    runner = graphed_runner(core)
    runner.graphs = runner.make_graphs([1, 2, 4, 8], lazy=True, capture=False)
    assert runner.graphs.pending == [2, 4]
    assert runner.stats().graph_captures_pending == 2 + 5  # /metrics' flare_graph_captures_pending
    remaining = []
    while runner.capture_pending():
        remaining.append((list(runner.graphs.pending), list(runner.prompt_graphs.pending)))
    assert remaining[0] == ([4], [32, 64, 128, 256, 512])
    assert remaining[1] == ([], [32, 64, 128, 256, 512])
    assert remaining[2] == ([], [64, 128, 256, 512])
    assert not runner.has_pending_captures and runner.prompt_graphs.pending == []
    assert runner.stats().graph_captures_pending == 0


@pytest.mark.gpu
@pytest.mark.parametrize("one_pass", [False, True], ids=["split", "one_pass"])
def test_prompt_graph_replays_match_eager_on_cuda(core, one_pass):
    """Real captures: the same greedy tokens as the eager runner for arrivals among decoding requests, in float32;
    one_pass: the mixed steps replay one prompt graph (decode rows beside prompt chunks), the scheduler holding
    prompts back a step after decode-only steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = dict(num_pages=256, page_size=16, device="cuda", dtype=torch.float32, max_model_len=256)
    eager = ModelRunner(core.manifest.arch, core.tensors, cuda_graphs=False, **kw)
    graphed = ModelRunner(core.manifest.arch, core.tensors, cuda_graphs=True, switches=Switches(one_pass=one_pass),
                          **kw)
    assert graphed.prompt_graphs is not None, graphed.startup.prompt_graphs
    while graphed.capture_pending():  # as the engine does when idle
        pass
    assert sorted(graphed.prompt_graphs.graphs) == graphed.prompt_graphs.buckets
    config = SchedulerConfig(max_concurrency=16, max_num_batched_tokens=256, prefill_chunk_size=64, page_size=16,
                             num_pages=256, max_model_len=256, prompt_step_tokens=256, prompt_step_seqs=8,
                             one_pass_rows=72 if one_pass else 0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [prompt(7 + 13 * i, seed=i) for i in range(10)]

    def run(runner):
        return arrivals_tokens(runner, config, prompts, greedy, max_steps=200)

    assert run(graphed) == run(eager)
    assert graphed.launches["one_pass" if one_pass else "prompt_graph"] > 0 and graphed.prompt_graphs.graphs


def test_one_pass_graphs_hold_decode_rows_beside_prompt_chunks(core):
    """one_pass: finer buckets, up to 72 rows; a bucket holds fewer sequences than tokens (one token a sequence
    reads as a decode batch), so 40 one-token rows take the 64-token bucket, not 32 or 48."""
    graphs = graphed_runner(core, switches=Switches(one_pass=True)).prompt_graphs
    assert graphs.buckets == [32, 64, 96, 128, 160, 192, 256, 320, 384, 512] and graphs.max_seqs == 72
    assert [graphs.seqs_for(b) for b in (32, 64, 96)] == [31, 63, 72]
    requests = {f"d{i}": RequestState(f"d{i}", [1] * 8, SamplingParams()) for i in range(80)}

    def bucket(scheduled):
        return graphs.bucket_for(scheduled, layout_batch(scheduled, requests, PAGE_SIZE))

    decodes = [chunk(f"d{i}", [3], 2, [i % 16]) for i in range(72)]
    assert bucket(decodes[:31]) == 32 and bucket(decodes[:32]) == 64  # 32 rows in 32 tokens: one too many
    assert bucket(decodes[:40] + [chunk("p", [1] * 30, 0, list(range(8)))]) == 96  # 70 tokens, 41 rows
    assert bucket(decodes + [chunk("p", [1] * 4, 0, [0])]) is None  # 73 rows


@needs_interpreter
def test_one_pass_steps_give_the_eager_tokens(core, monkeypatch):
    """Requests arriving one a step while others decode, with one_pass: each mixed step replays one prompt graph for
    its decode rows and prompt chunks together (no decode graph beside it), and every request's greedy tokens are
    the all-eager runner's. The scheduler side (holding prompts back a step) is tests/engine/test_scheduler.py's."""
    monkeypatch.setattr(model_runner, "SPLIT_MIN_DECODE_ROWS", 2)
    config = SchedulerConfig(max_concurrency=8, max_num_batched_tokens=64, prefill_chunk_size=16,
                             page_size=PAGE_SIZE, num_pages=64, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [prompt(5 + 4 * i, seed=i) for i in range(5)]
    expected = arrivals_tokens(ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE),
                               config, prompts, greedy)
    one_pass = graphed_runner(core, captured=(32, 64), switches=Switches(one_pass=True))
    assert arrivals_tokens(one_pass, config, prompts, greedy) == expected
    assert one_pass.launches["one_pass"] >= 3 and one_pass.launches["eager"] == 0  # mixed steps: one replay each
    assert one_pass.launches["graph"] > 0  # decode-only steps keep the decode graphs
