"""The hybrid families' parity harness: engines with state slots (and checkpoints, and host tiers) over a tiny core,
greedy requests, and the checks every hybrid family's test runs against transformers (tests/models/test_*.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineRequest, SamplingParams
from helios.runner.model_runner import ModelRunner

PAGE_SIZE = 16

def make_engine(core, max_concurrency: int = 16, num_pages: int = 256, chunk: int = 64,
                budget: int = 128, checkpoints: int = 0) -> EngineCore:
    """checkpoints: state checkpoint slots (prefix reuse through them); 0: no prefix cache. A model without
    recurrent layers gets window_engine's; a recurrent one its pages in one group."""
    recurrent = core.manifest.arch.recurrent is not None
    return window_engine(core, max_concurrency, num_pages, chunk, budget, window=not recurrent,
                         checkpoints=checkpoints)


def window_engine(core, max_concurrency: int = 16, num_pages: int = 256, chunk: int = 64, budget: int = 128,
                  device: str = "cpu", page_size: int = PAGE_SIZE, window: bool = True, prefix_caching: bool = True,
                  checkpoints: int = 0, **runner_options) -> EngineCore:
    """A model's engine (on `device`): the pages of its sliding layers (beside full ones) in a window group
    (helios/engine/kv_groups.py) with room for every slot's window and chunk, as compose sizes it; window=False:
    every layer in one group; a state slot per request for a model with recurrent layers, and `checkpoints` state
    checkpoint slots (its prefix reuse: none without them). runner_options go to the ModelRunner (cuda_graphs)."""
    from helios.engine.kv_groups import window_pages_per_request
    from helios.runner.kv_cache import KVCache
    from helios.runner.state_cache import StateCache

    arch = core.manifest.arch
    window_pages = 0
    groups = {}
    if window and KVCache.window_layers(arch):
        window_pages = max_concurrency * window_pages_per_request(arch.sliding_window, page_size, chunk)
        groups = dict(sliding_window=arch.sliding_window, window_pages=window_pages)
    if arch.recurrent is not None:
        groups.update(num_state_slots=max_concurrency, state_chunk=arch.recurrent.chunk_size,
                      state_checkpoint_slots=checkpoints,
                      state_slot_bytes=StateCache.bytes_per_slot(arch, core.tensors["embed.weight"].dtype))
        runner_options = dict(runner_options, num_state_slots=max_concurrency + checkpoints)
        prefix_caching = checkpoints > 0
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget,
                             prefill_chunk_size=chunk, page_size=page_size, num_pages=num_pages,
                             max_model_len=num_pages * page_size, enable_prefix_caching=prefix_caching, **groups)
    return EngineCore(config, ModelRunner(arch, core.tensors, num_pages, page_size, device=device,
                                          window_pages=window_pages, **runner_options))


def export_float32(hf_class, src: Path, root: Path):
    """A parity test's pair: (the HF model hf_class loads from src in float32, src's float32 core with prompt
    logprobs, exported under root / "core")."""
    from helios.core.load import load_core
    from ignition.export import ExportOptions, export_core

    core = load_core(export_core(src, root / "core", ExportOptions(dtype="float32", prompt_logprobs=True)))
    return hf_class.from_pretrained(src, dtype=torch.float32).eval(), core


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:  # [T, V]
    return hf(torch.tensor([token_ids])).logits[0].float()


def generate(engine: EngineCore, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    out = {r.req_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
            assert o.finish_reason in (None, "length"), o
    return out


def greedy_request(req_id: str, ids: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(req_id=req_id, prompt_token_ids=ids,
                         sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def tiered_engine(core, disk: Path, num_pages: int = 48) -> EngineCore:
    """One GPU checkpoint slot, 2 host DRAM state records and 8 host pages, disk records behind both: a few
    unrelated requests push a conversation's checkpoint and pages out of the GPU, out of DRAM, onto disk."""
    from helios.runner.kv_cache import KVCache
    from helios.runner.state_cache import StateCache

    arch = core.manifest.arch
    dtype = core.tensors["embed.weight"].dtype
    config = SchedulerConfig(max_concurrency=2, max_num_batched_tokens=128, prefill_chunk_size=64,
                             page_size=PAGE_SIZE, num_pages=num_pages, max_model_len=num_pages * PAGE_SIZE,
                             num_state_slots=2, state_chunk=arch.recurrent.chunk_size, enable_prefix_caching=True,
                             state_checkpoint_slots=1, state_slot_bytes=StateCache.bytes_per_slot(arch, dtype),
                             host_state_records=2, host_state_disk_records=16, host_cache_pages=8,
                             host_disk_pages=256, page_bytes=KVCache.bytes_per_page(arch, PAGE_SIZE, dtype))
    runner = ModelRunner(arch, core.tensors, num_pages, PAGE_SIZE, num_state_slots=3, host_cache_pages=8,
                         host_disk_dir=disk / "pages", host_state_records=2, host_state_disk_dir=disk / "states")
    return EngineCore(config, runner, runner.disk_store.list_records(),
                      state_disk_records=runner.state_disk.list_records())


def run_collecting(engine: EngineCore, req: EngineRequest):
    outputs = []
    engine.add_request(req)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return [t for o in outputs for t in o.new_token_ids], outputs[-1].num_cached_tokens


def check_logits_and_prompt_logprobs(hf, core, ids: list[int], chunk_size: int = 64) -> None:
    """Last-position logits within 1e-4 of transformers; chunks on the recurrent grid carry the state (the same rows
    as the whole prompt within 1e-5); prompt log-softmax within 1e-4."""
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, num_state_slots=1)
    ref = hf_logits(hf, ids)
    whole = runner.forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    chunked = runner.forward_logits(ids, chunk_size=chunk_size)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)


def check_fused_loop_equals_eager(core, fuse, is_fused) -> None:
    """The GPU path's norms (each residual add and norm as one Triton launch, in the interpreter here) over the same
    mixers and experts: a torch-backend model, switched by `fuse(model)` (what the Triton backend picks; `is_fused`
    tells), gives every position's float32 logits of its eager loop within the parity bound (the kernel sums the
    squares in another order: 2e-5 measured). The mixers keep their torch path: KDA's chunked prefill runs fla's
    kernels, CUDA only."""
    from tests.kernels.interpreter import require_interpreter

    require_interpreter()
    runner = ModelRunner(core.manifest.arch, core.tensors, 16, PAGE_SIZE, num_state_slots=1, attention_backend="torch")
    ids = prompt(20, seed=3)
    assert not is_fused(runner.model)
    eager = runner.forward_logits(ids)
    fuse(runner.model)
    assert is_fused(runner.model)
    torch.testing.assert_close(runner.forward_logits(ids), eager, atol=1e-4, rtol=1e-4)


def decode_caches(arch, num_pages: int, page_size: int, num_slots: int, seed: int) -> list:
    """Random per-layer caches: a linear layer's (conv, recurrent) states, an attention layer's KV pages, None for an
    ffn layer."""
    gen = torch.Generator().manual_seed(seed)
    r = arch.recurrent
    out = []
    for kind in arch.layer_types:
        if kind == "linear":
            out.append((torch.randn(num_slots + 1, r.conv_kernel - 1, r.conv_dim, generator=gen),
                        0.1 * torch.randn(num_slots + 1, r.num_heads, r.key_head_dim, r.value_head_dim, generator=gen)))
        elif kind == "full":
            out.append(torch.randn(2, num_pages, page_size, arch.num_kv_heads, arch.head_dim, generator=gen))
        else:
            out.append(None)
    return out


def check_fused_decode_step_equals_eager(arch, eager, fused, positions: list[int], page_size: int) -> None:
    """One decode step of sequences at `positions` through the fused model (its GPU path, Triton's interpreter here)
    = through the eager one: the hidden states and every updated cache within 1e-4."""
    from helios.engine.messages import ScheduledRequest
    from helios.runner.input_batch import prepare_batch

    scheduled = [ScheduledRequest(req_id=f"r{i}", token_ids=[11 + i], num_computed_tokens=p,
                                  block_ids=[8 * i + b for b in range(p // page_size + 1)], sample=True,
                                  state_slot=2 - i)
                 for i, p in enumerate(positions)]
    batch = prepare_batch(scheduled, {}, page_size, scratch_slot=3)
    want_caches, got_caches = (decode_caches(arch, 32, page_size, 3, seed=1) for _ in range(2))
    with torch.inference_mode():
        want = eager.forward(batch.token_ids, batch.meta, want_caches)
        got = fused.forward(batch.token_ids, batch.meta, got_caches)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for w, g in zip(want_caches, got_caches):
        for a, b in zip(w if isinstance(w, tuple) else (w,), g if isinstance(g, tuple) else (g,)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def check_greedy_matches_generate(hf, core, ids: list[int], num_new: int = 32, engine=make_engine,
                                  device: str = "cpu") -> EngineCore:
    """The engine's greedy tokens (grid-chunked prefill, then decode steps) = transformers' generate (hf on
    `device`); `engine(core)` builds it (make_engine's arguments, the factory's defaults). Returns that engine."""
    built = engine(core)
    got = generate(built, [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device=device), max_new_tokens=num_new, min_new_tokens=num_new,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]
    return built


def check_batched_equals_alone(core, prompts: list[list[int]], engine=make_engine, budget: int = 128, chunk: int = 64,
                               alone_budget: int = 512, alone_chunk: int = 512, one_alone_engine: bool = False,
                               tie=None) -> None:
    """Requests run together (a `budget`-token budget: long prompts split into `chunk`-token chunks beside the others'
    decodes) give the tokens each gives alone (one slot, `alone_chunk`-token chunks: a fresh engine each, or with
    one_alone_engine the same engine one request after another); `engine` builds the engines (make_engine's
    arguments). `tie(request, together, alone)`, when given, may explain a request whose runs part by a tie inside
    the model (a reason, printed; None fails the check as without it): the GPU checks' router near-ties."""
    reqs = [greedy_request(f"r{i}", ids, 12) for i, ids in enumerate(prompts)]
    together = generate(engine(core, budget=budget, chunk=chunk), reqs)
    alone = engine(core, max_concurrency=1, budget=alone_budget, chunk=alone_chunk) if one_alone_engine else None
    for r in reqs:
        single = alone if alone is not None else engine(core, max_concurrency=1, budget=alone_budget, chunk=alone_chunk)
        got = generate(single, [r])[r.req_id]
        if together[r.req_id] != got:
            reason = tie(r, together[r.req_id], got) if tie is not None else None
            if reason is None:
                pytest.fail(f"{r.req_id}: {divergence(together[r.req_id], got, single, r)}")
            print(f"[router tie] {reason}")


def divergence(together: list[int], alone: list[int], engine: EngineCore, req: EngineRequest) -> str:
    """Where two greedy runs part, and how close the alone run's choice was there: its top-2 logprob gap (run again
    with logprobs; a gap near the dtype's rounding says the runs differ by summation order, not by a wrong row)."""
    k = next(i for i, (a, b) in enumerate(zip(together, alone)) if a != b)
    sampling = msgspec.structs.replace(req.sampling, logprobs=2)
    probe = msgspec.structs.replace(req, req_id=req.req_id + "-lp", sampling=sampling)
    engine.add_request(probe)
    records = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            records.extend(o.logprobs or [])
    record = records[k]
    top = sorted({t.token_id: t for t in (record.token, *record.alternatives)}.values(), key=lambda t: -t.logprob)
    gap = top[0].logprob - top[1].logprob if len(top) > 1 else float("inf")
    return (f"output {k} of {len(alone)}: together {together[k]}, alone {alone[k]} (alone's top-2 logprob gap there "
            f"{gap:.3e}; together {together[:k + 2]}, alone {alone[:k + 2]})")


def check_second_turn(core, first_ids: list[int], next_ids: list[int]) -> EngineCore:
    """A second turn (the first turn's prompt, its 60 tokens, more) reuses the first turn's state through the
    endpoint checkpoint its decode passed at 128 tokens, and gives exactly the tokens of a run without reuse.
    Returns the engine (its metrics)."""
    engine = make_engine(core, max_concurrency=4, checkpoints=2)
    first = greedy_request("t1", first_ids, 60)
    history = first.prompt_token_ids + generate(engine, [first])["t1"]
    second = greedy_request("t2", history + next_ids, 16)
    assert run_collecting(engine, second) == (generate(make_engine(core, max_concurrency=4), [second])["t2"], 128)
    return engine


def check_tiers(core, tmp_path: Path) -> EngineCore:
    """A conversation's checkpoint back from host DRAM, from disk (its pages too) and after a restart on the disk
    tier: the second turn's tokens are those of a run without reuse, 128 tokens cached. Returns the engine whose
    tiers went to disk (before the restart)."""
    first = greedy_request("t1", prompt(100, seed=31), 60)
    history = first.prompt_token_ids + generate(make_engine(core, max_concurrency=2), [first])["t1"]
    second = greedy_request("t2", history + prompt(30, seed=32), 16)
    want = generate(make_engine(core, max_concurrency=2), [second])["t2"]  # no reuse at all

    def conversation(num_fillers: int, disk: Path) -> EngineCore:
        """t1, then unrelated requests: their checkpoints evict t1's from the GPU slot into DRAM, then onto disk;
        their pages push t1's out of the 48-page pool, through the 8 host pages, onto disk."""
        engine = tiered_engine(core, disk)
        run_collecting(engine, first)
        for i in range(num_fillers):
            run_collecting(engine, greedy_request(f"f{i}", prompt(150, seed=40 + i), 40))
        return engine

    from helios.engine.prefix_cache import extend_page_hashes

    hashes: list[bytes] = []
    extend_page_hashes(hashes, history, PAGE_SIZE, 128 // PAGE_SIZE)
    at_128 = hashes[-1]  # the name of t1's checkpoint at 128
    engine = conversation(1, tmp_path / "dram")
    state_host = engine.scheduler.state_host
    assert at_128 not in engine.scheduler.checkpoints.slots and state_host.find_prefix([at_128])  # in DRAM
    assert run_collecting(engine, second) == (want, 128)
    lookups = engine.metrics().host_missing_tokens
    assert lookups.count >= 1 and lookups.sum > 0  # every admission past the GPU is observed
    engine = conversation(6, tmp_path / "disk")
    sched = engine.scheduler
    assert not sched.state_host.find_prefix([at_128]) and sched.state_host.find_tiered_prefix([at_128]) == [None]
    assert sched.host_cache.num_disk_records >= 8  # on disk, and pages too
    assert run_collecting(engine, second) == (want, 128)
    restarted = tiered_engine(core, tmp_path / "disk")  # a new process: nothing on the GPU or in DRAM
    assert run_collecting(restarted, greedy_request("t2", second.prompt_token_ids, 16)) == (want, 128)
    return engine
