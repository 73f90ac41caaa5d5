"""The host tier's disk records through the real runner: records pushed out of a tiny DRAM store are written to a
directory, loaded back into slots and copied into pages, and give exactly the tokens and logprobs of a run that
never evicted them; a new engine on the same directory serves the prompt from disk on its first request. On a tiny
llama (torch attention) and the DiskKVStore alone.
"""

from __future__ import annotations

import pytest
import torch

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.runner.disk_cache import DiskKVStore, record_dir
from helios.runner.host_cache import HostKVStore
from helios.runner.kv_cache import KVCache
from helios.runner.model_runner import ModelRunner
from tests.models.test_parity import export_tiny
from tests.runner.test_host_cache_runner import MAX_MODEL_LEN, PAGE_SIZE, waves
from tests.runner.test_prefix_cache_runner import Recorder, assert_same_tokens, run_in_waves


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return export_tiny("llama", tmp_path_factory.mktemp("llama-disk"))[1]


def engine(core, num_pages: int, host_cache_pages: int = 0, disk_dir=None, host_disk_pages: int = 64) -> EngineCore:
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages, PAGE_SIZE, dtype=torch.float32,
                         attention_backend="torch", max_model_len=MAX_MODEL_LEN, host_cache_pages=host_cache_pages,
                         host_disk_dir=disk_dir)
    config = SchedulerConfig(max_concurrency=2, max_num_batched_tokens=64, prefill_chunk_size=64,
                             page_size=PAGE_SIZE, num_pages=num_pages, max_model_len=MAX_MODEL_LEN,
                             host_cache_pages=host_cache_pages, host_disk_pages=host_disk_pages if disk_dir else 0,
                             page_bytes=KVCache.bytes_per_page(core.manifest.arch, PAGE_SIZE, torch.float32))
    records = runner.disk_store.list_records() if runner.disk_store is not None else []
    return EngineCore(config, Recorder(runner), records)


def first_plan(engine: EngineCore, req_id: str):
    return next(p for p in engine.runner.plans if any(n.req_id == req_id for n in p.new_requests))


def test_records_from_disk_give_the_tokens_of_a_run_without_eviction(llama, tmp_path):
    off = run_in_waves(engine(llama, num_pages=64), waves())
    assert off["a2"][1] == 20
    # 6 DRAM records: a's 5 pages are pushed out by the others' 15, onto disk
    small = engine(llama, num_pages=12, host_cache_pages=6, disk_dir=tmp_path)
    on = run_in_waves(small, waves())
    assert_same_tokens(on, off)
    assert on["a2"][0] == on["a1"][0] and on["a2"][1] == 20
    plan = first_plan(small, "a2")
    assert len(plan.copy_in) == 5 and plan.load and plan.spill is not None
    m = small.metrics()
    assert m.host_disk_records == len(list(tmp_path.iterdir())) > 0

    # a new engine on the directory: a's first request is served from its records
    again = engine(llama, num_pages=12, host_cache_pages=6, disk_dir=tmp_path)
    assert again.metrics().host_disk_records == m.host_disk_records
    first = run_in_waves(again, waves(others=False, again=False)[:1])
    assert first["a1"][1] == 20 and len(first_plan(again, "a1").load) == 5
    assert_same_tokens(first, {"a1": off["a1"]})


def test_disk_store_writes_lists_and_loads_records(tmp_path):
    kv = KVCache(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    host = HostKVStore(kv, num_slots=3)
    for layer in host.layers:
        layer.copy_(torch.randn_like(layer, dtype=torch.float32).to(torch.bfloat16))
    before = [layer.clone() for layer in host.layers]
    disk = DiskKVStore(tmp_path, host)
    h = [bytes([i]) * 32 for i in range(3)]
    disk.spill([(0, h[0]), (2, h[1])])
    (tmp_path / "notes.txt").write_text("not a record")
    (tmp_path / ("ab" * 32)).write_bytes(b"short")  # a record's name, the wrong size
    assert disk.list_records() == [h[0], h[1]] and not list(tmp_path.glob(".*.tmp"))
    disk.load([(h[1], 1), (h[0], 2)])
    for old, new in zip(before, host.layers):
        assert torch.equal(new[:, 1], old[:, 2]) and torch.equal(new[:, 2], old[:, 0])
    disk.drop([h[0], h[2]])
    assert disk.list_records() == [h[1]]
    with pytest.raises(OSError):
        disk.load([(h[0], 0)])


def test_record_dir_names_the_kv_identity(llama, tmp_path):
    m = llama.manifest
    base = record_dir(tmp_path, m, torch.float32, 16)
    assert base == record_dir(tmp_path, m, torch.float32, 16) and base.parent == tmp_path
    assert base != record_dir(tmp_path, m, torch.bfloat16, 16) != record_dir(tmp_path, m, torch.float32, 32)
