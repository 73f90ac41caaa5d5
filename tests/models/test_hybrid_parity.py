"""Parity of the hybrid families (gated delta rule + gated attention: qwen3_5, qwen3_5_moe, qwen3_next) against
HF transformers on tiny random checkpoints, through the real path: an HF directory, ignition's float32 export,
helios.core.load, the ModelRunner with its paged KV and state slots, and the engine (state slots, chunked
prefill on the recurrent grid)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineRequest, SamplingParams
from helios.runner.model_runner import ModelRunner
from tests.models.hybrid_tiny import HYBRID_FAMILIES, build_hybrid

PAGE_SIZE = 16


def export_hybrid(family: str, root: Path, dtype: str = "float32"):
    """(HF model, LoadedCore) of the family's tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_hybrid(family, root / "hf")
    core = load_core(export_core(src, root / "core", ExportOptions(dtype=dtype, prompt_logprobs=True)))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return hf, core


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid(request, tmp_path_factory):
    hf, core = export_hybrid(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def make_engine(core, max_concurrency: int = 16, num_pages: int = 256, chunk: int = 64,
                budget: int = 128, checkpoints: int = 0) -> EngineCore:
    """checkpoints: state checkpoint slots (prefix reuse through them); 0: no prefix cache."""
    from helios.runner.state_cache import StateCache

    arch = core.manifest.arch
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget,
                             prefill_chunk_size=chunk, page_size=PAGE_SIZE, num_pages=num_pages,
                             max_model_len=num_pages * PAGE_SIZE, num_state_slots=max_concurrency,
                             state_chunk=arch.recurrent.chunk_size, enable_prefix_caching=checkpoints > 0,
                             state_checkpoint_slots=checkpoints,
                             state_slot_bytes=StateCache.bytes_per_slot(arch, core.tensors["embed.weight"].dtype))
    runner = ModelRunner(arch, core.tensors, num_pages, PAGE_SIZE, num_state_slots=max_concurrency + checkpoints)
    return EngineCore(config, runner)


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


def test_the_export_is_hybrid(hybrid):
    family, hf, core = hybrid
    arch = core.manifest.arch
    assert arch.family == family and arch.layer_types == ["linear", "linear", "linear", "full"]
    assert arch.recurrent.kind == "gated_delta" and arch.attn_output_gate and arch.rotary_dim == 4


def test_logits_and_prompt_logprobs_match(hybrid):
    _, hf, core = hybrid
    runner = ModelRunner(core.manifest.arch, core.tensors, 64, PAGE_SIZE, num_state_slots=1)
    ids = prompt(150)
    ref = hf_logits(hf, ids)
    whole = runner.forward_logits(ids)
    torch.testing.assert_close(whole[-1], ref[-1], atol=1e-4, rtol=0)
    # chunks on the recurrent grid (64) carry the state: the same rows as the whole prompt
    chunked = runner.forward_logits(ids, chunk_size=64)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), torch.log_softmax(ref, -1), atol=1e-4, rtol=0)


def test_greedy_matches_generate(hybrid):
    _, hf, core = hybrid
    ids, num_new = prompt(90, seed=5), 32
    got = generate(make_engine(core, chunk=64), [greedy_request("a", ids, num_new)])["a"]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


def test_sixteen_requests_together_give_what_each_gives_alone(hybrid):
    _, _, core = hybrid
    reqs = [greedy_request(f"r{i}", prompt(7 + 23 * i, seed=10 + i), 12) for i in range(16)]
    # a budget of 128 tokens: prompts up to 352 tokens split into grid chunks beside the others' decodes
    together = generate(make_engine(core, budget=128), reqs)
    for r in reqs:
        alone = generate(make_engine(core, max_concurrency=1, budget=512, chunk=512), [r])[r.req_id]
        assert together[r.req_id] == alone, r.req_id


def test_a_second_turn_reuses_the_first_turns_state(hybrid):
    _, _, core = hybrid
    engine = make_engine(core, max_concurrency=4, checkpoints=2)
    first = greedy_request("t1", prompt(100, seed=21), 60)  # its decode passes 128: the endpoint checkpoint
    history = first.prompt_token_ids + generate(engine, [first])["t1"]
    second = greedy_request("t2", history + prompt(30, seed=22), 16)
    outputs = []
    engine.add_request(second)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].num_cached_tokens == 128
    reused = [t for o in outputs for t in o.new_token_ids]
    assert reused == generate(make_engine(core, max_concurrency=4), [second])["t2"]  # exactly the run without reuse
    metrics = engine.metrics()
    assert metrics.checkpoint_captures["endpoint"] >= 2 and metrics.reused_tokens == 128


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


def test_a_checkpoint_comes_back_from_host_dram_and_disk_and_after_a_restart(hybrid, tmp_path):
    family, _, core = hybrid
    if family != "qwen3_5":
        pytest.skip("the tiers are the engine's and runner's, not a family's: one family covers them")
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
    del engine, sched
    restarted = tiered_engine(core, tmp_path / "disk")  # a new process: nothing on the GPU or in DRAM
    assert run_collecting(restarted, greedy_request("t2", second.prompt_token_ids, 16)) == (want, 128)
