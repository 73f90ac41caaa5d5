"""CUDA-graph decode: bucketing, padded static inputs, and replay against the eager path.

On the CPU the graph logic runs without CUDA: pure tensor code for bucketing and the padded inputs, and a
GraphRunner with capture=False, whose `run` calls the exact function a graph captures, with the Triton
backend in the interpreter (tests/conftest.py sets TRITON_INTERPRET without CUDA). The gpu-marked tests
capture real graphs and compare replayed logits and greedy outputs with the eager runner.
"""

from __future__ import annotations

import pytest
import torch

from helios.engine.messages import EngineRequest, NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.kernels.aot_shapes import short_decode_splits
from helios.runner.cuda_graphs import (
    SEQ_LENS,
    SHORT_SEQ_LEN,
    SLOT_MAPPING,
    TOKEN_IDS,
    StaticBuffers,
    pick_bucket,
    prepare_decode_inputs,
)
from helios.runner.input_batch import layout_batch, prepare_batch
from helios.runner.model_runner import ModelRunner
from tests.models.test_parity import export_tiny, prompt

PAGE_SIZE = 4
MAX_MODEL_LEN = 64  # the graphed CPU runners': their graphs' static block tables hold 16 pages
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def decode_step(req_id, token, num_computed, blocks):
    return ScheduledRequest(req_id=req_id, token_ids=[token], num_computed_tokens=num_computed, block_ids=blocks,
                            sample=True)


def plan(scheduled, new=()):
    return SchedulerOutput(new_requests=list(new), scheduled=list(scheduled), finished_req_ids=[],
                           num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled))


# --- pure host-side logic ----------------------------------------------------------------------------


def test_pick_bucket():
    buckets = [1, 2, 4, 8, 16, 32]
    assert [pick_bucket(n, buckets) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert pick_bucket(33, buckets) is None


def test_decode_inputs_are_padded_and_match_the_eager_batch():
    scheduled = [decode_step("a", 11, 5, [7, 3]), decode_step("b", 12, 0, [9]), decode_step("c", 13, 8, [1, 2, 4])]
    inputs = prepare_decode_inputs(scheduled, PAGE_SIZE, bucket=8)
    packed = inputs.packed
    assert packed.shape == (4, 8) and packed.dtype == torch.int64
    # padded rows: token 0, position 0, slot -1 (no KV write), seq_len 0 (attention outputs zeros)
    assert packed[:, 3:].tolist() == [[0] * 5, [0] * 5, [-1] * 5, [0] * 5]
    eager = prepare_batch(scheduled, {}, PAGE_SIZE)
    assert packed[TOKEN_IDS, :3].tolist() == eager.token_ids.tolist()
    assert packed[1, :3].tolist() == eager.meta.positions.tolist()
    assert packed[SLOT_MAPPING, :3].tolist() == eager.meta.slot_mapping.tolist()
    assert packed[SEQ_LENS, :3].tolist() == eager.meta.seq_lens.tolist()
    # only the blocks each sequence reads: ceil(seq_len / page_size)
    assert inputs.block_tables.tolist() == [[7, 3, 0], [9, 0, 0], [1, 2, 4]]


def test_eager_block_tables_are_padded_to_16():
    eager = prepare_batch([decode_step("a", 1, 0, [5])], {}, PAGE_SIZE)
    assert eager.meta.block_tables.shape == (1, 16)


def test_static_buffers_load_and_metadata():
    buf = StaticBuffers(max_num_seqs=8, max_blocks=16, vocab_size=10, device=torch.device("cpu"))
    scheduled = [decode_step("a", 11, 5, [7, 3]), decode_step("b", 12, 0, [9])]
    buf.load(prepare_decode_inputs(scheduled, PAGE_SIZE, bucket=4))
    meta = buf.metadata(4, max_model_len=64)
    assert meta.num_seqs == 4 and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4 + 0, -1, -1]  # position 5 sits in block 3
    assert meta.positions.tolist() == [5, 0, 0, 0]
    assert meta.block_tables[:2, :2].tolist() == [[7, 3], [9, 0]]
    # rows start 16-byte aligned (Triton specializes on it); views, not copies
    assert buf.packed.stride(0) % 2 == 0 and meta.slot_mapping.data_ptr() % 16 == 0
    buf.pad_all()
    assert buf.packed[SLOT_MAPPING].eq(-1).all() and buf.packed[TOKEN_IDS].eq(0).all()


def test_each_staging_slot_waits_for_the_event_of_its_own_last_copies(monkeypatch):
    """A slot is reused only after the event recorded behind the copies made from it: with a window group's second
    table too, the event of a load through slot k is slot k's (it once went to the last table's index, so slot 0
    waited for the newest copy, queued behind a speculative step, every fourth step)."""
    made = []

    class FakeEvent:
        def __init__(self):
            self.waited = False
            made.append(self)

        def record(self):
            pass

        def synchronize(self):
            self.waited = True

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    buf = StaticBuffers(max_num_seqs=8, max_blocks=16, vocab_size=10, device=torch.device("cpu"), window=8)
    ring = buf.staging.slots
    ring.is_cuda = True  # events as on CUDA (the slots stay pageable here)
    scheduled = [ScheduledRequest(req_id="a", token_ids=[11], num_computed_tokens=5, block_ids=[7, 3], sample=True,
                                  group_block_ids=[[7, 3]])]
    inputs = prepare_decode_inputs(scheduled, PAGE_SIZE, bucket=1)
    for k in range(len(ring.slots)):
        buf.load(inputs)
        assert ring.events[k] is made[-1] and ring.events[k + 1:] == [None] * (len(ring.slots) - k - 1)
    buf.load(inputs)  # slot 0 again: it waits for its own copy's event, no other
    assert [e.waited for e in made] == [True, False, False, False, False]
    assert buf.window_tables[:1, :2].tolist() == [[7, 3]]


def test_state_slots_are_an_input_row_whose_padding_is_the_scratch_row():
    scratch = 16
    a = ScheduledRequest(req_id="a", token_ids=[11], num_computed_tokens=5, block_ids=[7, 3], sample=True,
                         state_slot=3)
    scheduled = [a, decode_step("b", 12, 0, [9])]  # "b" has no slot (forward_logits' kind): the scratch row
    inputs = prepare_decode_inputs(scheduled, PAGE_SIZE, bucket=4, state_scratch=scratch)
    assert inputs.packed.shape == (5, 4) and inputs.packed[4].tolist() == [3, scratch, scratch, scratch]
    buf = StaticBuffers(max_num_seqs=8, max_blocks=16, vocab_size=10, device=torch.device("cpu"),
                        state_scratch=scratch)
    assert buf.state_row == 4 and buf.packed[4].eq(scratch).all()  # before any load: every row padded
    buf.load(inputs)
    buf.state_slots[:4].copy_(buf.packed[buf.state_row, :4])  # what the captured function does first
    meta = buf.metadata(4, max_model_len=64)
    assert meta.state_slots.dtype == torch.int32 and meta.state_slots.tolist() == [3, scratch, scratch, scratch]
    buf.pad_all()
    assert buf.packed[buf.state_row].eq(scratch).all() and buf.packed[SLOT_MAPPING].eq(-1).all()


def test_recurrent_layers_are_graphed_only_on_their_triton_path(tmp_path):
    from helios.core.load import load_core
    from helios.models import build_model
    from helios.runner.cuda_graphs import unsupported_reason
    from ignition.export import ExportOptions, export_core
    from tests.models.hybrid_tiny import build_hybrid

    core = load_core(export_core(build_hybrid("qwen3_5", tmp_path / "hf"), tmp_path / "core", ExportOptions()))
    arch = core.manifest.arch
    model = build_model(arch, core.tensors)
    cuda = torch.device("cuda")  # a device object only: nothing runs
    assert unsupported_reason(model, arch, cuda).startswith("recurrent layers (GatedDeltaNet)")
    for layer in model.modules():
        if hasattr(layer, "decode_graph_safe"):
            layer.fused = True  # what the Triton backend builds: the decode step reads device-side slots only
    assert "attention backend" in unsupported_reason(model, arch, cuda)  # past the recurrent check


# --- the captured function, run eagerly on the CPU (Triton interpreter) ------------------------------

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    _, core = export_tiny("llama", tmp_path_factory.mktemp("llama-graphs"))
    return core


def test_bucket_for_only_takes_decode_steps_that_fit(core):
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE,
                         max_model_len=MAX_MODEL_LEN)
    graphs = runner.make_graphs([1, 2, 4], capture=False)
    decodes = [decode_step(r, 5, 3, [i]) for i, r in enumerate("abc")]
    assert graphs.bucket_for(decodes, layout_batch(decodes, {}, PAGE_SIZE)) == 4
    five = [decode_step(r, 5, 3, [i]) for i, r in enumerate("abcde")]
    assert graphs.bucket_for(five, layout_batch(five, {}, PAGE_SIZE)) is None  # larger than every bucket
    prefill = [ScheduledRequest(req_id="a", token_ids=[1, 2], num_computed_tokens=0, block_ids=[0], sample=True)]
    assert graphs.bucket_for(prefill, layout_batch(prefill, {}, PAGE_SIZE)) is None
    mixed = [decodes[0], ScheduledRequest(req_id="p", token_ids=[1, 2], num_computed_tokens=0, block_ids=[3], sample=True)]
    assert graphs.bucket_for(mixed, layout_batch(mixed, {}, PAGE_SIZE)) is None
    long = [decode_step("a", 5, 64, list(range(17)))]  # needs 17 blocks; the static table holds 16
    assert graphs.bucket_for(long, layout_batch(long, {}, PAGE_SIZE)) is None


def test_cuda_graphs_are_ignored_on_cpu(core):
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=16, page_size=PAGE_SIZE, cuda_graphs=True)
    assert runner.graphs is None and runner.startup.graphs == "CPU" and runner.startup.num_pages == 16
    assert "start-up" in runner.startup.summary()
    with pytest.raises(ValueError, match="num_pages"):
        ModelRunner(core.manifest.arch, core.tensors, num_pages=None, page_size=PAGE_SIZE)


def test_the_kernel_load_thread_reports_its_summary_and_time_and_reraises(monkeypatch):
    """The precompiled-kernel load runs beside the weights upload (model_runner._KernelLoad): join gives what
    load_kernels gave and how long it took, or raises on the constructing thread what it raised."""
    import contextlib
    import time

    from helios.kernels import aot
    from helios.runner.model_runner import _KernelLoad

    class Loaded:
        def summary(self):
            return "3 precompiled kernels"

    seen = {}

    def slow_load(core_dir, targets, device, manifest, **switches):
        time.sleep(0.05)
        seen.update(switches)
        return Loaded()

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # no GPU here
    monkeypatch.setattr(aot, "load_kernels", slow_load)
    summary, seconds = _KernelLoad("core", [], torch.device("cuda")).join()
    assert summary == "3 precompiled kernels" and seconds >= 0.05
    # the kernels it loads are the ones the process's switches launch (the declared defaults here)
    assert seen == {"gemv": "narrow", "fused_decode": True, "defer_norms": True, "pdl": None,
                    "cache_root": aot.runtime_cache_root(), "trace": None}  # no targets: no decode trace

    def failing_load(core_dir, targets, device, manifest, **switches):
        raise RuntimeError("kernels dir unreadable")

    monkeypatch.setattr(aot, "load_kernels", failing_load)
    with pytest.raises(RuntimeError, match="unreadable"):
        _KernelLoad("core", [], torch.device("cuda")).join()


def test_replay_timer_adds_completed_pairs_oldest_first_and_reuses_events(monkeypatch):
    from helios.runner.cuda_graphs import ReplayTimer

    class FakeEvent:  # a timing event whose completion the test decides (no GPU here)
        made = 0

        def __init__(self, enable_timing):
            assert enable_timing
            FakeEvent.made += 1
            self.done, self.at = False, 0.0

        def record(self):
            self.done, self.at = False, clock[0]

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

        def elapsed_time(self, end):
            return end.at - self.at  # milliseconds

    clock = [0.0]
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    assert not ReplayTimer(torch.device("cpu")).enabled  # off CUDA: nothing recorded
    timer = ReplayTimer(torch.device("cpu"))
    timer.enabled = True
    for ms in (1.5, 2.0):
        with timer.timing():
            clock[0] += ms
    assert timer.poll() == 0 and timer.num_samples == 0  # nothing completed yet: never waited for
    first, second = timer._pending
    second[1].done = True  # completed out of order: the first is still pending, so neither is read
    assert timer.poll() == 0
    first[1].done = True
    assert timer.poll() == 3_500_000 and timer.num_samples == 2
    with timer.timing():
        clock[0] += 0.25
    assert FakeEvent.made == 4  # a completed pair was reused
    timer._pending[0][1].done = True
    assert timer.poll() == 3_750_000


def _greedy_decode(runner: ModelRunner, prompts: dict[str, list[int]], steps: int,
                   between=lambda: None) -> dict[str, list[int]]:
    """One prefill of every prompt, then `steps` decode steps of them all; `between()` runs after each decode step."""
    blocks = {r: list(range(i * 8, i * 8 + 8)) for i, r in enumerate(prompts)}
    new = [NewRequestData(req_id=r, prompt_token_ids=p, sampling=GREEDY) for r, p in prompts.items()]
    first = runner.execute(plan([ScheduledRequest(req_id=r, token_ids=p, num_computed_tokens=0, block_ids=blocks[r], sample=True)
                                 for r, p in prompts.items()], new=new))
    out = {res.req_id: [res.sampled_token_id] for res in first.results}
    for _ in range(steps):
        step = [decode_step(r, out[r][-1], len(p) + len(out[r]) - 1, blocks[r]) for r, p in prompts.items()]
        for res in runner.execute(plan(step)).results:
            out[res.req_id].append(res.sampled_token_id)
        between()
    return out


@needs_interpreter
def test_padded_graph_function_matches_eager_on_cpu(core):
    prompts = {"a": prompt(7, seed=1), "b": prompt(3, seed=2), "c": prompt(11, seed=3)}
    eager = ModelRunner(core.manifest.arch, core.tensors, num_pages=32, page_size=PAGE_SIZE)
    expected = _greedy_decode(eager, prompts, steps=5)
    graphed = ModelRunner(core.manifest.arch, core.tensors, num_pages=32, page_size=PAGE_SIZE,
                          attention_backend="triton", max_model_len=MAX_MODEL_LEN)
    # three sequences replay the bucket of 4 (one padded row)
    graphed.graphs = graphed.make_graphs([1, 2, 4, 8], capture=False)
    assert _greedy_decode(graphed, prompts, steps=5) == expected
    assert graphed.graphs.num_replays == 5


def arrivals_tokens(runner, config, prompts: list[list[int]], sampling: SamplingParams,
                    max_steps: int = 40) -> dict[str, list[int]]:
    """An engine over `runner`, request r<i> arriving at step i while the earlier ones decode; each request's
    tokens when all have finished (or max_steps steps have run)."""
    from helios.engine.engine_core import EngineCore

    engine = EngineCore(config, runner)
    tokens: dict[str, list[int]] = {}
    for step in range(max_steps):
        if step < len(prompts):
            engine.add_request(EngineRequest(req_id=f"r{step}", prompt_token_ids=prompts[step], sampling=sampling))
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        if step >= len(prompts) and not engine.has_unfinished_requests():
            break
    return tokens


@needs_interpreter
def test_mixed_steps_replay_their_decode_rows_beside_an_eager_prefill(core, monkeypatch):
    """Requests arriving while others decode: each mixed step replays the decode rows' bucket and runs only the
    prefill chunks eagerly (runner._split_mixed); every request's greedy tokens are the all-eager runner's."""
    from helios.engine.config import SchedulerConfig
    from helios.runner import model_runner

    monkeypatch.setattr(model_runner, "SPLIT_MIN_DECODE_ROWS", 2)
    config = SchedulerConfig(max_concurrency=8, max_num_batched_tokens=64, prefill_chunk_size=16,
                             page_size=PAGE_SIZE, num_pages=64, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [prompt(5 + 3 * i, seed=i) for i in range(5)]

    def run(runner):  # one arrival per step: from the third step on, every step is mixed
        return arrivals_tokens(runner, config, prompts, greedy)

    expected = run(ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE))
    split = ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE,
                        attention_backend="triton", max_model_len=MAX_MODEL_LEN)
    split.graphs = split.make_graphs([1, 2, 4, 8], capture=False)
    splits = []
    run_split = split._run_split
    monkeypatch.setattr(split, "_run_split", lambda *a, **k: splits.append(len(a[0])) or run_split(*a, **k))
    assert run(split) == expected
    assert len(splits) >= 3 and max(splits) >= 2  # mixed steps replayed their decode rows


def test_lazy_start_buckets_are_the_smallest_and_the_largest():
    from helios.runner.cuda_graphs import lazy_start_buckets

    assert lazy_start_buckets([1, 2, 4, 8, 16, 32]) == [1, 32]
    assert lazy_start_buckets([4]) == [4]


@needs_interpreter
def test_lazy_capture_captures_a_pending_bucket_at_its_first_step_with_the_same_tokens(core):
    """A lazy GraphRunner captures the smallest and largest buckets at once and leaves the rest pending; the first
    step of a pending bucket captures it (one stall, not eager steps until the engine loop gets to it) and replays;
    capture_pending takes the other pending buckets smallest first and says whether any remain. Tokens are the eager
    runner's either way."""
    prompts = {"a": prompt(7, seed=1), "b": prompt(3, seed=2), "c": prompt(11, seed=3)}  # bucket 4
    expected = _greedy_decode(ModelRunner(core.manifest.arch, core.tensors, num_pages=32, page_size=PAGE_SIZE),
                              prompts, steps=4)
    lazy = ModelRunner(core.manifest.arch, core.tensors, num_pages=32, page_size=PAGE_SIZE,
                       attention_backend="triton", decode_overlap=True, max_model_len=MAX_MODEL_LEN)
    assert not lazy.has_pending_captures and lazy.capture_pending() is False  # no graphs on the CPU
    lazy.graphs = graphs = lazy.make_graphs([1, 2, 4, 8], lazy=True, capture=False)
    assert graphs.pending == [2, 4] and lazy.has_pending_captures
    assert [graphs.is_captured(b) for b in (1, 2, 4, 8)] == [True, False, False, True]
    assert _greedy_decode(lazy, prompts, steps=4) == expected
    assert graphs.pending == [2] and graphs.num_eager_runs == 0 and lazy.background_capture_s > 0
    assert lazy.capture_pending() is False and graphs.pending == [] and not lazy.has_pending_captures
    lazy.requests.clear()
    assert _greedy_decode(lazy, prompts, steps=4) == expected
    assert graphs.num_eager_runs == 0 and lazy.num_background_graphs == 0  # nothing recorded without CUDA


def test_capture_pending_refuses_another_thread(core):
    import threading

    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=32, page_size=PAGE_SIZE,
                         max_model_len=MAX_MODEL_LEN)
    runner.graphs = runner.make_graphs([1, 2, 4, 8], capture=False)
    runner.graphs.pending = [2, 4]
    runner._step_thread = threading.get_ident() + 1  # as if execute ran on another thread
    with pytest.raises(RuntimeError, match="thread that runs execute"):
        runner.capture_pending()


@needs_interpreter
def test_norm_free_layers_match_eager_on_cpu(core, monkeypatch):
    """The batch-1 layers without norm kernels (norm weights folded into qkv / gate_up at load, the o / down GEMVs
    adding into the stream and handing on the partial sums of its squares, decode attention and the down GEMV
    scaling by its rstd), run in float32 in the Triton interpreter: the eager runner's greedy tokens, graphed and
    not; their one-row launches take PDL (pdl_scope) unless the pdl switch is off."""
    import helios.kernels.gemv as gemv_module
    from helios.kernels._triton import pdl_allowed
    from helios.models.llama import FUSED, NORM_FREE, DecoderLayer
    from helios.switches import Switches

    arch = core.manifest.arch
    prompts = {"a": prompt(7, seed=1)}
    expected = _greedy_decode(ModelRunner(arch, core.tensors, num_pages=32, page_size=PAGE_SIZE), prompts, steps=5)
    # the GPU's one-row rule, on the CPU: chosen at construction (gemv_available) and asked per call (gemv_serves)
    monkeypatch.setattr(gemv_module, "gemv_available", lambda device, dtype: True)
    monkeypatch.setattr(gemv_module, "gemv_serves", lambda x, weight, mode: x.shape[0] == 1)
    calls = []  # whether the layer's one-row launches may take PDL (pdl_scope: every kernel of the step is ours)
    layer_forward = DecoderLayer.forward_norm_free
    monkeypatch.setattr(DecoderLayer, "forward_norm_free",
                        lambda self, *a: calls.append(pdl_allowed()) or layer_forward(self, *a))
    kw = dict(num_pages=32, page_size=PAGE_SIZE, attention_backend="triton", max_model_len=MAX_MODEL_LEN)
    assert not ModelRunner(arch, core.tensors, **kw).model.norms_folded  # on the CPU only when asked for
    for graphed, switches in ((False, Switches()), (True, Switches()), (False, Switches(pdl=False))):
        runner = ModelRunner(arch, core.tensors, fold_norms=True, switches=switches, **kw)
        assert runner.model.norms_folded and runner.model.path == NORM_FREE
        assert (runner.model.layers[0].attn_norm.weight == 1).all()
        assert not (core.tensors["layers.0.attn_norm.weight"] == 1).all()  # the core's tensors are untouched
        assert runner.startup.weights.startswith("norms folded") and "norm_free" in runner.startup.summary()
        if graphed:
            runner.graphs = runner.make_graphs([1], capture=False)
        calls.clear()
        assert _greedy_decode(runner, prompts, steps=5) == expected
        assert len(calls) == 5 * arch.num_layers and all(c == (switches.pdl is not False) for c in calls)
        assert not pdl_allowed()
        if graphed:
            assert runner.graphs.num_replays == 5
    # defer_norms off: the weights stay as bound, the fused path
    runner = ModelRunner(arch, core.tensors, fold_norms=None, switches=Switches(defer_norms=False), **kw)
    assert not runner.model.norms_folded and runner.model.path == FUSED and runner.startup.weights == "as bound"


def test_pdl_is_scoped_as_the_switch_says():
    """One-row launches take PDL inside pdl_scope (the norm-free step, or every forward with the pdl switch on)
    and never outside one; a scope restores the one before it."""
    from helios.kernels._triton import pdl_allowed, pdl_scope
    from helios.layers.norm_free import pdl_launches

    assert not pdl_allowed()
    with pdl_scope():
        assert pdl_allowed()
        with pdl_scope(False):
            assert not pdl_allowed()
        assert pdl_allowed()
    assert not pdl_allowed()
    with pdl_launches(True):
        assert pdl_allowed()
    with pdl_launches(False):
        assert not pdl_allowed()


def test_the_pdl_switch_scopes_every_familys_steps(tmp_path, monkeypatch):
    """HELIOS_PDL=1 puts a family without its own scope (qwen3_5_moe here) in pdl_scope for its whole forward and
    its logits; unset or off, none of its launches take PDL. The same tokens either way (on the CPU use_pdl says
    no: PDL changes only how a GPU launch waits)."""
    from helios.core.load import load_core
    from helios.kernels._triton import pdl_allowed
    from helios.models.qwen3_5 import Qwen3_5ForCausalLM
    from helios.switches import Switches
    from ignition.export import ExportOptions, export_core
    from tests.models.hybrid_tiny import build_hybrid

    core = load_core(export_core(build_hybrid("qwen3_5_moe", tmp_path / "hf"), tmp_path / "core", ExportOptions()))
    seen = []
    for name in ("forward", "compute_logits"):
        original = getattr(Qwen3_5ForCausalLM, name)
        monkeypatch.setattr(Qwen3_5ForCausalLM, name,
                            lambda self, *a, _f=original, _n=name: seen.append((_n, pdl_allowed())) or _f(self, *a))
    tokens = {}
    for switches in (Switches(), Switches(pdl=True), Switches(pdl=False)):
        runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=64, page_size=PAGE_SIZE,
                             num_state_slots=4, switches=switches)
        seen.clear()
        tokens[switches.pdl] = _greedy_decode(runner, {"a": prompt(7, seed=2)}, steps=3)
        assert {n for n, _ in seen} == {"forward", "compute_logits"}
        assert all(on == (switches.pdl is True) for _, on in seen), (switches.pdl, seen)
        assert not pdl_allowed()
    assert tokens[True] == tokens[None] == tokens[False]


@needs_interpreter
def test_short_steps_take_the_one_split_graph_and_match_eager(core):
    """A long-context graph pins several decode splits; a step whose sequences all have <= SHORT_SEQ_LEN keys
    replays the variant with fewer splits instead. Decoding across that boundary gives the eager runner's tokens."""
    arch = core.manifest.arch
    graphed = ModelRunner(arch, core.tensors, num_pages=160, page_size=PAGE_SIZE, attention_backend="triton",
                          max_model_len=4096)
    graphed.graphs = graphed.make_graphs([1, 2], capture=False)
    graphs = graphed.graphs
    assert graphs.num_splits[1] > 1
    # fewer splits for the short graph (one here: head_dim < 32 decodes through paged_attention, whose splits
    # cost a merge kernel; decode_qkv merges a few inside its launch)
    assert graphs.splits_for(1, SHORT_SEQ_LEN) == graphs.short_splits[1] < graphs.num_splits[1]
    assert graphs.short_splits[1] == (1 if arch.head_dim < 32 else short_decode_splits(1, arch.num_kv_heads))
    assert graphs.splits_for(1, SHORT_SEQ_LEN + 1) == graphs.num_splits[1]
    eager = ModelRunner(arch, core.tensors, num_pages=160, page_size=PAGE_SIZE)
    prompts = {"a": prompt(SHORT_SEQ_LEN - 3, seed=4), "b": prompt(9, seed=5)}
    blocks = {r: list(range(i * 80, i * 80 + 80)) for i, r in enumerate(prompts)}

    def decode(runner):
        new = [NewRequestData(req_id=r, prompt_token_ids=p, sampling=GREEDY) for r, p in prompts.items()]
        first = runner.execute(plan([ScheduledRequest(req_id=r, token_ids=p, num_computed_tokens=0,
                                                      block_ids=blocks[r], sample=True) for r, p in prompts.items()],
                                    new=new))
        out = {res.req_id: [res.sampled_token_id] for res in first.results}
        for _ in range(6):  # "a" crosses SHORT_SEQ_LEN keys on the way
            step = [decode_step(r, out[r][-1], len(p) + len(out[r]) - 1, blocks[r]) for r, p in prompts.items()]
            for res in runner.execute(plan(step)).results:
                out[res.req_id].append(res.sampled_token_id)
        return out

    assert decode(graphed) == decode(eager)
    assert graphs.num_replays == 6


# --- real graphs on CUDA -----------------------------------------------------------------------------

def gpu(fn):
    for mark in (
        pytest.mark.skipif(not HAS_TRITON or interpret_mode(), reason="needs compiled Triton"),
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        pytest.mark.gpu,
    ):
        fn = mark(fn)
    return fn


@pytest.fixture(scope="module")
def cuda_runners(core):
    kw = dict(num_pages=256, page_size=16, device="cuda", dtype=torch.float32, max_model_len=256)
    eager = ModelRunner(core.manifest.arch, core.tensors, cuda_graphs=False, **kw)
    graphed = ModelRunner(core.manifest.arch, core.tensors, cuda_graphs=True, **kw)
    return eager, graphed


@gpu
@pytest.mark.parametrize("batch", [1, 3, 8, 17, 64])
def test_graph_replay_logits_match_eager(cuda_runners, batch):
    eager, graphed = cuda_runners
    assert graphed.graphs is not None and graphed.startup.num_graphs > 0
    # seq i has 5 + 3i tokens in its cache (written by one eager prefill through the graphed runner)
    scheduled, decodes = [], []
    for i in range(batch):
        ids = prompt(5 + 3 * (i % 7), seed=i)
        blocks = list(range(i * 2, i * 2 + 2))
        scheduled.append(ScheduledRequest(req_id=f"r{i}", token_ids=ids, num_computed_tokens=0, block_ids=blocks,
                                          sample=False))
        decodes.append(decode_step(f"r{i}", 7 + i, len(ids), blocks))
    for runner in (eager, graphed):
        runner.execute(plan(scheduled, new=[NewRequestData(req_id=s.req_id, prompt_token_ids=s.token_ids,
                                                           sampling=GREEDY) for s in scheduled]))
    layout = layout_batch(decodes, {}, 16)
    bucket = graphed.graphs.bucket_for(decodes, layout)
    assert bucket is not None and bucket >= batch
    with torch.inference_mode():
        replayed = graphed.graphs.run(decodes, layout, bucket).clone()
        batch_eager = prepare_batch(decodes, {}, 16, "cuda")
        hidden = eager.model.forward(batch_eager.token_ids, batch_eager.meta, eager.kv_cache.layers)
        reference = eager.model.compute_logits(hidden).float()
    torch.testing.assert_close(replayed, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(replayed.argmax(-1), reference.argmax(-1))
    for runner in (eager, graphed):
        runner.requests.clear()


@gpu
def test_greedy_outputs_identical_with_graphs(core):
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore
    from tests.models.engine_harness import run, tokens

    def engine(cuda_graphs: bool) -> EngineCore:
        # float32: the graph pins 2 decode splits (sized for 512 keys) where eager uses 1, so only the
        # summation order differs; bf16 rounding could flip a near-tie of this random model
        runner = ModelRunner(core.manifest.arch, core.tensors, 128, 16, device="cuda", dtype=torch.float32,
                             cuda_graphs=cuda_graphs, max_model_len=512)
        config = SchedulerConfig(max_concurrency=16, max_num_batched_tokens=512, prefill_chunk_size=512,
                                 page_size=16, num_pages=128, max_model_len=512)
        return EngineCore(config, runner)

    requests = [EngineRequest(req_id=f"r{i}", prompt_token_ids=prompt(4 + 5 * i, seed=i),
                              sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                for i in range(6)]
    eager = {k: tokens(v) for k, v in run(engine(False), requests).items()}
    graphed_engine = engine(True)
    graphed = {k: tokens(v) for k, v in run(graphed_engine, requests).items()}
    graphs = graphed_engine.runner.graphs
    assert graphs.num_replays > 0
    assert graphed == eager
    # every replay of the run was timed and read (each step's tokens were read before the next step)
    assert graphs.timer.num_samples == graphs.num_replays and graphed_engine.runner.replay_gpu_ns > 0


@gpu
def test_lazy_capture_gives_the_logits_and_tokens_of_full_capture(core):
    """A lazily capturing runner (helios serve's start-up) captures the smallest and largest buckets; a step of a
    pending bucket run directly (GraphRunner.run) runs the function its graph captures, eagerly: bit for bit the fully
    captured runner's replay, before capture_pending has captured the bucket and after. Captures between engine
    steps and at a pending bucket's first step keep the fully captured engine's greedy tokens, in bf16."""
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore
    from tests.models.engine_harness import run, tokens

    arch = core.manifest.arch
    kw = dict(num_pages=256, page_size=16, device="cuda", dtype=torch.bfloat16, max_model_len=256)
    full = ModelRunner(arch, core.tensors, **kw)
    lazy = ModelRunner(arch, core.tensors, lazy_capture=True, **kw)
    buckets = full.graphs.buckets
    assert full.graphs.pending == [] and lazy.graphs.pending == buckets[1:-1]
    assert lazy.startup.num_pending == len(buckets) - 2 and "pending" in lazy.startup.summary()
    assert 0 < lazy.startup.num_graphs < full.startup.num_graphs
    scheduled, decodes = [], []
    for i in range(3):  # bucket 4: pending
        ids = prompt(5 + 3 * i, seed=i)
        blocks = [i * 2, i * 2 + 1]
        scheduled.append(ScheduledRequest(req_id=f"r{i}", token_ids=ids, num_computed_tokens=0, block_ids=blocks,
                                          sample=False))
        decodes.append(decode_step(f"r{i}", 7 + i, len(ids), blocks))
    for runner in (full, lazy):
        runner.execute(plan(scheduled, new=[NewRequestData(req_id=s.req_id, prompt_token_ids=s.token_ids,
                                                           sampling=GREEDY) for s in scheduled]))
    layout = layout_batch(decodes, {}, 16)
    bucket = full.graphs.bucket_for(decodes, layout)
    assert bucket == 4 and not lazy.graphs.is_captured(bucket)
    with torch.inference_mode():
        reference = full.graphs.run(decodes, layout, bucket).clone()
        pending = lazy.graphs.run(decodes, layout, bucket).clone()  # rewrites the same KV slots with the same values
        assert lazy.graphs.num_eager_runs == 1 and lazy.graphs.num_replays == 0
        remaining = [lazy.capture_pending() for _ in buckets[1:-1]]
        captured = lazy.graphs.run(decodes, layout, bucket).clone()
    # the decode buckets go first; the prompt buckets (prompt_graphs.py, pending in both runners: captured between
    # steps only) come after them
    prompt_pending = lazy.prompt_graphs is not None and bool(lazy.prompt_graphs.pending)
    assert remaining == [True] * (len(buckets) - 3) + [prompt_pending] and lazy.graphs.pending == []
    assert lazy.graphs.num_replays == 1
    assert torch.equal(pending, reference) and torch.equal(captured, reference)
    assert lazy.startup.num_graphs + lazy.num_background_graphs == full.startup.num_graphs
    assert lazy.background_capture_s > 0
    del full, lazy

    def engine(lazy_capture: bool) -> EngineCore:
        runner = ModelRunner(arch, core.tensors, 128, 16, device="cuda", dtype=torch.bfloat16, max_model_len=512,
                             lazy_capture=lazy_capture)
        config = SchedulerConfig(max_concurrency=16, max_num_batched_tokens=512, prefill_chunk_size=512,
                                 page_size=16, num_pages=128, max_model_len=512)
        return EngineCore(config, runner)

    # finishing one by one, the batch walks down through buckets 8, 4, 2 and 1 while they are being captured
    requests = [EngineRequest(req_id=f"r{i}", prompt_token_ids=prompt(4 + 5 * i, seed=i),
                              sampling=SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True))
                for i in range(6)]
    expected = {k: tokens(v) for k, v in run(engine(False), requests).items()}
    lazy_engine = engine(True)
    outs = {r.req_id: [] for r in requests}
    for r in requests:
        lazy_engine.add_request(r)
    while lazy_engine.has_unfinished_requests():
        for o in lazy_engine.step():
            outs[o.req_id].append(o)
        lazy_engine.runner.capture_pending()  # at most one bucket between two steps, as the engine loop does
    assert {k: tokens(v) for k, v in outs.items()} == expected
    runner = lazy_engine.runner
    # a step whose bucket was still pending captured it first (execute): no eager runs of a graphed bucket
    assert runner.graphs.num_eager_runs == 0 and runner.graphs.num_replays > 0


@gpu
def test_kv_pool_sized_from_free_memory(core):
    runner = ModelRunner(core.manifest.arch, core.tensors, None, 16, device="cuda", dtype=torch.bfloat16,
                         max_model_len=512, gpu_memory_fraction=0.05)
    assert runner.num_pages > 0 and runner.startup.num_pages == runner.num_pages
    assert runner.startup.capture_s > 0 and runner.startup.num_graphs > 0


@gpu
@pytest.mark.parametrize("mode, defer", [("all", "0"), ("narrow", "0"), ("nowide", "0"), ("narrow", "1"), ("all", "1")])
def test_one_row_gemv_path_matches_cublas_in_the_model(core, monkeypatch, mode, defer):
    """bf16 batch-1 decode graph with HELIOS_GEMV=all (norms and the activation folded into the GEMVs), narrow or
    nowide (the attention norm folded into qkv, the MLP's gate_up on cuBLAS), or the norm-free layers
    (HELIOS_DEFER_NORMS=1: norm weights folded into qkv / gate_up, no norm kernel) against the same step on cuBLAS
    with the norm kernels and the weights as bound (HELIOS_GEMV=0, HELIOS_DEFER_NORMS=0): logits within bf16
    rounding, same argmax."""
    from helios.models.llama import NORM_FREE
    from helios.switches import Switches

    kw = dict(num_pages=64, page_size=16, device="cuda", dtype=torch.bfloat16, max_model_len=256)
    logits = {}
    for env, deferred in (("0", "0"), (mode, defer)):
        switches = Switches.from_environ({"HELIOS_GEMV": env, "HELIOS_DEFER_NORMS": deferred})
        runner = ModelRunner(core.manifest.arch, core.tensors, cuda_graphs=True, switches=switches, **kw)
        assert runner.model.norms_folded == (deferred == "1") and (runner.model.path == NORM_FREE) == (deferred == "1")
        ids = prompt(19, seed=3)
        runner.execute(plan([ScheduledRequest(req_id="r", token_ids=ids, num_computed_tokens=0, block_ids=[0, 1],
                                              sample=False)],
                            new=[NewRequestData(req_id="r", prompt_token_ids=ids, sampling=GREEDY)]))
        step = [decode_step("r", 11, len(ids), [0, 1])]
        layout = layout_batch(step, {}, 16)
        with torch.inference_mode():
            logits[env] = runner.graphs.run(step, layout, runner.graphs.bucket_for(step, layout)).clone()
        del runner
    if defer == "1":
        # every qkv / gate_up weight is rounded once more (times its norm weight): another bf16 path, as far from
        # the reference as bf16 is from float32 (~1e-2 of the logits' norm), not within an element's rounding
        err = (logits[mode] - logits["0"]).norm() / logits["0"].norm()
        assert err < 3e-2, f"norm-free logits {err:.2e} of the norm away from the reference"
    else:
        torch.testing.assert_close(logits[mode], logits["0"], rtol=3e-2, atol=3e-2)
    assert torch.equal(logits[mode].argmax(-1), logits["0"].argmax(-1))


def test_a_recording_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    """A collection inside a capture may reset another runner's graphs, which invalidates the capture (qwen3_next's
    GPU test, session 28): cuda_graphs.recording keeps the cyclic collector off while torch.cuda.graph records,
    and gives it back as it found it, after an error too. torch.cuda.graph is faked: no GPU here."""
    import contextlib
    import gc

    from helios.runner import cuda_graphs

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None):
        seen.append(("enter", gc.isenabled(), graph, pool))
        yield
        seen.append(("exit", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with cuda_graphs.recording("g", "p"):
        seen.append(("body", gc.isenabled()))
    assert seen == [("enter", False, "g", "p"), ("body", False), ("exit", False)] and gc.isenabled()
    with pytest.raises(ValueError), cuda_graphs.recording("g", "p"):
        raise ValueError("a launch the capture refused")
    assert gc.isenabled()
    gc.disable()
    try:
        with cuda_graphs.recording("g", "p"):
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
