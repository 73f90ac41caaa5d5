"""Window page groups on the GPU (helios/engine/kv_groups.py): tiny gemma3 (a sliding and a full layer, window 4)
exported in float32 and bfloat16, run by the CUDA runner (Triton attention, decode graphs captured with the window
group's own tables and slots, the speculative next step) through the engine that returns the pages before the
window: greedy tokens = HF generate on the GPU in float32, = the one-group CUDA engine's in both dtypes (logprobs
too), and the window pool holds at most each request's window between steps."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.engine.messages import EngineRequest, SamplingParams
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.model_runner import ModelRunner
from tests.ignition.tiny_models import build_tiny
from tests.models.test_parity import FAMILIES, prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

PAGE, NUM_PAGES, MAX_MODEL_LEN, CHUNK = 4, 96, 128, 16
WINDOW = FAMILIES["gemma3"]["sliding_window"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from ignition.export import ExportOptions, export_core

    root = tmp_path_factory.mktemp("gemma3")
    src = build_tiny("gemma3", root / "hf", **FAMILIES["gemma3"])
    return src, {name: load_core(export_core(src, root / name, ExportOptions(dtype=name))) for name in DTYPES}


def cuda_engine(core, window: bool, max_concurrency: int = 4) -> EngineCore:
    window_pages = max_concurrency * window_pages_per_request(WINDOW, PAGE, CHUNK) if window else 0
    groups = dict(sliding_window=WINDOW, window_pages=window_pages) if window else {}
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=64, prefill_chunk_size=CHUNK,
                             page_size=PAGE, num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN, **groups)
    runner = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE, device="cuda",
                         max_model_len=MAX_MODEL_LEN, window_pages=window_pages, lazy_capture=True)
    assert runner.graphs is not None, runner.startup.graphs
    return EngineCore(config, runner)


def generate(engine: EngineCore, requests: list[EngineRequest], window: bool) -> dict[str, tuple]:
    outs: dict[str, list] = {r.req_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    bound = -(-WINDOW // PAGE) + 1
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.req_id].append(o)
        if window:
            assert engine.scheduler.window_groups[0].pool.num_used_blocks <= bound * len(requests)
    assert engine.error is None
    return {rid: ([t for o in os_ for t in o.new_token_ids], [p.token.logprob for o in os_ for p in (o.logprobs or [])])
            for rid, os_ in outs.items()}


def greedy(req_id: str, ids: list[int], num_new: int = 32, logprobs: int | None = 1) -> EngineRequest:
    return EngineRequest(req_id=req_id, prompt_token_ids=ids,
                         sampling=SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True,
                                                 logprobs=logprobs))


PROMPTS = {"a": prompt(20, seed=1), "b": prompt(37, seed=2), "c": prompt(9, seed=3), "d": prompt(50, seed=4)}


def test_greedy_matches_transformers_on_the_gpu_in_float32(exported):
    from transformers import AutoModelForCausalLM

    src, cores = exported
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to("cuda").eval()
    engine = cuda_engine(cores["float32"], window=True)
    # no logprobs: a step whose requests want them is never followed by a speculative one (decode_overlap.speculable)
    got = generate(engine, [greedy(rid, ids, logprobs=None) for rid, ids in PROMPTS.items()], window=True)
    for rid, ids in PROMPTS.items():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
        assert got[rid][0] == ref[len(ids):], rid
    runner = engine.runner
    assert runner.launches["graph"] > 0 and runner.overlap_hits > 0, (runner.launches, runner.overlap_hits)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_window_group_changes_no_token_and_no_logprob(exported, dtype):
    _, cores = exported
    requests = [greedy(rid, ids) for rid, ids in PROMPTS.items()]
    one_group = generate(cuda_engine(cores[dtype], window=False), requests, window=False)
    grouped = generate(cuda_engine(cores[dtype], window=True), requests, window=True)
    assert grouped == one_group
