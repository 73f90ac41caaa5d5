"""What one serving process owns: the loaded core, tokenizer, chat renderer, engine, admission and pools.

`build_runtime` loads a core and builds the torch side through helios.runner (imported inside the
function, so this module imports no torch); tests build a Runtime around a fake engine instead.
Derived serving values (model id, slots, budgets) live in `Serving`, not in the config.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from msgspec import Struct

from helios.core.manifest import Manifest
from helios.frontend.context import ModelContext, ModelLimits
from helios.frontend.tokenizer import Tokenizer
from helios.server.config import ServerConfig
from helios.server.errors import bad_request, rate_limited
from helios.server.metrics import HttpMetrics


class Serving(Struct, frozen=True, kw_only=True):
    """Values resolved at start-up from the config and the core."""

    model_id: str
    names: frozenset[str]  # the checkpoint id and every alias
    max_model_len: int
    max_concurrency: int
    max_waiting: int
    prefill_chunk_size: int
    default_max_tokens: int
    admission_slots: int
    thinking_token_budget: int | None
    created: int
    permission_id: str


def resolve_serving(manifest: Manifest, config: ServerConfig, created: int | None = None) -> Serving:
    aliases = [a for a in (*config.aliases, *manifest.model.aliases) if a]
    model_id = aliases[0] if aliases else manifest.model.id
    max_concurrency = config.max_concurrency or manifest.graph_plan.max_concurrency
    created = int(time.time()) if created is None else created
    if config.thinking_token_budget is not None:
        check_default_thinking_budget(manifest)
    digest = hashlib.sha256(f"{manifest.model.id}:{created}".encode()).hexdigest()[:24]
    return Serving(
        model_id=model_id,
        names=frozenset([manifest.model.id, *aliases]),
        max_model_len=manifest.limits.context_length,
        max_concurrency=max_concurrency,
        max_waiting=config.max_waiting,
        prefill_chunk_size=manifest.graph_plan.prefill_chunk_size,
        default_max_tokens=config.default_max_tokens or manifest.limits.default_max_tokens,
        admission_slots=config.admission_slots or (max_concurrency + config.max_waiting),
        thinking_token_budget=config.thinking_token_budget,
        created=created,
        permission_id=f"modelperm-{digest}",
    )


def check_default_thinking_budget(manifest: Manifest) -> None:
    """`[server] thinking_token_budget` needs a core whose default output can be cut: reasoning syntax, a
    single-token close delimiter, and a generation prompt that opens reasoning (else a default would never
    cut anything); raises ValueError naming the setting."""
    reasoning = manifest.template.reasoning
    if reasoning is None:
        why = "a core with reasoning syntax; this core has none"
    elif reasoning.close_token_id is None:
        why = f"a single-token reasoning close delimiter; this core's {reasoning.close!r} is several tokens"
    elif not reasoning.starts_in_reasoning:
        why = "a core whose generation prompt opens reasoning; this core's output starts in content"
    else:
        return
    raise ValueError(f"[server] thinking_token_budget needs {why}")


class Admission:
    """HTTP admission slots: one per generated choice, held until the response is delivered."""

    def __init__(self, slots: int):
        self.slots = slots
        self.in_use = 0

    def acquire(self, n: int) -> None:
        if n > self.slots:
            raise bad_request(f"{n} choices exceed the server's {self.slots} admission slots", "n")
        if self.in_use + n > self.slots:
            raise rate_limited(self.slots)
        self.in_use += n

    def release(self, n: int) -> None:
        self.in_use = max(0, self.in_use - n)


def model_limits(serving: Serving) -> ModelLimits:
    """The serving limits request preparation reads."""
    return ModelLimits(max_model_len=serving.max_model_len, default_max_tokens=serving.default_max_tokens,
                       thinking_token_budget=serving.thinking_token_budget)


class Runtime:
    """What the serving process owns; `model` is the frozen ModelContext request preparation reads."""

    def __init__(self, manifest: Manifest, tokenizer: Tokenizer, template_source: str | None, engine: Any,
                 config: ServerConfig, serving: Serving | None = None):
        self.serving = serving or resolve_serving(manifest, config)
        self.model = ModelContext.build(manifest, model_limits(self.serving), tokenizer, template_source)
        self.manifest, self.tokenizer = manifest, tokenizer
        self.chat, self.output_grammars = self.model.chat, self.model.output_grammars
        self.engine = engine
        self.config = config
        self.admission = Admission(self.serving.admission_slots)
        self.http_metrics = HttpMetrics()
        self.pool = ThreadPoolExecutor(config.frontend_workers, thread_name_prefix="helios-frontend")
        self.timings: dict[str, float] = {}
        self.started = time.monotonic()

    async def run_blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)


def build_engine(core, config: ServerConfig, serving: Serving, constraints=None):
    """Runner + scheduler + engine thread for a loaded core (the torch side comes from helios.runner);
    constraints: structured output's grammar owner (helios/frontend/constraints.py)."""
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
                                       dtype=dtype, host_cache_pages=host_cache_pages, host_disk_dir=host_disk_dir)
        num_pages = runner.num_pages
    else:
        num_pages = -(-max(config.kv_cache_tokens, serving.max_model_len) // page_size)
        runner = ModelRunner(core.manifest.arch, core.tensors, num_pages, page_size, dtype=dtype,
                             host_cache_pages=host_cache_pages, host_disk_dir=host_disk_dir)
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
    return AsyncEngine(EngineCore(scheduler, runner, disk_records, constraints=constraints))


def build_runtime(core_path: Path, config: ServerConfig) -> Runtime:
    """Load and verify the core, build the engine; records the load time in runtime.timings. The core's digests
    are checked on background threads while the engine builds (the weights upload, kernel load and graph
    capture): a mismatch fails the start-up before anything is served."""
    from helios.core.load import load_core, start_digest_check
    from helios.frontend.constraints import GrammarConstraints

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
        engine = runtime.engine = build_engine(core, config, serving, constraints)
        t2 = time.perf_counter()
        digests_match()
    except Exception:
        runtime.shutdown()
        raise
    t3 = time.perf_counter()
    runtime.timings["load"] = time.perf_counter() - t0
    # the runner's own split (weights to the device, kernel load, KV allocation, graph capture)
    st = engine.core.runner.startup
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
