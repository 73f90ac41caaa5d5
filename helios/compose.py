"""The composition root: `helios serve` builds core -> runner -> engine -> app here, and nowhere else.

Owns the one place a ModelRunner is constructed for serving, the constraint owner handed to the engine core, the
start-up split the ready line reports (read from the runner it built), the warm-up request, and the in-process
HTTP server (Granian's embedded server on this process's asyncio loop: one process owns the engine). Settings
travel as arguments (a ServerConfig with the CLI's overrides, the execution Switches the CLI read once), never
through environment variables.
Imports torch only inside functions (through helios.runner), so `helios top` and config checks stay light.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

from helios.server.app import HeliosApp
from helios.server.config import ServerConfig
from helios.server.runtime import Runtime, Serving, resolve_serving
from helios.switches import DEFAULT_SWITCHES, Switches

logger = logging.getLogger("helios.server")


def build_engine(core, config: ServerConfig, serving: Serving, constraints=None,
                 switches: Switches = DEFAULT_SWITCHES):
    """Runner + scheduler + engine thread for a loaded core; returns (AsyncEngine, ModelRunner).
    constraints: structured output's grammar owner (helios/frontend/constraints.py); switches: the execution
    switches, handed to the runner."""
    from helios.engine.async_engine import AsyncEngine
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore
    from helios.runner.disk_cache import record_dir
    from helios.runner.kv_cache import KVCache
    from helios.runner.model_runner import ModelRunner, resolve_device

    page_size = core.manifest.graph_plan.page_size
    dtype = core.tensors["embed.weight"].dtype  # the runner's default: the KV pages take the weights' dtype
    page_bytes = KVCache.bytes_per_page(core.manifest.arch, page_size, dtype)
    # the prefix cache's host DRAM tier: whole pages only; nothing without the prefix cache it stands behind
    host_cache_pages = config.host_cache_bytes // page_bytes if config.prefix_caching else 0
    # its disk tier: only behind the DRAM tier; one subdirectory per KV identity (runner/disk_cache.py)
    host_disk_pages = config.host_disk_bytes // page_bytes if host_cache_pages and config.host_disk_dir else 0
    host_disk_dir = record_dir(config.host_disk_dir, core.manifest, dtype, page_size) if host_disk_pages else None
    if resolve_device(config.device) == "cuda":
        # KV pool from free GPU memory after the weights; CUDA graphs per decode bucket of the plan
        runner = ModelRunner.from_core(core, device="cuda", num_pages=None, max_model_len=serving.max_model_len,
                                       dtype=dtype, host_cache_pages=host_cache_pages, host_disk_dir=host_disk_dir,
                                       switches=switches)
        num_pages = runner.num_pages
    else:
        num_pages = -(-max(config.kv_cache_tokens, serving.max_model_len) // page_size)
        runner = ModelRunner(core.manifest.arch, core.tensors, num_pages, page_size, dtype=dtype,
                             host_cache_pages=host_cache_pages, host_disk_dir=host_disk_dir, switches=switches)
    scheduler = SchedulerConfig(
        max_concurrency=serving.max_concurrency,
        max_num_batched_tokens=max(config.max_num_batched_tokens, serving.max_concurrency),
        prefill_chunk_size=serving.prefill_chunk_size,
        max_waiting=serving.max_waiting,
        page_size=page_size,
        num_pages=num_pages,
        max_model_len=serving.max_model_len,
        enable_prefix_caching=config.prefix_caching,
        host_cache_pages=host_cache_pages,
        host_disk_pages=host_disk_pages,
        page_bytes=page_bytes,
    )
    disk_records = runner.disk_store.list_records() if runner.disk_store is not None else []
    return AsyncEngine(EngineCore(scheduler, runner, disk_records, constraints=constraints)), runner


def build_runtime(core_path: Path, config: ServerConfig, switches: Switches = DEFAULT_SWITCHES) -> Runtime:
    """Load and verify the core, build the engine; records the start-up split in runtime.timings. The core's
    digests are checked on background threads while the engine builds (the weights upload, kernel load and graph
    capture): a mismatch fails the start-up before anything is served."""
    from helios.core.load import load_core, start_digest_check
    from helios.frontend.constraints import GrammarConstraints
    from helios.frontend.tokenizer import Tokenizer

    t0 = time.perf_counter()
    core = load_core(Path(core_path), verify_digests=False)
    digests_match = start_digest_check(core.path, core.manifest)
    manifest = core.manifest
    tokenizer = Tokenizer.from_file(core.tokenizer_path, manifest.tokenizer, manifest.arch.vocab_size)
    serving = resolve_serving(manifest, config)
    # the runtime first: its structured-output compiler validates grammars and feeds the engine's constraint owner
    runtime = Runtime(manifest, tokenizer, core.template_source, None, config, serving)
    t1 = time.perf_counter()
    try:
        constraints = GrammarConstraints(runtime.output_grammars.matcher)
        runtime.engine, runner = build_engine(core, config, serving, constraints, switches)
        t2 = time.perf_counter()
        digests_match()
    except Exception:
        runtime.shutdown()
        raise
    t3 = time.perf_counter()
    runtime.timings["load"] = time.perf_counter() - t0
    # the runner's own split (weights to the device, kernel load, KV allocation, graph capture)
    st = runner.startup
    runtime.timings.update(open=t1 - t0, weights=st.load_s, kernels=st.kernels_s, kernels_wait=st.kernels_wait_s,
                           kv=st.kv_alloc_s, capture=st.capture_s, graphs=st.num_graphs, kernels_jit=st.kernels_jit,
                           verify=t3 - t2)
    return runtime


async def warm_up(runtime: Runtime) -> None:
    """One tiny request through the whole engine path, so the first client does not pay for it."""
    from helios.engine.messages import EngineRequest, SamplingParams

    t0 = time.perf_counter()
    bos = runtime.manifest.tokenizer.bos_token_id
    prompt = [bos if bos is not None else 0] * 2
    stream = await runtime.engine.submit(
        EngineRequest(req_id="warmup", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=2, logprobs=1))
    )
    async for _ in stream:
        pass
    runtime.timings["warmup"] = time.perf_counter() - t0
    # structured output's vocabulary (~0.3 s for 49k tokens, more for larger ones) off the start-up path
    runtime.pool.submit(runtime.output_grammars.prepare)


def build_app(core_path: Path, config: ServerConfig, switches: Switches = DEFAULT_SWITCHES) -> HeliosApp:
    """The app whose lifespan start-up builds the runtime (off the event loop) and warms it up; its ready line
    lists the switches."""
    return HeliosApp(lambda: build_runtime(Path(core_path), config, switches), warm_up=warm_up,
                     announce=f"http://{config.host}:{config.port}", settings=switches.describe())


def serve(core_path: Path, config: ServerConfig, switches: Switches = DEFAULT_SWITCHES,
          log_level: str = "warning") -> int:
    """Serve until SIGINT or SIGTERM in this process; the exit status (1 when the start-up failed)."""
    app = build_app(core_path, config, switches)
    return asyncio.run(_serve(app, config, log_level))


class _QuietStartupFailure(logging.Filter):
    """Granian's own lines around a failed start-up (the message again, a traceback, the worker's exit) and its
    embedded-mode notice: the app already said what failed, in one line."""

    _DROPPED = ("Embedded server is experimental", "ASGI lifespan startup failed", "Unexpected exit from worker")

    def __init__(self, app: HeliosApp) -> None:
        super().__init__()
        self._app = app

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return message != self._app.startup_error and not any(message.startswith(t) for t in self._DROPPED)


async def _serve(app: HeliosApp, config: ServerConfig, log_level: str) -> int:
    from granian.constants import Interfaces
    from granian.errors import FatalError
    from granian.log import LogLevels
    from granian.server.embed import Server

    # NOTE: Granian's embedded server runs the ASGI app on this loop (lifespan, then HTTP); one worker, so the
    # engine (and its KV pool) lives in exactly this process
    server = Server(app, address=config.host, port=config.port, interface=Interfaces.ASGI, websockets=False,
                    log_level=LogLevels(log_level), log_access=False)
    logging.getLogger("_granian").addFilter(_QuietStartupFailure(app))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    try:
        await server.serve()
    except FatalError:
        if app.startup_error is None:  # NOTE: a failed lifespan start-up is the only fatal error we expect
            raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        app.shutdown()  # the lifespan shutdown does not run after a failed start-up
    return 1 if app.startup_error is not None else 0
