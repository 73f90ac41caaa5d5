"""muse_spark on the GPU: the tiny random checkpoint of tests/models/muse_spark_tiny.py (full and sliding layers, NoPE
on one of each, window 8, dense SwiGLU and the latent MoE) exported in float32 and bfloat16, run by the CUDA runner
(Triton attention backend; MoE keeps CUDA graphs off) through the engine with the sliding layers' pages in a window
group: float32 greedy tokens = HF transformers' generate on the device; 16 batched = alone in both dtypes. A dense
variant (every MLP dense) captures decode graphs: its tokens = the eager CUDA engine's, its logprobs to 1e-4."""

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
from tests.models.hybrid_harness import PAGE_SIZE, generate, greedy_request, prompt
from tests.models.muse_spark_tiny import WINDOW, build_muse_spark

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUM_PAGES = 512


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from ignition.export import ExportOptions, export_core

    root = tmp_path_factory.mktemp("muse_spark")
    src = build_muse_spark(root / "hf")
    return src, {name: load_core(export_core(src, root / name, ExportOptions(dtype=name))) for name in DTYPES}


def cuda_engine(core, max_concurrency: int = 16, budget: int = 256, chunk: int = 128,
                cuda_graphs: bool = True) -> EngineCore:
    """The sliding layers' pages in a window group with room for every request's window and chunk."""
    window_pages = max_concurrency * window_pages_per_request(WINDOW, PAGE_SIZE, chunk)
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget,
                             prefill_chunk_size=chunk, page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                             max_model_len=NUM_PAGES * PAGE_SIZE, sliding_window=WINDOW, window_pages=window_pages)
    runner = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE_SIZE, device="cuda",
                         window_pages=window_pages, cuda_graphs=cuda_graphs)
    return EngineCore(config, runner)


def test_greedy_matches_transformers_on_the_gpu_in_float32(exported):
    """32 greedy tokens of a 150-token prompt (the window 8) = HF generate on the device."""
    from transformers import MuseSparkForConditionalGeneration

    src, cores = exported
    hf = MuseSparkForConditionalGeneration.from_pretrained(src, dtype=torch.float32).to("cuda").eval()
    ids, num_new = prompt(150, seed=5), 32
    engine = cuda_engine(cores["float32"])
    got = generate(engine, [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=num_new, min_new_tokens=num_new,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]
    assert engine.runner.kv_cache.layers[1].shape[1] < NUM_PAGES  # the sliding layers hold only the window group


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sixteen_requests_together_give_what_each_gives_alone(exported, dtype):
    """16 requests under a 64-token budget (prompts in 32-token chunks beside the others' decodes) give the tokens
    each gives alone in one chunk."""
    _, cores = exported
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    together = generate(cuda_engine(cores[dtype], budget=64, chunk=32), reqs)
    for r in reqs:
        alone = generate(cuda_engine(cores[dtype], max_concurrency=1, budget=512, chunk=512), [r])[r.req_id]
        assert together[r.req_id] == alone, (dtype, r.req_id)


def test_a_dense_variant_replays_decode_graphs_with_the_eager_tokens(tmp_path):
    """Every MLP dense (no expert loop): the decode steps replay CUDA graphs over the window group's tables; the
    tokens equal the eager CUDA engine's, the logprobs within 1e-4."""
    from ignition.export import ExportOptions, export_core

    src = build_muse_spark(tmp_path / "hf", mlp_layer_types=["dense"] * 5)
    core = load_core(export_core(src, tmp_path / "core", ExportOptions(dtype="float32")))
    reqs = [EngineRequest(req_id=f"r{i}", prompt_token_ids=prompt(9 + 31 * i, seed=40 + i),
                          sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1))
            for i in range(4)]

    def run(engine: EngineCore) -> dict:
        outs: dict = {r.req_id: [] for r in reqs}
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.req_id].extend((t, p.token.logprob) for t, p in zip(o.new_token_ids, o.logprobs or []))
        return outs

    graphed = cuda_engine(core, max_concurrency=4, budget=64, chunk=32)
    assert graphed.runner.graphs is not None, graphed.runner.startup.graphs
    got = run(graphed)
    assert graphed.runner.launches["graph"] > 0, graphed.runner.launches
    want = run(cuda_engine(core, max_concurrency=4, budget=64, chunk=32, cuda_graphs=False))
    for rid, pairs in want.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in pairs] and len(pairs) == 24, rid
        # the eager decode may split its attention differently from the captured one: logprobs to rounding
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[rid], pairs)) < 1e-4, rid
