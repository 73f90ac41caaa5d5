"""helios.kernels.fla_tuning on fla's real autotuners (imported, never launched: no GPU here): a table's entries go
into the caches of the kernels they name, a snapshot reads them back, the tables are chosen by device name."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fla")

from helios.kernels import fla_tuning  # noqa: E402

KERNEL = "fla.ops.common.chunk_h.chunk_fwd_kernel_h"


@pytest.fixture
def tuner():
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.kda  # noqa: F401

    tuners = fla_tuning.autotuners()
    assert KERNEL in tuners, sorted(tuners)[:20]
    tuner = tuners[KERNEL]
    saved = dict(tuner.cache)
    tuner.cache.clear()
    yield tuner
    tuner.cache.clear()
    tuner.cache.update(saved)


def entry(tuner, key, index=0, **kwargs):
    config = tuner.configs[index]
    return {"kernel": KERNEL, "key": list(key),
            "config": {"kwargs": {**config.kwargs, **kwargs}, "num_warps": config.num_warps,
                       "num_stages": config.num_stages}}


def test_seed_fills_the_named_kernels_cache_and_snapshot_reads_it_back(tuner):
    key = (64, True, False, False, False, 128, 128, "torch.bfloat16", "torch.bfloat16")
    wanted = entry(tuner, key, index=5)
    assert fla_tuning.seed([wanted, {**wanted, "kernel": "fla.no_such.kernel"}]) == 1
    chosen = tuner.cache[key]
    assert (chosen.kwargs, chosen.num_warps, chosen.num_stages) == (
        tuner.configs[5].kwargs, tuner.configs[5].num_warps, tuner.configs[5].num_stages)
    mine = [e for e in fla_tuning.snapshot() if e["kernel"] == KERNEL]
    assert len(mine) == 1 and mine[0]["key"] == list(key)
    assert mine[0]["config"]["kwargs"] == wanted["config"]["kwargs"]
    assert mine[0]["config"]["num_warps"] == wanted["config"]["num_warps"]
    # a key the cache holds keeps its own choice; a config naming a parameter the kernel lacks is skipped
    assert fla_tuning.seed([entry(tuner, key, index=0)]) == 0
    assert tuner.cache[key] is chosen
    assert fla_tuning.seed([entry(tuner, (1, 2), NO_SUCH_PARAMETER=4)]) == 0
    assert (1, 2) not in tuner.cache


def test_tables_by_device_name(tuner, tmp_path, monkeypatch):
    assert fla_tuning.device_slug("NVIDIA H200") == "nvidia_h200"
    key = (64, True, False, False, False, 128, 128, "torch.bfloat16", "torch.bfloat16")
    fla_tuning.seed([entry(tuner, key, index=2)])
    monkeypatch.setattr(fla_tuning, "TABLES", tmp_path)
    n = fla_tuning.dump(tmp_path / "fla_nvidia_h200.json", "NVIDIA H200", {"fla-core": "0.6.0"})
    first = (tmp_path / "fla_nvidia_h200.json").read_bytes()
    assert n >= 1 and json.loads(first)["device"] == "NVIDIA H200"
    fla_tuning.dump(tmp_path / "fla_nvidia_h200.json", "NVIDIA H200", {"fla-core": "0.6.0"})
    assert (tmp_path / "fla_nvidia_h200.json").read_bytes() == first  # the same caches, the same bytes
    assert fla_tuning.table_for("NVIDIA H100 80GB HBM3") == []
    tuner.cache.clear()
    assert fla_tuning.seed_for_device("NVIDIA H200") == n
    assert key in tuner.cache and tuner.cache[key].kwargs == tuner.configs[2].kwargs
