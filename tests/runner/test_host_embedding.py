"""Host embedding tables (helios/runner/host_embedding.py) on the CPU: gemma4's PLE table and qwen4_exp's hashed
n-gram tables left in the core's mmap behind a small row cache (the "device" a CPU tensor) give bit-identical logits
and greedy tokens to the bound tables, with evictions; the row-cache counters add up; a served core reports them in
/metrics (JSON and Prometheus)."""

from __future__ import annotations

import httpx
import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.runner.host_embedding import HostRows
from helios.runner.model_runner import ModelRunner
from tests.models.gemma4_tiny import build_gemma4
from tests.models.hybrid_harness import generate, greedy_request, prompt, window_engine
from tests.models.qwen4_exp_tiny import build_qwen4_exp
from tests.server.conftest import _stop, serve_core

PAGE, CHUNK, NUM_PAGES = 16, 8, 64


def export(src, out):
    """ignition's float32 export of src: the core's directory (the served test serves it)."""
    from ignition.export import ExportOptions, export_core

    return export_core(src, out, ExportOptions(dtype="float32"))


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return export(build_gemma4(root / "hf", "base"), root / "core")


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4")
    return export(build_qwen4_exp("ple", root / "hf"), root / "core")


def runner(core, cache_rows: int = 0, **options) -> ModelRunner:
    """A CPU runner of the core: the bound tables, or (cache_rows > 0) the family's host tables behind caches of
    cache_rows rows."""
    host = dict(host_embeddings="on", host_embedding_rows=cache_rows) if cache_rows else {}
    return ModelRunner(core.manifest.arch, core.tensors, NUM_PAGES, PAGE, num_state_slots=1, **host, **options)


def rows_looked_up(host: ModelRunner, ids: list[int], name: str) -> int:
    """Rows of table `name` that forward_logits(ids, CHUNK) looks up: the distinct ones of each chunk, from the
    family's rule (with the n-gram context before each chunk: pad ids, then the tokens before it)."""
    total, context = 0, host.context_tokens
    for start in range(0, len(ids), CHUNK):
        chunk, before = ids[start : start + CHUNK], None
        if context is not None:
            count, pad_id = context
            before = torch.tensor([([pad_id] * count + ids[:start])[-count:]])
        total += torch.unique(host.host_embeddings.rows_of(torch.tensor(chunk), before, [0, len(chunk)])[name]).numel()
    return total


def check_host_path(core, cache_rows: int, ids: list[int]) -> None:
    """forward_logits with host tables = with bound tables, bit for bit, through caches small enough to evict; the
    counters: hits + misses = rows looked up, bytes = misses * row bytes, every miss past the first fill evicts."""
    bound, host = runner(core), runner(core, cache_rows)
    names = list(host.host_embeddings.tables)
    assert names and not any(n in dict(host.model.named_parameters()) for n in names)
    assert all(isinstance(host.model.get_submodule(n.removesuffix(".weight")), HostRows) for n in names)
    assert torch.equal(host.forward_logits(ids, CHUNK), bound.forward_logits(ids, CHUNK))
    stats = host.stats()
    for name, table in host.host_embeddings.tables.items():
        assert table.num_hits + table.num_misses == rows_looked_up(host, ids, name)
        assert table.num_bytes == table.num_misses * table.width * 4  # float32 rows
        assert table.num_evictions == table.num_misses - table.cache_rows > 0, (table.num_misses, table.cache_rows)
    tables = host.host_embeddings.tables.values()
    assert stats.embedding_row_cache_misses == sum(t.num_misses for t in tables)
    assert stats.embedding_row_cache_bytes == sum(t.num_bytes for t in tables) > 0
    assert stats.replay_readiness_samples == len(range(0, len(ids), CHUNK))
    assert stats.replay_readiness_wait_ns > 0


def test_gemma4_ple_from_the_host_gives_the_bound_tables_logits(gemma4_dir):
    core = load_core(gemma4_dir)
    check_host_path(core, 12, prompt(72, seed=3))


def test_gemma4_greedy_tokens_with_evictions_equal_the_bound_tables(gemma4_dir):
    """4 requests batched (8-token chunks beside decodes, 20 tokens a step) through a 24-row cache."""
    core = load_core(gemma4_dir)
    reqs = [greedy_request(f"r{i}", prompt(9 + 7 * i, seed=20 + i), 8) for i in range(4)]
    bound = window_engine(core, 4, NUM_PAGES, CHUNK, 20, page_size=PAGE)
    host = window_engine(core, 4, NUM_PAGES, CHUNK, 20, page_size=PAGE, host_embeddings="on", host_embedding_rows=24)
    assert generate(host, reqs) == generate(bound, reqs)
    metrics = host.metrics()
    assert metrics.embedding_row_cache_evictions > 0 and metrics.replay_readiness_samples > 0
    assert metrics.embedding_row_cache_bytes == metrics.embedding_row_cache_misses * 6 * 8 * 4  # [L*P] float32 rows


def test_qwen4_exp_hashed_ple_from_the_host_gives_the_bound_tables_logits(qwen4_dir):
    core = load_core(qwen4_dir)
    ple = core.manifest.arch.ple
    ids = prompt(24, seed=4)
    ids[11] = ids[12] = core.manifest.arch.ple.reset_token_id  # the n-gram context restarts
    rows_per_chunk = CHUNK * (ple.ngram_size - 1) * ple.heads_per_ngram
    check_host_path(core, rows_per_chunk + 8, ids)


def test_a_served_core_reports_the_row_cache_in_metrics(gemma4_dir, tmp_path):
    config = tmp_path / "helios.toml"
    config.write_text('[server]\nmax_concurrency = 2\nhost_embeddings = "on"\n', encoding="utf-8")
    proc, url = serve_core(gemma4_dir, config, tmp_path / "serve.log")
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "the cat sat on the mat", "max_tokens": 4, "temperature": 0}
        for _ in range(2):  # the second one's rows are resident: hits
            assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
        snap = httpx.get(url + "/metrics?format=json").json()
        text = httpx.get(url + "/metrics").text
    finally:
        _stop(proc)
    misses, hits = snap["embedding_row_cache_misses"], snap["embedding_row_cache_hits"]
    assert misses > 0 and hits > 0 and snap["embedding_row_cache_bytes"] == misses * 6 * 8 * 4
    assert snap["replay_readiness_samples"] >= 4 and snap["replay_readiness_wait_ns"] > 0
    for name, value in (("hits", hits), ("misses", misses), ("evictions", 0)):
        assert f"flare_embedding_row_cache_{name}_total {float(value)}" in text
    assert "flare_replay_readiness_samples_total" in text


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs the Triton interpreter")
def test_speculative_decode_steps_keep_the_bound_tables_tokens(gemma4_dir):
    """Decode overlap on graphed decode steps (GraphRunner(capture=False): the graph's function run eagerly, Triton
    attention in the interpreter) through a 16-row cache: a speculative step whose sampled ids were resident is kept,
    one that read an absent row is dropped and rerun; the tokens are the bound table's without overlap."""
    core = load_core(gemma4_dir)
    arch = core.manifest.arch
    reqs = [greedy_request(f"r{i}", prompt(6 + 3 * i, seed=30 + i), 10) for i in range(2)]

    def drive(overlap: bool, **host):
        runner = ModelRunner(arch, core.tensors, NUM_PAGES, PAGE, attention_backend="triton",
                             max_model_len=NUM_PAGES * PAGE, decode_overlap=overlap, **host)
        runner.graphs = runner.make_graphs([1, 2], capture=False)
        config = SchedulerConfig(max_concurrency=2, max_num_batched_tokens=16, prefill_chunk_size=CHUNK,
                                 page_size=PAGE, num_pages=NUM_PAGES, max_model_len=NUM_PAGES * PAGE)
        return generate(EngineCore(config, runner), reqs), runner

    got, runner = drive(True, host_embeddings="on", host_embedding_rows=16)
    assert got == drive(False)[0]
    assert runner.overlap_hits > 0 and runner.overlap_misses > 0, (runner.overlap_hits, runner.overlap_misses)
