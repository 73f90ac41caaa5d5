"""The speculative next decode step (runner/decode_overlap.py): the same tokens with and without it.

EngineCore drives a tiny llama on the CPU through a GraphRunner(capture=False) (the captured function run
eagerly, Triton attention in the interpreter), once with decode_overlap on and once off; every scenario must
give identical token ids, finish reasons and logprobs, while the runner counts used and dropped speculations.
The gpu-marked test does the same with captured graphs, pinned copies and events on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineRequest, NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.switches import Switches
from helios.runner.cuda_graphs import prepare_decode_inputs
from helios.runner.model_runner import ModelRunner
from tests.models.engine_harness import run, tokens
from tests.models.test_parity import export_tiny, prompt

PAGE_SIZE = 4
NUM_PAGES = 48
MAX_MODEL_LEN = 64

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    _, core = export_tiny("llama", tmp_path_factory.mktemp("llama-overlap"))
    return core


def graphed_runner(core, decode_overlap: bool, buckets: tuple[int, ...] = (1, 2, 4)) -> ModelRunner:
    runner = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE_SIZE, attention_backend="triton",
                         max_model_len=MAX_MODEL_LEN, decode_overlap=decode_overlap)
    runner.graphs = runner.make_graphs(list(buckets), capture=False)
    return runner


def grammar_owner(core):
    """Structured output's constraint owner over the core's vocabulary, and its compiler (one per core)."""
    from helios.frontend.constraints import GrammarConstraints
    from helios.frontend.grammar import OutputCompiler

    compiler = OutputCompiler(lambda: core.tokenizer_path.read_text(), core.manifest.arch.vocab_size,
                              core.manifest.tokenizer.eos_token_ids)
    return GrammarConstraints(compiler.matcher), compiler


def drive(core, decode_overlap: bool, requests: list[EngineRequest], events=None, max_concurrency: int = 4,
          buckets: tuple[int, ...] = (1, 2, 4)) -> tuple[dict, ModelRunner]:
    """Step an engine until it is idle; events: {step: [EngineRequest to add, or a req_id to abort]}.
    Returns {req_id: (token ids, finish reason, logprobs)} and the runner."""
    events = events or {}
    runner = graphed_runner(core, decode_overlap, buckets)
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=64, prefill_chunk_size=64,
                             page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN)
    engine = EngineCore(config, runner, constraints=grammar_owner(core)[0])
    outs: dict[str, list] = {}
    for r in requests:
        engine.add_request(r)
    step = 0
    while engine.has_unfinished_requests() or step in events:
        for event in events.get(step, []):
            if isinstance(event, EngineRequest):
                engine.add_request(event)
            else:
                terminal = engine.abort(event)
                outs.setdefault(event, []).append(terminal)
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o)
        step += 1
    assert engine.error is None
    result = {}
    for req_id, os_ in outs.items():
        os_ = [o for o in os_ if o is not None]
        lps = [lp for o in os_ for lp in (o.logprobs or [])]
        result[req_id] = ([t for o in os_ for t in o.new_token_ids], os_[-1].finish_reason, lps)
    return result, runner


def same_with_and_without(core, requests, events=None, **options) -> ModelRunner:
    """Asserts identical outputs with overlap off and on (options: drive's); returns the overlapped runner."""
    off, off_runner = drive(core, False, requests, events, **options)
    on, on_runner = drive(core, True, requests, events, **options)
    assert on == off
    assert off_runner.overlap_hits == off_runner.overlap_misses == 0
    return on_runner


def req(req_id: str, n: int, max_tokens: int, prompt_seed: int = 0, **sampling) -> EngineRequest:
    """A request with an n-token random prompt; greedy unless `sampling` says otherwise."""
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **sampling})
    return EngineRequest(req_id=req_id, prompt_token_ids=prompt(n, seed=prompt_seed), sampling=params)


@needs_interpreter
def test_one_request_uses_its_speculations(core):
    # 5 prompt tokens, 10 outputs over 4-token pages: decodes at positions 5..13; the speculation is skipped
    # where the next position opens a block the request does not hold yet (7, 11)
    runner = same_with_and_without(core, [req("a", 5, 10, prompt_seed=1)])
    assert runner.overlap_hits >= 5
    assert runner.overlap_misses == 0  # nothing is speculated past max_tokens


@needs_interpreter
def test_requests_finishing_at_different_steps(core):
    # prompt lengths equal mod the page size, so the batch crosses page boundaries together and speculates
    requests = [req("a", 5, 3, prompt_seed=1), req("b", 9, 8, prompt_seed=2), req("c", 13, 12, prompt_seed=3)]
    runner = same_with_and_without(core, requests)
    # a step where a request samples its last token is not speculated: the smaller batch after it never misses
    assert runner.overlap_hits > 0 and runner.overlap_misses == 0


@needs_interpreter
def test_request_arriving_mid_decode(core):
    late = req("late", 7, 5, prompt_seed=4)
    runner = same_with_and_without(core, [req("a", 6, 10, prompt_seed=1)], events={4: [late]})
    assert runner.overlap_hits > 0 and runner.overlap_misses >= 1  # the late prefill is another step


@needs_interpreter
def test_a_mixed_step_takes_its_decode_rows_from_the_speculation(core):
    """Eight requests decoding (a split mixed step needs eight decode rows) and one arriving mid-decode: the mixed
    step its prompt makes runs the prompt eagerly and reads the decode rows' logits from the speculative step the
    step before launched (a hit, not a miss and a second run of those rows); the same tokens as without overlap."""
    from helios.runner.model_runner import SPLIT_MIN_DECODE_ROWS

    decoding = [req(f"d{i}", 5, 8, prompt_seed=10 + i) for i in range(SPLIT_MIN_DECODE_ROWS)]
    late = req("late", 7, 4, prompt_seed=4)
    runner = same_with_and_without(core, decoding, events={3: [late]}, max_concurrency=9, buckets=(1, 2, 4, 8, 16))
    assert runner.launches["eager"] >= 2  # the first prompts, then the late one beside the decodes
    assert runner.overlap_hits > 0 and runner.overlap_misses == 0


@needs_interpreter
def test_abort_mid_decode(core):
    requests = [req("a", 5, 12, prompt_seed=1), req("b", 9, 12, prompt_seed=2)]
    runner = same_with_and_without(core, requests, events={5: ["a"]})
    assert runner.overlap_hits > 0


@needs_interpreter
def test_logprobs_request_mixed_in(core):
    # a request that wants logprobs turns speculation off for the steps it is in; the others still match
    requests = [req("a", 5, 8, prompt_seed=1), req("lp", 5, 3, prompt_seed=2, logprobs=3)]
    runner = same_with_and_without(core, requests)
    assert runner.overlap_hits > 0  # after "lp" finishes


@needs_interpreter
def test_seeded_sampling(core):
    requests = [req("s1", 5, 10, prompt_seed=1, temperature=0.9, top_p=0.9, top_k=40, seed=11),
                req("s2", 9, 7, prompt_seed=2, temperature=1.2, repetition_penalty=1.3, seed=12),
                req("g", 1, 9, prompt_seed=3)]
    runner = same_with_and_without(core, requests)
    assert runner.overlap_hits > 0


@needs_interpreter
def test_a_plan_other_than_the_speculated_step_is_a_miss(core):
    """Hand-built plans: a different token, a different position, another load of the static buffers in
    between; each recomputed correctly."""
    def steps(runner):
        ids = prompt(5, seed=1)
        blocks = [3, 9, 4]
        new = NewRequestData(req_id="a", prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0))
        first = ScheduledRequest(req_id="a", token_ids=ids, num_computed_tokens=0, block_ids=blocks, sample=True)
        out = [runner.execute(plan([first], [new])).results[0].sampled_token_id]

        def decode(token, position):
            s = ScheduledRequest(req_id="a", token_ids=[token], num_computed_tokens=position, block_ids=blocks,
                                 sample=True)
            out.append(runner.execute(plan([s])).results[0].sampled_token_id)

        decode(out[-1], 5)  # speculates position 6 with the sampled token
        decode(out[-1] + 1, 6)  # another token: miss
        decode(out[-1], 7)  # hit
        decode(out[-1], 8)  # hit (position 8 opens the third block, which the plan already holds)
        decode(out[-1], 8)  # position 8 again (a rewrite of the same slot): miss
        # someone else loads the static buffers (a benchmark's replay): the speculated logits are gone
        runner.graphs.buffers.load(prepare_decode_inputs([first_decode(9)], PAGE_SIZE, 1))
        decode(out[-1], 9)  # miss
        return out

    def first_decode(position):
        return ScheduledRequest(req_id="x", token_ids=[7], num_computed_tokens=position, block_ids=[40, 41, 42],
                                sample=True)

    off, on = graphed_runner(core, False), graphed_runner(core, True)
    assert steps(on) == steps(off)
    assert (on.overlap_hits, on.overlap_misses) == (2, 3)


def test_a_plan_with_another_page_where_the_step_read_is_a_miss():
    """Speculation.matches compares the table entries step n+1 read (blocks_needed of it), not the table's
    object: a plan's own copy with a page more matches, one with another page among those entries at the same
    table length does not, nor does one too short to hold position p+1's page."""
    from helios.runner.decode_overlap import Speculation, next_step

    launched = ScheduledRequest(req_id="a", token_ids=[5], num_computed_tokens=7, block_ids=[3, 9, 4], sample=True)
    spec = Speculation(bucket=1, steps=next_step([launched]), token_ids=[11], page_size=PAGE_SIZE, num_loads=1)

    def step(blocks):  # position 8 opens the third page: step n+1 read pages 3, 9, 4
        return plan([ScheduledRequest(req_id="a", token_ids=[11], num_computed_tokens=8, block_ids=blocks,
                                      sample=True)])

    assert spec.matches(step([3, 9, 4]), 1, 1) and spec.matches(step([3, 9, 4, 6]), 1, 1)
    assert not spec.matches(step([3, 9, 5]), 1, 1) and not spec.matches(step([3, 8, 4]), 1, 1)
    assert not spec.matches(step([3, 9]), 1, 1) and not spec.matches(step([3, 9, 5, 6]), 1, 1)


def test_switch(core):
    args = (core.manifest.arch, core.tensors, 8, PAGE_SIZE)
    assert ModelRunner(*args).decode_overlap is False  # CPU: off unless asked for
    assert ModelRunner(*args, decode_overlap=True).decode_overlap is True
    off = Switches.from_environ({"HELIOS_DECODE_OVERLAP": "0"})
    assert ModelRunner(*args, decode_overlap=True, switches=off).decode_overlap is False


def plan(scheduled, new=()):
    return SchedulerOutput(new_requests=list(new), scheduled=list(scheduled), finished_req_ids=[],
                           num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or interpret_mode(), reason="needs CUDA")
def test_identical_outputs_with_real_graphs(core):
    def engine(decode_overlap: bool) -> EngineCore:
        runner = ModelRunner(core.manifest.arch, core.tensors, 128, 16, device="cuda", dtype=torch.float32,
                             max_model_len=512, decode_overlap=decode_overlap)
        config = SchedulerConfig(max_concurrency=8, max_num_batched_tokens=512, prefill_chunk_size=512,
                                 page_size=16, num_pages=128, max_model_len=512)
        return EngineCore(config, runner, constraints=grammar_owner(core)[0])

    requests = [req(f"g{i}", 4 + 5 * i, 20 + 7 * i, prompt_seed=i) for i in range(4)]
    requests += [req("s", 9, 40, prompt_seed=9, temperature=0.8, top_p=0.95, seed=5),
                 req("lp", 6, 12, prompt_seed=7, logprobs=2)]

    def outputs(decode_overlap: bool):
        eng = engine(decode_overlap)
        outs = run(eng, requests + constrained_batch(core)[1:])  # structured output beside them
        return {k: (tokens(v), v[-1].finish_reason) for k, v in outs.items()}, eng.runner

    off, _ = outputs(False)
    on, runner = outputs(True)
    assert on == off
    assert runner.graphs is not None and runner.overlap_hits > 0
    check_constrained(core, {k: (ids, finish, None) for k, (ids, finish) in on.items()})


def constrained(core, req_id: str, n: int, regex: str, prompt_seed: int = 0, **sampling) -> EngineRequest:
    """A request whose output must match `regex` (structured output); ends at EOS."""
    from helios.engine.messages import ConstraintSpec

    eos = core.manifest.tokenizer.eos_token_ids
    compiler = grammar_owner(core)[1]
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "eos_token_ids": tuple(eos), **sampling})
    return EngineRequest(req_id=req_id, prompt_token_ids=prompt(n, seed=prompt_seed), sampling=params,
                         constraint=ConstraintSpec(grammar=compiler.compile("regex", regex)))


def constrained_batch(core) -> list[EngineRequest]:
    return [req("a", 5, 10, prompt_seed=1),
            constrained(core, "json-c", 9, "[a-z]{5}", prompt_seed=2),
            constrained(core, "json-s", 5, "(yes|no)!", prompt_seed=3, temperature=0.9, seed=4)]


def check_constrained(core, outs) -> None:
    import re

    from helios.frontend.tokenizer import Tokenizer

    tok = Tokenizer.from_file(core.tokenizer_path, core.manifest.tokenizer, core.manifest.arch.vocab_size)
    for req_id, regex in (("json-c", "[a-z]{5}"), ("json-s", "(yes|no)!")):
        ids, finish, _ = outs[req_id]
        assert finish == "stop" and ids[-1] in core.manifest.tokenizer.eos_token_ids, (req_id, ids)
        assert re.fullmatch(regex, tok.decode(ids[:-1])), (req_id, tok.decode(ids[:-1]))


@needs_interpreter
def test_constrained_requests_mixed_in(core):
    # a token mask is applied at sampling, after the (speculated) forward: the same tokens either way
    off, _ = drive(core, False, constrained_batch(core))
    on, runner = drive(core, True, constrained_batch(core))
    assert on == off
    check_constrained(core, on)
    assert runner.overlap_hits > 0
