"""The composition root: `helios serve` builds core -> runner -> engine -> app here, and nowhere else.

Owns the one place a ModelRunner is constructed for serving, the constraint owner handed to the engine core, the
start-up split the ready line reports (read from the runner it built), the warm-up request, and the processes:
this one owns the engine and serves it on a Unix socket (helios/engine/remote.py); HTTP processes run Granian's
embedded server on the one port, each with its own tokenizer, templates and an EngineClient. Settings
travel as arguments (a ServerConfig with the CLI's overrides, the execution Switches the CLI read once), never
through environment variables.
Imports torch only inside functions (through helios.runner), so `helios top` and config checks stay light, and
`serve` starts the HTTP processes before this process imports it. Nor does it import the app (each protocol's
module): the HTTP processes do.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from helios.engine.remote import EngineServer
from helios.server.config import KVEventsConfig, ServerConfig
from helios.server.runtime import Runtime, Serving, resolve_serving
from helios.server.startup import Timeline, ready_line
from helios.switches import DEFAULT_SWITCHES, Switches

if TYPE_CHECKING:
    from helios.server.app import HeliosApp

logger = logging.getLogger("helios.server")


def build_engine(core, config: ServerConfig, serving: Serving, constraints=None,
                 switches: Switches = DEFAULT_SWITCHES, own_thread: bool = True):
    """Runner + scheduler + engine for a loaded core; returns (AsyncEngine, ModelRunner).
    constraints: structured output's grammar owner (helios/frontend/constraints.py); switches: the execution
    switches, handed to the runner; own_thread: the step loop on a new thread (False: the caller's run())."""
    from helios.engine.async_engine import AsyncEngine
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore
    from helios.engine.kv_groups import window_pages_per_request
    from helios.runner.disk_cache import record_dir
    from helios.runner.kv_cache import KVCache
    from helios.runner.model_runner import ModelRunner, limit_host_threads, resolve_device
    from helios.runner.state_cache import StateCache

    page_size = core.manifest.graph_plan.page_size
    dtype = core.tensors["embed.weight"].dtype  # the runner's default: the KV pages take the weights' dtype
    arch = core.manifest.arch
    page_bytes = KVCache.bytes_per_page(arch, page_size, dtype)
    # a hybrid model: a state slot per model slot, prefill chunks on the recurrent chunk grid (SchedulerConfig);
    # its prefix reuse: state checkpoints (helios/engine/state_checkpoints.py), in slots beyond the running ones
    recurrent = arch.recurrent
    num_state_slots = serving.max_concurrency if recurrent else 0
    checkpoint_slots = 0
    if recurrent and config.prefix_caching:
        checkpoint_slots = serving.max_concurrency if config.state_checkpoints < 0 else config.state_checkpoints
    state_chunk = recurrent.chunk_size if recurrent else 0
    slot_bytes = StateCache.bytes_per_slot(arch, dtype)
    prefill_chunk_size = serving.prefill_chunk_size
    if state_chunk:
        prefill_chunk_size = max(state_chunk, prefill_chunk_size - prefill_chunk_size % state_chunk)
    prefix_caching = config.prefix_caching and (not recurrent or checkpoint_slots > 0)
    # the prefix cache's host DRAM tier: whole pages only; nothing without the prefix cache it stands behind. A
    # hybrid model's tiers hold its checkpoints' state records beside the pages: half the bytes each
    host_bytes, disk_bytes = config.host_cache_bytes, config.host_disk_bytes
    # full and sliding-window layers: the window layers' pages in a group of their own (helios/engine/kv_groups.py),
    # enough for every model slot's window and chunk (so it never preempts); no host tiers or state slots beside it
    # yet (a hybrid model with sliding layers keeps one group)
    window_pages = 0
    if KVCache.window_layers(arch) and not recurrent:
        window_pages = serving.max_concurrency * window_pages_per_request(arch.sliding_window, page_size,
                                                                          prefill_chunk_size)
        host_bytes = disk_bytes = 0
    host_state_records = host_state_disk = 0
    if recurrent and prefix_caching:
        host_bytes, disk_bytes = host_bytes // 2, disk_bytes // 2
        host_state_records = host_bytes // slot_bytes
        host_state_disk = disk_bytes // slot_bytes if host_state_records and config.host_disk_dir else 0
    if config.tensor_parallel > 1:  # NOTE: no host tiers under tensor parallelism yet (each rank would hold records)
        host_bytes = disk_bytes = host_state_records = host_state_disk = 0
    host_cache_pages = host_bytes // page_bytes if prefix_caching else 0
    # its disk tier: only behind the DRAM tier; one subdirectory per KV identity (runner/disk_cache.py)
    host_disk_pages = disk_bytes // page_bytes if host_cache_pages and config.host_disk_dir else 0
    disk_base = (record_dir(config.host_disk_dir, core.manifest, dtype, page_size)
                 if host_disk_pages or host_state_disk else None)
    host_disk_dir = disk_base if host_disk_pages else None
    state_disk_dir = disk_base.with_name(disk_base.name + "-states") if host_state_disk else None
    state_args = dict(num_state_slots=num_state_slots + checkpoint_slots, host_state_records=host_state_records,
                      host_state_disk_dir=state_disk_dir, window_pages=window_pages)
    device = resolve_device(config.device)
    if config.tensor_parallel > 1:
        # rank 0 here, the other ranks in worker processes (helios/runner/parallel.py); no graphs yet; on a GPU the
        # KV pool from the free memory every rank has, on the CPU kv_cache_tokens as below
        from helios.runner.parallel import start_tensor_parallel

        num_pages = None if device == "cuda" else -(-max(config.kv_cache_tokens, serving.max_model_len) // page_size)
        runner = start_tensor_parallel(core, config.tensor_parallel, device, num_pages, page_size,
                                       max_model_len=serving.max_model_len, dtype=dtype, switches=switches,
                                       **state_args)
        num_pages = runner.num_pages
    elif device == "cuda":
        # KV pool from free GPU memory after the weights; CUDA graphs per decode bucket of the plan
        # lazy capture: the smallest and largest buckets now, the rest by the engine loop between steps
        runner = ModelRunner.from_core(core, device="cuda", num_pages=None, max_model_len=serving.max_model_len,
                                       dtype=dtype, host_cache_pages=host_cache_pages, host_disk_dir=host_disk_dir,
                                       switches=switches, lazy_capture=True, host_embeddings=config.host_embeddings,
                                       **state_args)
        # NOTE: after the load: the weights' ring fills its pinned buffers with torch's CPU copies, on the intra-op
        # pool (at one thread the 8B core's weights took 3.2-3.4 s in session 24's restarts)
        limit_host_threads(switches)
        num_pages = runner.num_pages
    else:
        num_pages = -(-max(config.kv_cache_tokens, serving.max_model_len) // page_size)
        if window_pages:  # a sizing: at most group 0's pages (each window page stands beside a group 0 one)
            window_pages = state_args["window_pages"] = max(
                window_pages_per_request(arch.sliding_window, page_size, prefill_chunk_size),
                min(window_pages, num_pages))
        runner = ModelRunner(core.manifest.arch, core.tensors, num_pages, page_size, dtype=dtype,
                             host_cache_pages=host_cache_pages, host_disk_dir=host_disk_dir, switches=switches,
                             host_embeddings=config.host_embeddings, **state_args)
    # NOTE: a runner with prompt graphs caps a step's prompt part beside decodes at what one graph holds (its time
    # bounded, its launches one replay; benchmarks/scheduler_sim.py)
    prompt_graphs = getattr(runner, "prompt_graphs", None)
    from helios.runner.prompt_graphs import ONE_PASS_PROMPT_TOKENS, PROMPT_MAX_SEQS  # torch is loaded by now

    one_pass = prompt_graphs is not None and runner.one_pass  # a runner with prompt graphs is a ModelRunner
    scheduler = SchedulerConfig(
        max_concurrency=serving.max_concurrency,
        max_num_batched_tokens=max(config.max_num_batched_tokens, serving.max_concurrency + max(state_chunk - 1, 0)),
        prefill_chunk_size=prefill_chunk_size,
        decode_stall_ratio=config.decode_stall_ratio,
        prompt_step_tokens=0 if prompt_graphs is None else prompt_graphs.buckets[-1],
        prompt_step_seqs=PROMPT_MAX_SEQS if prompt_graphs is not None else 0,
        one_pass_rows=prompt_graphs.max_seqs if one_pass else 0,
        one_pass_prompt_tokens=ONE_PASS_PROMPT_TOKENS if one_pass else 0,
        max_waiting=serving.max_waiting,
        page_size=page_size,
        num_pages=num_pages,
        max_model_len=serving.max_model_len,
        enable_prefix_caching=prefix_caching,
        num_state_slots=num_state_slots,
        state_chunk=state_chunk,
        state_checkpoint_slots=checkpoint_slots,
        state_slot_bytes=slot_bytes,
        host_state_records=host_state_records,
        host_state_disk_records=host_state_disk,
        host_cache_pages=host_cache_pages,
        host_disk_pages=host_disk_pages,
        page_bytes=page_bytes,
        sliding_window=arch.sliding_window if window_pages else 0,
        window_pages=window_pages,
    )
    disk_records = runner.disk_store.list_records() if runner.disk_store is not None else []
    state_records = runner.state_disk.list_records() if runner.state_disk is not None else []
    kv_events = start_kv_events(config.kv_events, prefix_caching)
    engine = AsyncEngine(EngineCore(scheduler, runner, disk_records, state_disk_records=state_records,
                                    constraints=constraints, kv_events=kv_events), own_thread=own_thread)
    return engine, runner


def start_kv_events(config: KVEventsConfig, prefix_caching: bool):
    """The publisher of the prefix cache's events for a router (helios/engine/kv_events.py), in this (the engine's)
    process; None when not asked for, or without a prefix cache to report on (a warning)."""
    if not config.is_publishing:
        return None
    if not prefix_caching:
        logger.warning("KV events: the prefix cache is off, so there are no events to publish")
        return None
    from helios.engine.kv_events import ZmqEventPublisher

    try:
        return ZmqEventPublisher(config.endpoint, config.replay_endpoint, config.topic, config.buffer_steps,
                                 config.hwm, config.max_queue_size)
    except ImportError:
        raise RuntimeError("KV events need pyzmq: pip install 'flare[kv-events]'") from None


def build_runtime(core_path: Path, config: ServerConfig, switches: Switches = DEFAULT_SWITCHES,
                  own_thread: bool = True, frontend: bool = True) -> Runtime:
    """Load and verify the core, build the engine; records the start-up split in runtime.timings. The core's
    digests are checked on background threads while the engine builds (the weights upload, kernel load and graph
    capture): a mismatch fails the start-up before anything is served. The rest of the Runtime (`_runtime_side`)
    is built on a thread beside the engine. frontend: False for the engine process of `helios serve`, whose HTTP
    processes hold the tokenizer and templates (Runtime.for_engine)."""
    from helios.core.load import load_core, start_digest_check
    from helios.frontend.constraints import GrammarConstraints

    t0 = time.perf_counter()
    core = load_core(Path(core_path), verify_digests=False)
    digests_match = start_digest_check(core.path, core.manifest)
    serving = resolve_serving(core.manifest, config)
    t1 = time.perf_counter()
    interval = sys.getswitchinterval()
    # NOTE: the runner's build returns to Python between torch calls (a tensor's upload, an allocation) that leave
    # the interpreter to the thread beside; a short switch interval hands it back sooner (5 ms by default: up to
    # ~20% more upload time beside a Python-bound thread)
    sys.setswitchinterval(min(interval, 0.0005))
    builder = ThreadPoolExecutor(1, thread_name_prefix="helios-runtime-side")
    side = builder.submit(_runtime_side, core, config, serving, frontend)
    builder.shutdown(wait=False)
    engine = None
    try:
        # the constraint owner reads the runtime's structured-output compiler, built beside; a structured request
        # reaches it only once the start-up is done, and the runtime with it
        constraints = GrammarConstraints(lambda grammar: side.result().output_grammars.matcher(grammar))
        engine, runner = build_engine(core, config, serving, constraints, switches, own_thread)
        t2 = time.perf_counter()
        runtime = side.result()
        runtime.engine = engine
        t3 = time.perf_counter()
        digests_match()
    except Exception:
        _discard(side, engine)
        raise
    finally:
        sys.setswitchinterval(interval)
    t4 = time.perf_counter()
    runtime.timings["load"] = time.perf_counter() - t0
    # the runner's own split (weights to the device, kernel load, KV allocation, graph capture)
    st = runner.startup
    runtime.timings.update(open=t1 - t0, side_wait=t3 - t2, weights=st.load_s, kernels=st.kernels_s,
                           kernels_wait=st.kernels_wait_s, kv=st.kv_alloc_s, capture=st.capture_s,
                           graphs=st.num_graphs, pending=st.num_pending, pending_graphs=_pending_graphs(runner),
                           kernels_jit=st.kernels_jit, verify=t4 - t3)
    runtime.kernels = st.kernels
    return runtime


def _pending_graphs(runner) -> int:
    """The decode graphs a lazy capture left for the background (a bucket's own and its short-sequence one)."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return 0
    return sum(len(graphs.graph_splits(bucket)) for bucket in graphs.pending)


def _runtime_side(core, config: ServerConfig, serving: Serving, frontend: bool) -> Runtime:
    """The Runtime without its engine, and structured output's vocabulary built: with the frontend, the
    tokenizer and chat renderer too (else Runtime.for_engine: the compiler alone, over the core's tokenizer.json).
    NOTE: Python work beside the runner's build, which is mostly torch's (the weights' upload, the kernel load,
    the KV pool) and so leaves the interpreter free: on a GPU it hides behind the weights."""
    import tokenizers

    from helios.frontend.grammar import OutputCompiler
    from helios.frontend.tokenizer import Tokenizer

    t0 = time.perf_counter()
    manifest = core.manifest
    if frontend:
        tokenizer = Tokenizer.from_file(core.tokenizer_path, manifest.tokenizer, manifest.arch.vocab_size)
        runtime = Runtime(manifest, tokenizer, core.template_source, None, config, serving)
    else:
        # NOTE: the text Tokenizer.to_json gives a frontend (tokenizers' own serialization), not the file's bytes
        compiler = OutputCompiler(lambda: tokenizers.Tokenizer.from_file(str(core.tokenizer_path)).to_str(),
                                  manifest.arch.vocab_size, manifest.tokenizer.eos_token_ids)
        runtime = Runtime.for_engine(manifest, compiler, None, config, serving)
    runtime.output_grammars.prepare()
    runtime.timings["side"] = time.perf_counter() - t0
    return runtime


def _discard(side: Future, engine) -> None:
    """A failed build: stop the engine that was built (and its runner's processes), and the runtime's pool once
    the thread building it is done."""
    try:
        runtime = side.result()
    except Exception:
        runtime = None
    if runtime is None:
        if engine is not None:
            engine.shutdown()
            close_engine(engine)
        return
    runtime.engine = engine
    runtime.shutdown()
    close_runner(runtime)


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


def close_runner(runtime: Runtime) -> None:
    """After the engine stopped: a runner with processes of its own (tensor parallelism's ranks) stops them, and
    the KV events publisher sends what is queued and closes its sockets."""
    close_engine(runtime.engine)


def close_engine(engine) -> None:
    """close_runner's work for an engine (None: nothing)."""
    core = getattr(engine, "core", None)
    close = getattr(getattr(core, "runner", None), "close", None)
    if close is not None:
        close()
    kv_events = getattr(core, "kv_events", None)
    if kv_events is not None:  # the last steps' events still go out
        kv_events.close()


def http_workers(config: ServerConfig, device: str) -> int:
    """How many HTTP processes share the engine: the config's, else 1 on the CPU (its cores compute) and 4 on a
    GPU, never more than a quarter of this machine's cores (at least 1)."""
    if config.http_workers:
        return config.http_workers
    return 1 if device == "cpu" else max(1, min(4, (os.cpu_count() or 1) // 4))


def device_without_torch(name: str) -> str:
    """resolve_device's answer without importing torch (the HTTP processes, whose default count depends on it,
    start before this process imports torch): "auto" is "cuda" where an NVIDIA device node exists and
    CUDA_VISIBLE_DEVICES does not hide every GPU. NOTE: a CPU-only torch on a GPU machine thus gets a GPU's
    default HTTP processes (serve warns; `http_workers` sets the count)."""
    if name != "auto":
        return name
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "cpu"
    return "cuda" if glob.glob("/dev/nvidia[0-9]*") else "cpu"


def _start_early_upload(core_path: Path, device: str, switches: Switches) -> bool:
    """The weights' upload through the CUDA driver on threads beside torch's import (helios.runner.early_upload,
    torch-free), unless the early_upload switch is off; the runner adopts what it uploaded. Whether it started."""
    from helios.runner import early_upload

    ordinal = early_upload.device_ordinal(device)
    if switches.early_upload == "off" or ordinal is None:
        return False
    early_upload.start(core_path, ordinal, mode=switches.early_upload)
    return True


def serve(core_path: Path, config: ServerConfig, switches: Switches = DEFAULT_SWITCHES,
          log_level: str = "warning", timeline: Timeline | None = None, engine_samples: Path | None = None) -> int:
    """Serve until SIGINT or SIGTERM; the exit status (1 when the start-up failed).

    This process owns the engine (core, runner, scheduler, KV pool) and serves it on a Unix socket
    (helios/engine/remote.py); `http_workers` frontend processes each run Granian's embedded server on the one
    port (SO_REUSEPORT: the kernel spreads connections) and prepare, submit and encode requests there. The
    frontends start first, before this process imports torch, so their imports and tokenizer load run beside
    its imports and the load; they accept connections once the engine is warm. A frontend that dies is started
    again. timeline: the CLI's start-up marks (the ready line's split), continued here; engine_samples: a file
    for the step loop's sampled stacks (helios/engine/stack_samples.py), written at exit."""
    from helios.core.manifest import MANIFEST_FILE, decode_manifest

    timeline = timeline or Timeline()

    try:
        port = _claim_port(config.host, config.port)
    except OSError as e:
        print(f"helios: cannot listen on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 1
    config = msgspec.structs.replace(config, port=port)
    # NOTE: decoded only (load_core checks the format version, with the other core errors, in build_runtime)
    manifest = decode_manifest((Path(core_path) / MANIFEST_FILE).read_bytes())
    serving = resolve_serving(manifest, config)
    workdir = tempfile.mkdtemp(prefix="helios-")
    socket_path = os.path.join(workdir, "engine.sock")
    engine_server = EngineServer(socket_path)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    frontends: list[_Frontend] = []
    runtime = None
    status = [0]
    try:
        device = device_without_torch(config.device)
        count = http_workers(config, device)
        frontends = [_Frontend(i, count, core_path, config, serving, socket_path, log_level) for i in range(count)]
        timeline.mark("spawn")
        early = False
        if device == "cuda":  # Triton's first-use costs beside torch's import (helios/kernels/triton_warmup.py)
            from helios.kernels import triton_warmup
            from helios.kernels.aot_install import runtime_cache_root

            # NOTE: one target is the one the kernel load takes; among several, it picks by the device (torch)
            kernels_dir = Path(core_path) / manifest.kernels[0].dir if len(manifest.kernels) == 1 else None
            triton_warmup.start(kernels_dir, runtime_cache_root(switches.kernel_cache))
            early = _start_early_upload(Path(core_path), config.device, switches)
        # NOTE: the early upload's threads need the interpreter between their driver calls, beside an import that
        # holds it: a short switch interval hands it over sooner (build_runtime keeps it short through the load)
        interval = sys.getswitchinterval()
        if early:
            sys.setswitchinterval(min(interval, 0.0005))
        try:
            from helios.runner.model_runner import resolve_device  # torch, triton and the runner, from here on
        finally:
            sys.setswitchinterval(interval)

        timeline.mark("imports")
        if not config.http_workers and resolve_device(config.device) != device:
            logger.warning("helios: %d HTTP processes for a %s, but torch runs on %s; set [server] http_workers",
                           count, device, resolve_device(config.device))
        try:
            # NOTE: this thread builds the runner and runs the step loop (engine.run below): on the CPU, torch's
            # parallel regions from a second thread (a second OpenMP team) made every decode step ~25% slower
            runtime = build_runtime(core_path, config, switches, own_thread=False, frontend=False)
            timeline.mark("load")
            engine_server.start(runtime.engine)
        except Exception as e:  # one clear line; the frontends are told and exit
            print(f"helios: start-up failed: {e}", file=sys.stderr, flush=True)
            engine_server.mark_ready(error=str(e))
            return 1
        supervisor = threading.Thread(target=_supervise, name="helios-supervisor", daemon=True,
                                      args=(runtime, engine_server, frontends, stop, status, config, switches,
                                            timeline))
        supervisor.start()
        sampler = None
        if engine_samples is not None:
            from helios.engine.stack_samples import StackSampler

            sampler = StackSampler(threading.get_ident()).start()
        try:
            runtime.engine.run()  # until the supervisor shuts the engine down
        finally:
            if sampler is not None:
                sampler.stop()
                Path(engine_samples).write_text(sampler.report(), encoding="utf-8")
        supervisor.join()
        return status[0]
    finally:
        for f in frontends:
            f.stop()
        for f in frontends:
            f.join()
        engine_server.close()
        if runtime is not None:
            runtime.shutdown()
            close_runner(runtime)
        shutil.rmtree(workdir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(runtime: Runtime, engine_server: EngineServer, frontends: list[_Frontend], stop: threading.Event,
               status: list[int], config: ServerConfig, switches: Switches, timeline: Timeline) -> None:
    """Beside the step loop: warm-up, Ready to the HTTP processes, the ready line once they all serve, then
    restarting any that dies, until SIGINT/SIGTERM (or a failed start: status[0] = 1); stops the engine last."""
    try:
        try:
            asyncio.run(warm_up(runtime))
        except Exception as e:
            print(f"helios: start-up failed: {e}", file=sys.stderr, flush=True)
            engine_server.mark_ready(error=str(e))
            status[0] = 1
            return
        timeline.mark("warmup")
        engine_server.mark_ready()
        count = len(frontends)
        while not stop.is_set() and not engine_server.frontends_up(count, timeout=0.2):
            if any(f.has_failed_to_start() for f in frontends):
                print("helios: an HTTP process failed to start (see above)", file=sys.stderr, flush=True)
                status[0] = 1
                return
        if stop.is_set():
            return
        timeline.mark("http")
        if engine_server.last_up_at is not None:
            timeline.at["http_up"] = engine_server.last_up_at - timeline.origin
        print(ready_line(runtime, f"http://{config.host}:{config.port}",
                         f"{count} HTTP process{'es' if count > 1 else ''}; {switches.describe()}",
                         timeline.describe()), flush=True)
        while not stop.wait(0.5):
            if not runtime.engine.is_healthy:
                logger.error("helios: the engine failed: %s", runtime.engine.error)
            for f in frontends:
                f.restart_if_dead()
    finally:
        for f in frontends:
            f.stop()
        for f in frontends:
            f.join()
        runtime.shutdown()  # ends engine.run() on the main thread


def _claim_port(host: str, port: int) -> int:
    """Check that host:port can be listened on (no other server holds it) before the frontends share it with
    SO_REUSEPORT; port 0 becomes a free port, the same for every frontend."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        return probe.getsockname()[1]


class _Frontend:
    """One HTTP process (spawned: no CUDA state is inherited), started again when it dies after starting."""

    def __init__(self, index: int, count: int, core_path: Path, config: ServerConfig, serving: Serving,
                 socket_path: str, log_level: str) -> None:
        # the admission slots are split among the processes (each admits on its own)
        share = serving.admission_slots // count + (index < serving.admission_slots % count)
        self.args = (str(core_path), config, msgspec.structs.replace(serving, admission_slots=max(1, share)),
                     socket_path, log_level)
        self.index = index
        self.starts = 0
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(target=frontend_main, args=self.args, name=f"helios-http-{self.index}",
                                       daemon=True)
        self.process.start()
        self.starts += 1

    def has_failed_to_start(self) -> bool:
        return self.starts == 1 and self.process.exitcode not in (None, 0)

    def restart_if_dead(self) -> None:
        if self.process.exitcode is not None:
            logger.error("helios: HTTP process %d exited with %s; starting it again", self.index,
                         self.process.exitcode)
            self._start()

    def stop(self) -> None:
        if self.process.exitcode is None:
            os.kill(self.process.pid, signal.SIGINT)

    def join(self, timeout: float = 15.0) -> None:
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def frontend_main(core_path: str, config: ServerConfig, serving: Serving, socket_path: str, log_level: str) -> None:
    """An HTTP process: the core's tokenizer and template (no torch, no weights), request preparation and
    encoding, and an EngineClient to the engine process; exits when the engine's connection ends."""
    from helios.core.manifest import decode_manifest, MANIFEST_FILE
    from helios.engine.async_engine import EngineUnavailable
    from helios.engine.remote import EngineClient
    from helios.frontend.tokenizer import Tokenizer
    from helios.server.app import HeliosApp

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until Granian's handlers: a Ctrl-C reaches the parent too
    path = Path(core_path)
    manifest = decode_manifest((path / MANIFEST_FILE).read_bytes())
    tokenizer = Tokenizer.from_file(path / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    template = manifest.template
    template_source = (path / template.file).read_text(encoding="utf-8") if template.present and template.file else None
    client = EngineClient(socket_path)
    runtime = Runtime(manifest, tokenizer, template_source, client, config, serving)
    # structured output's vocabulary while the engine loads (after it, it would hold the interpreter under the
    # first requests)
    runtime.pool.submit(runtime.output_grammars.prepare)

    async def connect(rt: Runtime) -> None:
        try:
            await client.connect()
        except EngineUnavailable as e:  # the engine's start-up failed, and the engine process said why
            raise _EngineStartFailed(str(e)) from None

    app = HeliosApp(runtime, warm_up=connect, ready_line=False)

    async def main() -> int:
        reporter = asyncio.get_running_loop().create_task(_report(app, client))
        try:
            return await _serve(app, config, log_level, requests=serving.admission_slots,
                                on_server=lambda server: setattr(client, "on_lost", server.stop))
        finally:
            reporter.cancel()

    sys.exit(asyncio.run(main()))


async def _report(app: HeliosApp, client) -> None:
    """Send this process's HTTP counters to the engine process when they change (at most every 0.25 s, and
    once at start: the engine process counts the frontends that serve), for the other processes' /metrics."""
    last = None
    while True:
        await asyncio.sleep(0.05 if last is None else 0.25)
        if app.runtime is None or not client.is_healthy:
            continue
        stats = app.frontend_stats()
        if stats != last:
            client.report(stats)
            last = stats


class _EngineStartFailed(Exception):
    """An HTTP process's start-up failed because the engine's did (the engine process printed the line)."""


class _QuietStartupFailure(logging.Filter):
    """Granian's own lines around a failed start-up (the message again, a traceback, the worker's exit) and its
    embedded-mode notice: the app already said what failed, in one line; and the app's line itself when the
    engine's start-up failed (the engine process said it)."""

    _DROPPED = ("Embedded server is experimental", "ASGI lifespan startup failed", "Unexpected exit from worker")

    def __init__(self, app: HeliosApp) -> None:
        super().__init__()
        self._app = app

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args and isinstance(record.args[0], _EngineStartFailed):
            return False
        message = record.getMessage()
        return message != self._app.startup_error and not any(message.startswith(t) for t in self._DROPPED)


# requests beyond the generation slots an HTTP process may hold (/metrics, /health, model lists, refusals)
ROUTE_HEADROOM = 256


async def _serve(app: HeliosApp, config: ServerConfig, log_level: str, on_server=None, requests: int = 0) -> int:
    """Run Granian's embedded server on this loop until stopped. requests: the generation requests this process
    admits (its share of the admission slots): Granian takes that many, plus ROUTE_HEADROOM, at once."""
    from granian.constants import Interfaces
    from granian.errors import FatalError
    from granian.log import LogLevels
    from granian.server.embed import Server

    # NOTE: Granian's embedded server runs the ASGI app on this loop (lifespan, then HTTP); on Linux it listens
    # with SO_REUSEPORT, so every HTTP process binds the same port
    # NOTE: Granian's embedded default holds a process to 128 requests at once (backpressure = backlog 128 / 1
    # worker) and parks the rest unread: at 256 streams over 4 processes the engine saw a decode batch of ~190 and
    # new requests waited ~1.2 s in front of the app, /metrics too (session 21, H100). Admission is ours (429 past
    # the slots, 503 past the queue), so Granian takes every request the slots allow; the accept queue likewise.
    server = Server(app, address=config.host, port=config.port, interface=Interfaces.ASGI, websockets=False,
                    log_level=LogLevels(log_level), log_access=False, backlog=2048,
                    backpressure=max(requests, 1) + ROUTE_HEADROOM)
    if on_server is not None:
        on_server(server)
    for name in ("_granian", "helios.server"):
        logging.getLogger(name).addFilter(_QuietStartupFailure(app))
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
