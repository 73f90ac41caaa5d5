"""The tensor-parallel tests' harness: a group of gloo ranks on 127.0.0.1 (spawned processes) beside TP=1 in this
process, over the same cores, running one test module's checks.

The module names them: NUM_PAGES, PAGE_SIZE, RUNNER_KWARGS (the runner's other arguments), `logits_of(runner)` (the
logits every rank computes at once through forward_logits) and `greedy_tokens(runner, core)` (an engine's tokens:
rank 0 drives it through its TensorParallelRunner while the other ranks run the worker loop).
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.runner.model_runner import ModelRunner
from helios.runner.parallel import MULTICAST_OFF, free_port
from tests.models.hybrid_harness import generate, greedy_request, prompt

WORLD_SIZE = 2


def rank_main(rank: int, port: int, module_name: str, cores: dict[str, str], out_dir: str) -> None:
    """One rank of the group (a spawned process): every rank computes the logits; rank 0 drives the engine."""
    import torch.distributed as dist

    from helios.runner.parallel import TensorParallelRunner, init_ranks, rank_runner, worker_loop

    module = importlib.import_module(module_name)
    torch.set_num_threads(1)  # two ranks on a two-core machine
    ranks = init_ranks(rank, WORLD_SIZE, "127.0.0.1", port)
    try:
        for family, path in cores.items():
            core = load_core(Path(path), verify_digests=False)
            runner = rank_runner(core, ranks.tp, module.NUM_PAGES, module.PAGE_SIZE, **module.RUNNER_KWARGS)
            result = {"logits": module.logits_of(runner)}
            if ranks.is_driver:
                driver = TensorParallelRunner(runner, ranks)
                result["tokens"] = module.greedy_tokens(driver, core)
                result["plans"] = driver.runner.launches["eager"]
                driver.close()
            else:
                result["plans"] = worker_loop(runner, ranks)
            torch.save(result, Path(out_dir) / f"{family}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def single_and_ranked(module_name: str, cores: dict[str, Path], out_dir: Path) -> tuple[dict, dict]:
    """(TP=1's results per family, each rank's results per family), the TP=1 ones computed here while the ranks
    run: {"logits": logits_of, "tokens": greedy_tokens (rank 0 and TP=1), "plans": eager forwards run}."""
    module = importlib.import_module(module_name)
    args = {family: str(path) for family, path in cores.items()}
    with pytest.MonkeyPatch.context() as mp:  # the children's environment
        for name, value in MULTICAST_OFF.items():
            mp.setenv(name, value)
        ctx, port = multiprocessing.get_context("spawn"), free_port()
        procs = [ctx.Process(target=rank_main, args=(rank, port, module_name, args, str(out_dir)))
                 for rank in range(WORLD_SIZE)]
        for p in procs:
            p.start()
    try:
        single = {}
        for family, path in cores.items():
            core = load_core(path)
            runner = ModelRunner(core.manifest.arch, core.tensors, module.NUM_PAGES, module.PAGE_SIZE,
                                 **module.RUNNER_KWARGS)
            single[family] = {"logits": module.logits_of(runner), "tokens": module.greedy_tokens(runner, core),
                              "plans": runner.launches["eager"]}
    finally:
        for p in procs:
            p.join(timeout=180)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD_SIZE
    ranked = {f: [torch.load(out_dir / f"{f}.rank{r}.pt") for r in range(WORLD_SIZE)] for f in cores}
    return single, ranked


def float32_cores(build: Callable[[str, Path], Path], families: tuple[str, ...], tmp_path_factory) -> dict[str, Path]:
    """One float32 export per family of the HF checkpoint `build(family, directory)` writes."""
    from ignition.export import ExportOptions, export_core

    out = {}
    for family in families:
        root = tmp_path_factory.mktemp(family)
        out[family] = export_core(build(family, root / "hf"), root / "core", ExportOptions(dtype="float32"))
    return out


def engine_tokens(config: SchedulerConfig, runner, prompts: list[list[int]], num_new: int) -> dict[str, list[int]]:
    """The prompts' greedy tokens (num_new each, requests r0, r1, ..., all at once) through an EngineCore over
    `runner` (a ModelRunner or rank 0's TensorParallelRunner)."""
    engine = EngineCore(config, runner)
    out = generate(engine, [greedy_request(f"r{i}", ids, num_new) for i, ids in enumerate(prompts)])
    assert engine.is_healthy, engine.error
    return out


# --- the sliding-window families' checks (step3p7, muse_spark, gemma4: an 8-token window, 4-token pages) ------------

WINDOW_PAGE_SIZE, WINDOW_NUM_PAGES, WINDOW_CHUNK = 4, 64, 8


def window_prompts() -> list[list[int]]:
    """Three prompts: the first (40 tokens) far past an 8-token window and over five 8-token chunks."""
    return [prompt(40, seed=1), prompt(9, seed=2), prompt(23, seed=3)]


def window_logits(runner) -> dict[str, torch.Tensor]:
    """Every position's logits of the first prompt, whole and in 8-token chunks (a module's logits_of)."""
    ids = window_prompts()[0]
    return {"whole": runner.forward_logits(ids), "chunked": runner.forward_logits(ids, chunk_size=WINDOW_CHUNK)}


def window_greedy(runner, num_new: int) -> dict[str, list[int]]:
    """The three prompts' greedy tokens at once (8-token prefill chunks beside decodes: mixed steps; every page kept,
    no window group) through an EngineCore over `runner` (a module's greedy_tokens)."""
    config = SchedulerConfig(max_concurrency=4, max_num_batched_tokens=16, prefill_chunk_size=WINDOW_CHUNK,
                             page_size=WINDOW_PAGE_SIZE, num_pages=WINDOW_NUM_PAGES,
                             max_model_len=WINDOW_NUM_PAGES * WINDOW_PAGE_SIZE)
    return engine_tokens(config, runner, window_prompts(), num_new)


def assert_ranks_match_single(single: dict, ranked: dict, family: str, num_new: int, atol: float = 1e-5) -> None:
    """Every rank's logits (each gathers the whole vocabulary) within atol of TP=1's at every position, whole and
    chunked; rank 0's greedy tokens TP=1's, num_new each; the worker ran every plan rank 0 ran, as many as TP=1."""
    for rank_result in ranked[family]:
        for key in ("whole", "chunked"):
            torch.testing.assert_close(rank_result["logits"][key], single[family]["logits"][key], atol=atol, rtol=0)
    driver, worker = ranked[family]
    assert driver["tokens"] == single[family]["tokens"]
    assert all(len(t) == num_new for t in driver["tokens"].values())
    assert worker["plans"] == driver["plans"] == single[family]["plans"] > num_new


# --- the recurrent families' checks (nemotron_h, kimi_linear): prompts over several chunks of the recurrent grid ----

RECURRENT_PAGE_SIZE, RECURRENT_NUM_PAGES, RECURRENT_SLOTS = 16, 32, 4


def recurrent_prompts(chunk: int) -> list[list[int]]:
    """Three prompts for a recurrent grid of `chunk` tokens: the first 2.5 chunks long (three prefill chunks)."""
    return [prompt(2 * chunk + chunk // 2, seed=1), prompt(9, seed=2), prompt(chunk // 2 + 7, seed=3)]


def recurrent_logits(runner, chunk: int) -> dict[str, torch.Tensor]:
    """Every position's logits of the first recurrent prompt, whole and in `chunk`-token chunks (the recurrent grid:
    each rank carries its heads' state across the three)."""
    ids = recurrent_prompts(chunk)[0]
    return {"whole": runner.forward_logits(ids), "chunked": runner.forward_logits(ids, chunk_size=chunk)}


def recurrent_greedy(runner, core, num_new: int) -> dict[str, list[int]]:
    """The three recurrent prompts' greedy tokens at once, each with a state slot, prefilled in chunks of the
    recurrent grid beside the others' decodes (mixed steps) through an EngineCore over `runner`."""
    from helios.runner.state_cache import StateCache

    arch, chunk = core.manifest.arch, core.manifest.arch.recurrent.chunk_size
    config = SchedulerConfig(max_concurrency=RECURRENT_SLOTS, max_num_batched_tokens=2 * chunk,
                             prefill_chunk_size=chunk, page_size=RECURRENT_PAGE_SIZE, num_pages=RECURRENT_NUM_PAGES,
                             max_model_len=RECURRENT_NUM_PAGES * RECURRENT_PAGE_SIZE, num_state_slots=RECURRENT_SLOTS,
                             state_chunk=chunk, enable_prefix_caching=False,
                             state_slot_bytes=StateCache.bytes_per_slot(arch, core.tensors["embed.weight"].dtype))
    return engine_tokens(config, runner, recurrent_prompts(chunk), num_new)
