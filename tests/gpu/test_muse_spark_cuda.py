"""muse_spark on the GPU: the tiny random checkpoint of tests/models/muse_spark_tiny.py (full and sliding layers, NoPE
on one of each, window 8, dense SwiGLU and the latent MoE) exported in float32 and bfloat16, run by the CUDA runner
(Triton attention backend; MoE keeps CUDA graphs off) through the engine with the sliding layers' pages in a window
group: greedy tokens (float32, bfloat16) = HF transformers' generate on the device; 16 batched = alone (float32). A dense
variant (every MLP dense) captures decode graphs: its tokens = the eager CUDA engine's, its logprobs to 1e-4."""

from __future__ import annotations

import pytest

from helios.core.load import load_core
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineRequest, SamplingParams
from tests.gpu.family_cuda import (
    CUDA_MARKS,
    DTYPES,
    NUM_PAGES,
    check_batched_on_cuda,
    check_greedy_on_cuda,
    cuda_engine,
    export_family,
)
from tests.models.hybrid_harness import prompt
from tests.models.muse_spark_tiny import build_muse_spark

pytestmark = CUDA_MARKS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_family(tmp_path_factory, "muse_spark", build_muse_spark)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_on_the_gpu(exported, dtype):
    """32 greedy tokens of a 150-token prompt (the window 8) = HF generate on the device."""
    from transformers import MuseSparkForConditionalGeneration

    src, cores = exported
    engine = check_greedy_on_cuda(MuseSparkForConditionalGeneration, src, cores[dtype])
    assert engine.runner.kv_cache.layers[1].shape[1] < NUM_PAGES  # the sliding layers hold only the window group


def test_sixteen_requests_together_give_what_each_gives_alone(exported):
    """16 requests under a 64-token budget (prompts in 32-token chunks beside the others' decodes) give the tokens
    each gives alone in one chunk."""
    check_batched_on_cuda(exported[1]["float32"], budget=64, chunk=32)


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
