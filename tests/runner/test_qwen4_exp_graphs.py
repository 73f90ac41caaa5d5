"""qwen4_exp's decode graphs end to end on the CPU: the tiny plain checkpoint (tests/models/qwen4_exp_tiny.py: 2 index
heads, so relu's zero scores tie often) through an engine on the Triton backend (QSA decode through
helios.kernels.qsa_decode, the GDN and the MoE on their kernels; all in the interpreter) with a
GraphRunner(capture=False) running the function a graph captures (static buffers, padded bucket rows, the state
scratch row), gives the eager torch runner's greedy tokens; decodes long enough that the choice drops blocks on
graphed steps."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineRequest, SamplingParams
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.cuda_graphs import unsupported_reason
from helios.runner.model_runner import ModelRunner
from helios.runner.state_cache import StateCache
from tests.models.qwen4_exp_tiny import build_qwen4_exp

PAGE, NUM_PAGES, MAX_MODEL_LEN = 4, 64, 96

pytestmark = pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    from ignition.export import ExportOptions, export_core

    root = tmp_path_factory.mktemp("qwen4_exp-graphs")
    return load_core(export_core(build_qwen4_exp("plain", root / "hf"), root / "core", ExportOptions(dtype="float32")))


# (first token, greedy tokens, the step it arrives at): one-token prompts, so every step of either engine has one
# token per sequence (the GDN's chunked prefill on the Triton backend is fla's, CUDA only); arrivals staggered so the
# lengths differ and the batch takes buckets 1, 2 and 4 (3 rows: one padded)
REQUESTS = ((5, 12, 0), (77, 9, 2), (150, 6, 4))


def run(core, graphed: bool) -> tuple[dict, ModelRunner]:
    """The requests: graphed (Triton, GraphRunner(capture=False), buckets 1, 2, 4) or the eager torch runner (the
    reference)."""
    arch = core.manifest.arch
    config = SchedulerConfig(max_concurrency=3, max_num_batched_tokens=72, prefill_chunk_size=64, page_size=PAGE,
                             num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN, num_state_slots=3,
                             state_chunk=arch.recurrent.chunk_size, enable_prefix_caching=False,
                             state_slot_bytes=StateCache.bytes_per_slot(arch, core.tensors["embed.weight"].dtype))
    runner = ModelRunner(arch, core.tensors, NUM_PAGES, PAGE, max_model_len=MAX_MODEL_LEN, num_state_slots=3,
                         attention_backend="triton" if graphed else None)
    if graphed:
        runner.graphs = runner.make_graphs([1, 2, 4], capture=False)
    engine = EngineCore(config, runner)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= REQUESTS[-1][2] or engine.has_unfinished_requests():
        for i, (token, num_new, arrival) in enumerate(REQUESTS):
            if arrival == step:
                sampling = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
                engine.add_request(EngineRequest(req_id=f"r{i}", prompt_token_ids=[token], sampling=sampling))
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        step += 1
    assert engine.error is None
    return tokens, runner


def test_graphed_decode_gives_the_eager_tokens(core):
    """The tokens (up to 13 keys: 3 complete blocks, 2 kept); and unsupported_reason admits the Triton runner's
    model while the torch runner's is refused."""
    expected, eager = run(core, graphed=False)
    got, runner = run(core, graphed=True)
    assert got == expected
    assert runner.graphs.num_replays >= 8
    cuda = torch.device("cuda")  # a device object only: nothing runs there
    assert unsupported_reason(runner.model, runner.arch, cuda) is None
    assert unsupported_reason(eager.model, eager.arch, cuda) is not None
