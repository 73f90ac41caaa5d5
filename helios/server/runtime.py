"""What one serving process owns: the loaded core, tokenizer, chat renderer, engine, admission and pools.

The composition root (helios/compose.py) builds a Runtime around the engine it built from a core; tests build
one around a fake engine instead. No torch, no runner or engine internals.
Derived serving values (model id, slots, budgets) live in `Serving`, not in the config.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from msgspec import Struct

from helios.core.manifest import Manifest
from helios.frontend.context import ModelContext, ModelLimits
from helios.frontend.grammar import OutputCompiler
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
    """What the serving process owns; `model` is the frozen ModelContext request preparation reads (None in the
    engine process of `helios serve`: `for_engine`)."""

    def __init__(self, manifest: Manifest, tokenizer: Tokenizer, template_source: str | None, engine: Any,
                 config: ServerConfig, serving: Serving | None = None):
        self.serving = serving or resolve_serving(manifest, config)
        self.model = ModelContext.build(manifest, model_limits(self.serving), tokenizer, template_source)
        self.tokenizer = tokenizer
        self.chat, self.output_grammars = self.model.chat, self.model.output_grammars
        self._own(manifest, engine, config)

    @classmethod
    def for_engine(cls, manifest: Manifest, output_grammars: OutputCompiler, engine: Any, config: ServerConfig,
                   serving: Serving) -> Runtime:
        """The engine process's Runtime under `helios serve`: no tokenizer, chat renderer or model context (its
        HTTP processes prepare the requests), only structured output's compiler, which the engine's constraint
        owner reads."""
        runtime = cls.__new__(cls)
        runtime.serving, runtime.model, runtime.tokenizer, runtime.chat = serving, None, None, None
        runtime.output_grammars = output_grammars
        runtime._own(manifest, engine, config)
        return runtime

    def _own(self, manifest: Manifest, engine: Any, config: ServerConfig) -> None:
        self.manifest = manifest
        self.engine = engine
        self.config = config
        self.admission = Admission(self.serving.admission_slots)
        self.http_metrics = HttpMetrics()
        self.pool = ThreadPoolExecutor(config.frontend_workers, thread_name_prefix="helios-frontend")
        self.timings: dict[str, float] = {}
        self.kernels = ""  # what the runner's start did with the core's precompiled kernels, and its split
        self.started = time.monotonic()

    async def run_blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)
