"""The tensor-parallel tests' harness: a group of gloo ranks on 127.0.0.1 (spawned processes) beside TP=1 in this
process, over the same cores, running one test module's case.

A module declares its `TpCase` (the cores to build, the workload, the tolerances) and takes its fixtures and its
parity test from `parity_tests(case)`; its own tests check the family's shard cuts (`rank1_cut`). Every rank computes
the workload's logits at once through forward_logits; rank 0 drives an engine through its TensorParallelRunner while
the other ranks run the worker loop.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.core.manifest import Architecture
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.layers.parallel import TensorGroup
from helios.runner.model_runner import ModelRunner
from helios.runner.parallel import MULTICAST_OFF, free_port, shard_arch, shard_tensors
from tests.models.hybrid_harness import generate, greedy_request, prompt

WORLD_SIZE = 2
RANK1 = TensorGroup(rank=1, world_size=WORLD_SIZE)  # the shard checks' rank: the second, without a process group


@dataclass(frozen=True)
class Workload:
    """What TP=1 and every rank run on each core; plain data, pickled to the spawned ranks."""

    prompt_lens: tuple[int, ...]  # prompt(n, seed=i + 1) each; the first one's logits are compared at every position
    chunk: int  # forward_logits' chunked prefill of the first prompt
    num_new: int  # greedy tokens per request
    prefill_chunk: int = 8  # the engine's prefill chunks (beside the other requests' decodes: mixed steps)
    max_num_batched_tokens: int = 16
    max_concurrency: int = 4
    page_size: int = 4
    num_pages: int = 64
    num_state_slots: int = 0  # > 0: a recurrent family; runner and scheduler hold this many state slots

    @property
    def runner_kwargs(self) -> dict:
        """The runner's arguments besides arch, tensors, num_pages and page_size."""
        return {"num_state_slots": self.num_state_slots} if self.num_state_slots else {}

    def prompts(self) -> list[list[int]]:
        return [prompt(n, seed=i + 1) for i, n in enumerate(self.prompt_lens)]

    def logits(self, runner) -> dict[str, torch.Tensor]:
        """Every position's logits of the first prompt, whole and in `chunk`-token chunks."""
        ids = self.prompts()[0]
        return {"whole": runner.forward_logits(ids), "chunked": runner.forward_logits(ids, chunk_size=self.chunk)}

    def greedy(self, runner, core) -> dict[str, list[int]]:
        """The prompts' greedy tokens at once through an EngineCore over `runner` (a ModelRunner or rank 0's
        TensorParallelRunner); a recurrent family's requests take a state slot each, prefix caching off."""
        states: dict = {}
        if self.num_state_slots:
            from helios.runner.state_cache import StateCache

            arch = core.manifest.arch
            states = {"num_state_slots": self.num_state_slots, "state_chunk": arch.recurrent.chunk_size,
                      "enable_prefix_caching": False,
                      "state_slot_bytes": StateCache.bytes_per_slot(arch, core.tensors["embed.weight"].dtype)}
        config = SchedulerConfig(max_concurrency=self.max_concurrency,
                                 max_num_batched_tokens=self.max_num_batched_tokens,
                                 prefill_chunk_size=self.prefill_chunk, page_size=self.page_size,
                                 num_pages=self.num_pages, max_model_len=self.num_pages * self.page_size, **states)
        return engine_tokens(config, runner, self.prompts(), self.num_new)


def window_workload(num_new: int = 32) -> Workload:
    """The sliding-window families' (an 8-token window): three prompts, the first (40 tokens) far past the window and
    over five 8-token chunks; 4-token pages, every page kept (no window group)."""
    return Workload(prompt_lens=(40, 9, 23), chunk=8, num_new=num_new)


def recurrent_workload(chunk: int, num_new: int = 32) -> Workload:
    """The recurrent families' for a grid of `chunk` tokens: three prompts, the first 2.5 chunks long (three chunks,
    each rank carrying its heads' state across them), prefilled in chunks of the grid; a state slot each."""
    return Workload(prompt_lens=(2 * chunk + chunk // 2, 9, chunk // 2 + 7), chunk=chunk, num_new=num_new,
                    prefill_chunk=chunk, max_num_batched_tokens=2 * chunk, page_size=16, num_pages=32,
                    num_state_slots=4)


@dataclass(frozen=True)
class TpCase:
    """One module's TP=2 against TP=1 parity case."""

    labels: tuple[str, ...]  # the cores: families, or one family's tiny variants (the parity test's ids)
    build: Callable[[str, Path], Path]  # (label, directory) -> the tiny random HF checkpoint written there
    workload: Workload
    atol: float = 1e-5  # every rank's logits against TP=1's at every position, whole and chunked
    last_atol: float | None = None  # a tighter bound at the last position (where the recurrence carries ulps)
    chunked_atol: float | None = None  # each rank's chunked logits against its own whole ones
    min_plans: int | None = None  # the fewest eager forwards an engine run takes; None: num_new + 1


def rank_main(rank: int, port: int, work: Workload, cores: dict[str, str], out_dir: str) -> None:
    """One rank of the group (a spawned process): every rank computes the logits; rank 0 drives the engine."""
    import torch.distributed as dist

    from helios.runner.parallel import TensorParallelRunner, init_ranks, rank_runner, worker_loop

    torch.set_num_threads(1)  # two ranks on a two-core machine
    ranks = init_ranks(rank, WORLD_SIZE, "127.0.0.1", port)
    try:
        for label, path in cores.items():
            core = load_core(Path(path), verify_digests=False)
            runner = rank_runner(core, ranks.tp, work.num_pages, work.page_size, **work.runner_kwargs)
            result = {"logits": work.logits(runner)}
            if ranks.is_driver:
                driver = TensorParallelRunner(runner, ranks)
                result["tokens"] = work.greedy(driver, core)
                result["plans"] = driver.runner.launches["eager"]
                driver.close()
            else:
                result["plans"] = worker_loop(runner, ranks)
            torch.save(result, Path(out_dir) / f"{label}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def single_and_ranked(work: Workload, cores: dict[str, Path], out_dir: Path) -> tuple[dict, dict]:
    """(TP=1's results per label, each rank's results per label), the TP=1 ones computed here while the ranks
    run: {"logits": work.logits, "tokens": work.greedy (rank 0 and TP=1), "plans": eager forwards run}."""
    args = {label: str(path) for label, path in cores.items()}
    with pytest.MonkeyPatch.context() as mp:  # the children's environment
        for name, value in MULTICAST_OFF.items():
            mp.setenv(name, value)
        ctx, port = multiprocessing.get_context("spawn"), free_port()
        procs = [ctx.Process(target=rank_main, args=(rank, port, work, args, str(out_dir)))
                 for rank in range(WORLD_SIZE)]
        for p in procs:
            p.start()
    try:
        single = {}
        for label, path in cores.items():
            core = load_core(path)
            runner = ModelRunner(core.manifest.arch, core.tensors, work.num_pages, work.page_size,
                                 **work.runner_kwargs)
            single[label] = {"logits": work.logits(runner), "tokens": work.greedy(runner, core),
                             "plans": runner.launches["eager"]}
    finally:
        for p in procs:
            p.join(timeout=180)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD_SIZE
    ranked = {f: [torch.load(out_dir / f"{f}.rank{r}.pt") for r in range(WORLD_SIZE)] for f in cores}
    return single, ranked


def float32_cores(case: TpCase, tmp_path_factory) -> dict[str, Path]:
    """One float32 export per label of the HF checkpoint `case.build(label, directory)` writes."""
    from ignition.export import ExportOptions, export_core

    out = {}
    for label in case.labels:
        root = tmp_path_factory.mktemp(label)
        out[label] = export_core(case.build(label, root / "hf"), root / "core", ExportOptions(dtype="float32"))
    return out


def engine_tokens(config: SchedulerConfig, runner, prompts: list[list[int]], num_new: int) -> dict[str, list[int]]:
    """The prompts' greedy tokens (num_new each, requests r0, r1, ..., all at once) through an EngineCore over
    `runner` (a ModelRunner or rank 0's TensorParallelRunner)."""
    engine = EngineCore(config, runner)
    out = generate(engine, [greedy_request(f"r{i}", ids, num_new) for i, ids in enumerate(prompts)])
    assert engine.is_healthy, engine.error
    return out


def assert_ranks_match_single(case: TpCase, results: tuple[dict, dict], label: str) -> None:
    """Every rank's logits (each gathers the whole vocabulary) within the case's bounds of TP=1's, whole and chunked;
    rank 0's greedy tokens TP=1's, num_new each; the worker ran every plan rank 0 ran, as many as TP=1."""
    single, ranked = results
    want, num_new = single[label], case.workload.num_new
    for rank_result in ranked[label]:
        got = rank_result["logits"]
        for key in ("whole", "chunked"):
            if case.last_atol is not None:
                torch.testing.assert_close(got[key][-1], want["logits"][key][-1], atol=case.last_atol, rtol=0)
            torch.testing.assert_close(got[key], want["logits"][key], atol=case.atol, rtol=0)
        if case.chunked_atol is not None:
            torch.testing.assert_close(got["chunked"], got["whole"], atol=case.chunked_atol, rtol=0)
    driver, worker = ranked[label]
    assert driver["tokens"] == want["tokens"]
    assert all(len(t) == num_new for t in driver["tokens"].values())
    min_plans = num_new + 1 if case.min_plans is None else case.min_plans
    assert worker["plans"] == driver["plans"] == want["plans"] >= min_plans


def rank1_cut(path: Path) -> tuple[Architecture, dict[str, torch.Tensor], dict[str, torch.Tensor], Architecture]:
    """The core at `path` as RANK1 holds it: (its arch, its mapped tensors, rank 1's shards, rank 1's arch)."""
    core = load_core(path)
    arch, full = core.manifest.arch, core.tensors
    return arch, full, shard_tensors(arch, full, RANK1), shard_arch(arch, RANK1)


def parity_tests(case: TpCase) -> tuple[Callable, Callable, Callable]:
    """A module's `cores` fixture (one float32 export per label), its `results` fixture (TP=1 and each rank of TP=2
    on them, once per module) and its parity test, parametrized by label. A module binds all three at top level:
    `cores, results, test_tp2_logits_and_greedy_equal_single_rank = parity_tests(CASE)`."""

    @pytest.fixture(scope="module")
    def cores(tmp_path_factory) -> dict[str, Path]:
        return float32_cores(case, tmp_path_factory)

    @pytest.fixture(scope="module")
    def results(cores, tmp_path_factory) -> tuple[dict, dict]:
        return single_and_ranked(case.workload, cores, tmp_path_factory.mktemp("ranks"))

    @pytest.mark.parametrize("label", case.labels)
    def test_tp2_logits_and_greedy_equal_single_rank(results, label):
        """Both ranks' logits within the case's bounds of TP=1's, whole and chunked; every request's greedy tokens
        identical; the worker ran every plan (tests/runner/tp_harness)."""
        assert_ranks_match_single(case, results, label)

    return cores, results, test_tp2_logits_and_greedy_equal_single_rank
