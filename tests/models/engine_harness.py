"""A synchronous engine over a real core, for tests and benchmarks: EngineCore + ModelRunner, stepped
in the calling thread until every submitted request finishes."""

from __future__ import annotations

from helios.core.load import LoadedCore
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineOutput, EngineRequest, SamplingParams
from helios.runner.model_runner import ModelRunner


def make_engine(core: LoadedCore, num_pages: int = 512, page_size: int = 16, max_concurrency: int = 16,
                chunk: int = 512, enable_prefix_caching: bool = True) -> EngineCore:
    arch = core.manifest.arch
    config = SchedulerConfig(
        max_concurrency=max_concurrency,
        max_num_batched_tokens=max(chunk, max_concurrency),
        prefill_chunk_size=chunk,
        page_size=page_size,
        num_pages=num_pages,
        max_model_len=min(core.manifest.limits.context_length, num_pages * page_size),
        enable_prefix_caching=enable_prefix_caching,
    )
    return EngineCore(config, ModelRunner(arch, core.tensors, num_pages, page_size))


def run(engine: EngineCore, requests: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
    outs: dict[str, list[EngineOutput]] = {r.req_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.req_id].append(o)
    return outs


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def greedy(max_tokens: int, eos: tuple[int, ...] = (), **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, eos_token_ids=eos, **kw)
