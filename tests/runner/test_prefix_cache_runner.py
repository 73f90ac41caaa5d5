"""Prefix caching through the real runner: a new request whose first chunk starts after cached pages
(positions, slot mapping, attention over pages another request wrote, penalties over the whole prompt) gives
exactly the tokens it gives with the cache off. On the default SmolLM2 core (torch attention, CPU), on a tiny
llama through the Triton kernels (interpreter) and the decode-graph path with the speculative next step, and on
a tiny gemma3 with a sliding window; the gpu-marked test repeats the llama case with captured graphs on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineRequest, SamplingParams, SchedulerOutput
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.model_runner import ModelRunner
from tests.models.engine_harness import greedy, make_engine, run, tokens
from tests.models.test_parity import export_tiny, prompt

TEXT = (
    "The Roman Empire was the post-Republican state of ancient Rome. It is generally understood to mean the "
    "period and territory ruled by the Romans following Octavian's assumption of sole rule under the Principate "
    "in 27 BC. It included territories in Europe, North Africa, and Western Asia, and was ruled by emperors. The "
    "fall of the Western Roman Empire in 476 AD conventionally marks the end of classical antiquity and the "
    "beginning of the Middle Ages. Summarize this in one sentence:"
)
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.3, frequency_penalty=0.4)


class Recorder:
    """The runner, with every plan kept (to see where each request's first chunk started)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.plans: list[SchedulerOutput] = []

    def execute(self, plan: SchedulerOutput):
        self.plans.append(plan)
        return self.runner.execute(plan)

    def first_chunk(self, req_id: str):
        return next(s for p in self.plans for s in p.scheduled if s.req_id == req_id)


def run_in_waves(engine: EngineCore, waves: list[list[EngineRequest]]) -> dict[str, tuple[list[int], int, list]]:
    """Each wave runs to completion before the next one starts (so it finds the earlier waves' pages cached).
    Returns {req_id: (token ids, num_cached_tokens, chosen-token logprobs)}."""
    got = {}
    for wave in waves:
        for req_id, outs in run(engine, wave).items():
            logprobs = [e.token.logprob for o in outs for e in (o.logprobs or [])]
            got[req_id] = (tokens(outs), outs[-1].num_cached_tokens, logprobs)
    return got


def assert_same_tokens(on: dict, off: dict) -> None:
    for req_id, (ids, _, logprobs) in off.items():
        assert on[req_id][0] == ids, req_id
        for a, b in zip(on[req_id][2], logprobs):
            assert abs(a - b) < 1e-4, req_id


# --- the default core, torch attention ------------------------------------------------------------


def test_smollm2_reuses_cached_pages_with_identical_tokens(default_core_path):
    from tokenizers import Tokenizer

    core = load_core(default_core_path)
    ids = Tokenizer.from_file(str(core.tokenizer_path)).encode(TEXT).ids
    assert len(ids) == 100  # 6 full pages of 16 can be reused, the 7th page is recomputed
    diverging = ids[:70] + Tokenizer.from_file(str(core.tokenizer_path)).encode(" Tell me a joke instead.").ids
    waves = [
        [EngineRequest(req_id="a", prompt_token_ids=ids, sampling=greedy(12, logprobs=1))],
        [EngineRequest(req_id="b", prompt_token_ids=ids, sampling=greedy(12, logprobs=1))],
        [EngineRequest(req_id="c", prompt_token_ids=diverging, sampling=greedy(12)),
         EngineRequest(req_id="d", prompt_token_ids=ids, sampling=greedy(12, **PENALTIES))],
    ]
    off = run_in_waves(make_engine(core, num_pages=64, enable_prefix_caching=False), waves)
    engine = make_engine(core, num_pages=64)
    engine.runner = recorder = Recorder(engine.runner)
    on = run_in_waves(engine, waves)
    assert_same_tokens(on, off)
    assert {k: v[1] for k, v in on.items()} == {"a": 0, "b": 96, "c": 64, "d": 96}
    assert {v[1] for v in off.values()} == {0}
    assert on["b"][0] == on["a"][0]
    chunk = recorder.first_chunk("b")
    assert (chunk.num_computed_tokens, chunk.token_ids) == (96, ids[96:])
    m = engine.metrics()
    assert m.reused_tokens == 96 + 64 + 96 and m.prefill_tokens == 3 * 100 + len(diverging) - m.reused_tokens
    assert m.cached_pages > 0 and m.free_pages == m.total_pages


# --- tiny models: the Triton path with decode graphs, and a sliding window -----------------------

PAGE_SIZE = 4
NUM_PAGES = 48
MAX_MODEL_LEN = 64
needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return export_tiny("llama", tmp_path_factory.mktemp("llama-prefix"))[1]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return export_tiny("gemma3", tmp_path_factory.mktemp("gemma3-prefix"), sliding_window=4)[1]


def tiny_engine(core, enable_prefix_caching: bool, graphed: bool, device: str = "cpu") -> EngineCore:
    backend = "triton" if graphed else "torch"
    runner = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE_SIZE, device=device,
                         dtype=torch.float32, attention_backend=backend, max_model_len=MAX_MODEL_LEN,
                         decode_overlap=graphed)
    if graphed and device == "cpu":  # the captured function run eagerly: the graph path without CUDA
        runner.graphs = runner.make_graphs([1, 2, 4], capture=False)
    config = SchedulerConfig(max_concurrency=4, max_num_batched_tokens=64, prefill_chunk_size=64,
                             page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN,
                             enable_prefix_caching=enable_prefix_caching)
    return EngineCore(config, Recorder(runner))


def tiny_waves() -> list[list[EngineRequest]]:
    base = prompt(13, seed=3)

    def req(req_id, ids, n=8, **sampling):
        return EngineRequest(req_id=req_id, prompt_token_ids=ids, sampling=greedy(n, **sampling))

    return [
        [req("a", base)],
        # b alone: 12 tokens cached, so its first step is one token, a graphed decode step for a new request
        [req("b", base)],
        # c diverges inside page 3; d carries penalties over a mostly cached prompt; one mixed batch
        [req("c", base[:9] + prompt(5, seed=4)), req("d", base + prompt(3, seed=5), **PENALTIES),
         req("e", base, n=12, logprobs=2)],
    ]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_models_give_the_same_tokens_with_and_without_the_cache(family, request):
    graphed = family == "llama"  # llama: Triton kernels + decode graphs; gemma3: torch with a sliding window
    if graphed and not (HAS_TRITON and interpret_mode()):
        pytest.skip("needs the Triton interpreter")
    core = request.getfixturevalue(family)
    waves = tiny_waves()
    off = run_in_waves(tiny_engine(core, False, graphed), waves)
    engine = tiny_engine(core, True, graphed)
    on = run_in_waves(engine, waves)
    assert_same_tokens(on, off)
    assert {k: v[1] for k, v in on.items()} == {"a": 0, "b": 12, "c": 8, "d": 12, "e": 12}
    chunk = engine.runner.first_chunk("b")
    assert chunk.num_computed_tokens == 12 and len(chunk.token_ids) == 1
    if graphed:
        assert engine.runner.runner.overlap_hits > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or interpret_mode(), reason="needs CUDA")
def test_same_tokens_with_real_graphs_on_cuda(llama):
    waves = tiny_waves()
    off = run_in_waves(tiny_engine(llama, False, True, "cuda"), waves)
    engine = tiny_engine(llama, True, True, "cuda")
    on = run_in_waves(engine, waves)
    assert_same_tokens(on, off)
    assert {k: v[1] for k, v in on.items()} == {"a": 0, "b": 12, "c": 8, "d": 12, "e": 12}
    assert engine.runner.runner.graphs is not None and engine.runner.runner.overlap_hits > 0
