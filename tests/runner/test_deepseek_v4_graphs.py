"""deepseek_v4's decode graphs end to end on the CPU: the tiny checkpoint (tests/models/deepseek_v4_tiny.py) through
an engine with its raw rows in the window page group, on the Triton backend (attention decode through
helios.kernels.csa_decode, the fused MoE; kernels in the interpreter) with a GraphRunner(capture=False) running the
function a graph captures (static buffers, padded bucket rows, the window group's tables and slots), gives the eager
torch runner's greedy tokens, prompts and decodes long enough that windows complete on graphed decode steps."""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.kv_groups import window_pages_per_request
from helios.engine.messages import EngineRequest, SamplingParams
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.layers.compressed_attention import CompressedAttention
from helios.runner.cuda_graphs import unsupported_reason
from helios.runner.model_runner import ModelRunner
from tests.models.hybrid_harness import prompt
from tests.models.test_deepseek_v4 import export_deepseek_v4

PAGE, NUM_PAGES, MAX_MODEL_LEN = 4, 64, 96

pytestmark = pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    return export_deepseek_v4(tmp_path_factory.mktemp("deepseek_v4-graphs"))[1]


def run(core, graphed: bool) -> tuple[dict, ModelRunner]:
    """Three greedy requests: graphed (window group, Triton, GraphRunner(capture=False), buckets 1, 2, 4: a padded
    row) or the eager one-group torch runner (the reference)."""
    window = core.manifest.arch.sliding_window
    window_pages = 3 * window_pages_per_request(window, PAGE, 32) if graphed else 0
    groups = dict(sliding_window=window, window_pages=window_pages) if graphed else {}
    config = SchedulerConfig(max_concurrency=3, max_num_batched_tokens=32, prefill_chunk_size=32, page_size=PAGE,
                             num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, **groups)
    runner = ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE, max_model_len=MAX_MODEL_LEN,
                         attention_backend="triton" if graphed else None, window_pages=window_pages)
    if graphed:
        runner.graphs = runner.make_graphs([1, 2, 4], capture=False)
    engine = EngineCore(config, runner)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, n in enumerate((2, 9, 13)):
        engine.add_request(EngineRequest(req_id=f"r{i}", prompt_token_ids=prompt(n, seed=i), sampling=greedy))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert engine.error is None
    return tokens, runner


def test_graphed_decode_gives_the_eager_tokens(core):
    """The tokens; and unsupported_reason admits the Triton runner's model (csa_decode, the fused MoE) while a CSA
    layer off its kernel path keeps the indexed-attention refusal, and the torch runner's model is refused."""
    expected, eager = run(core, graphed=False)
    got, runner = run(core, graphed=True)
    assert got == expected
    assert runner.graphs.num_replays >= 7
    cuda = torch.device("cuda")  # a device object only: nothing runs there
    assert unsupported_reason(runner.model, runner.arch, cuda) is None
    assert unsupported_reason(eager.model, eager.arch, cuda) is not None  # the torch runner: its MoE, its attention
    csa = next(m for m in runner.model.modules() if isinstance(m, CompressedAttention) and m.kind == "csa")
    csa.decode_graph_safe = False
    reason = unsupported_reason(runner.model, runner.arch, cuda)
    assert reason.startswith("indexed attention layers (CompressedAttention)"), reason
