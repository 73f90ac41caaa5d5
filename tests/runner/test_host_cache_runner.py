"""The prefix cache's host DRAM tier through the real runner: pages evicted from a small KV pool are copied out
to host records and copied back into other pages, and the repeated prompt gives exactly the tokens and logprobs
of a run that never evicted it. On a tiny llama (torch attention; with the Triton interpreter also the decode
graphs and the speculative next step) and the HostKVStore copies alone.
"""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.engine.messages import EngineRequest
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.host_cache import HostKVStore
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.engine_harness import greedy
from tests.models.test_parity import export_tiny, prompt
from tests.runner.test_prefix_cache_runner import Recorder, assert_same_tokens, run_in_waves

PAGE_SIZE = 4
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return export_tiny("llama", tmp_path_factory.mktemp("llama-host"))[1]


def engine(core, num_pages: int, host_cache_pages: int, graphed: bool = False, device: str = "cpu") -> EngineCore:
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages, PAGE_SIZE, device=device, dtype=torch.float32,
                         attention_backend="triton" if graphed else "torch", max_model_len=MAX_MODEL_LEN,
                         decode_overlap=graphed, host_cache_pages=host_cache_pages)
    if graphed and device == "cpu":  # the captured function run eagerly: the graph path without CUDA
        runner.graphs = runner.make_graphs([1, 2, 4], capture=False)
    page_bytes = KVCache.bytes_per_page(core.manifest.arch, PAGE_SIZE, torch.float32)
    config = SchedulerConfig(max_concurrency=2, max_num_batched_tokens=64, prefill_chunk_size=64,
                             page_size=PAGE_SIZE, num_pages=num_pages, max_model_len=MAX_MODEL_LEN,
                             host_cache_pages=host_cache_pages, page_bytes=page_bytes)
    return EngineCore(config, Recorder(runner))


def waves(n: int = 8, others: bool = True, again: bool = True) -> list[list[EngineRequest]]:
    a = prompt(21, seed=3)  # 5 full pages can be reused

    def req(req_id, ids, **sampling):
        return EngineRequest(req_id=req_id, prompt_token_ids=ids, sampling=greedy(n, **sampling))

    # three other prompts, one at a time, evict every page of a from a 12-page pool; then a again, beside another
    evict = [[req(f"o{i}", prompt(21, seed=10 + i))] for i in range(3)] if others else []
    # then the others again: a2's fresh pages evicted some of theirs in the plan that restored a (copied out
    # before a's records were copied in over them)
    back = [[req(f"o{i}again", prompt(21, seed=10 + i), logprobs=2)] for i in range(3)] if again else []
    return [[req("a1", a, logprobs=2)]] + evict + [[req("a2", a, logprobs=2), req("b", prompt(9, seed=20))]] + back


@pytest.mark.parametrize("graphed", [False, True])
def test_restored_pages_give_the_tokens_of_a_run_without_eviction(llama, graphed):
    if graphed and not (HAS_TRITON and interpret_mode()):
        pytest.skip("needs the Triton interpreter")
    check_restored_pages(llama, graphed, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or interpret_mode(), reason="needs CUDA")
def test_restored_pages_on_cuda_with_real_graphs(llama):
    """Pinned host records, asynchronous copies on the stream of the captured graphs and the speculative step."""
    assert check_restored_pages(llama, True, "cuda").runner.runner.host_store.layers[0].is_pinned()


def check_restored_pages(llama, graphed: bool, device: str) -> EngineCore:
    n = 4 if graphed and device == "cpu" else 8  # the interpreter is slow: fewer decode steps
    # the reference: a roomy pool keeps a's pages on the GPU (the other prompts' tokens are checked when not graphed)
    full = not graphed or device == "cuda"
    off = run_in_waves(engine(llama, num_pages=64, host_cache_pages=0, graphed=graphed, device=device),
                       waves(n, full, full))
    assert off["a2"][1] == 20
    small = engine(llama, num_pages=12, host_cache_pages=32, graphed=graphed, device=device)
    on = run_in_waves(small, waves(n, True, full))
    assert_same_tokens(on, off)
    assert on["a2"][0] == on["a1"][0] and on["a2"][1] == 20
    plan = next(p for p in small.runner.plans if any(n.req_id == "a2" for n in p.new_requests))
    assert len(plan.copy_in) == 5 and plan.copy_out  # every reused page came from the host store
    m = small.metrics()
    page_bytes = small.config.page_bytes
    assert m.host_bytes_in == m.host_reused_tokens // PAGE_SIZE * page_bytes and m.host_memory_records > 0
    assert m.host_bytes_out >= 5 * page_bytes and m.host_reused_tokens >= 20 and m.host_hits >= 1
    if full:  # the others came back from the host store too
        assert m.host_hits == 4 and all(on[f"o{i}again"][1] == 20 for i in range(3))
    if graphed:
        assert small.runner.runner.overlap_hits > 0
    else:  # without the tier the small pool recomputes a
        assert run_in_waves(engine(llama, num_pages=12, host_cache_pages=0), waves())["a2"][1] == 0
    return small


def test_host_store_copies_pages_out_and_back():
    kv = KVCache(num_layers=2, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8)
    for layer in kv.layers:
        layer.copy_(torch.randn_like(layer))
    before = [layer.clone() for layer in kv.layers]
    store = HostKVStore(kv, num_slots=4)
    store.copy_out(kv, [(1, 3), (2, 0), (4, 1)])
    for layer in kv.layers:
        layer[:, [1, 2, 4]] = 0
    store.copy_in(kv, [(0, 5), (3, 0), (1, 2)])
    for old, new in zip(before, kv.layers):
        assert torch.equal(new[:, 5], old[:, 2]) and torch.equal(new[:, 0], old[:, 1])
        assert torch.equal(new[:, 2], old[:, 4]) and torch.equal(new[:, 3], old[:, 3])
        assert not new[:, [1, 4]].any()
