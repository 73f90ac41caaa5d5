"""helios.toml `[server]`: frozen msgspec Structs, one doc line and a bound per field.

Owns the declared knobs only; values derived at start-up from the core (slots, output budget, model id)
live in `ResolvedServing` (helios/server/runtime.py), never written back here. No torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

MiB = 1 << 20
INT32_MAX = 2**31 - 1


class ConfigError(Exception):
    """A configuration file the server refuses; the message names the file and the field."""


_Slots = Annotated[int, Meta(ge=1, le=4096)]
_Count = Annotated[int, Meta(ge=1, le=1 << 20)]
_Int32 = Annotated[int, Meta(ge=1, le=INT32_MAX)]


class KVEventsConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `--kv-events-config` (same fields, same meaning): the prefix cache's changes published for a
    prefix-aware router (helios/engine/kv_events.py); `[server.kv_events]` in helios.toml."""

    enable_kv_cache_events: Annotated[
        bool, Meta(description="Publish BlockStored/BlockRemoved/AllBlocksCleared (needs prefix_caching).")
    ] = False
    publisher: Annotated[
        Literal["null", "zmq"] | None, Meta(description="zmq, or null (none); unset: zmq when events are enabled.")
    ] = None
    endpoint: Annotated[
        str, Meta(max_length=1024, description="ZMQ PUB address: bound with a wildcard (tcp://*:5557), else connected.")
    ] = "tcp://*:5557"
    replay_endpoint: (
        Annotated[str, Meta(max_length=1024, description="ZMQ ROUTER address (bound) replaying buffered batches.")]
        | None
    ) = None
    buffer_steps: Annotated[int, Meta(ge=1, le=1 << 24, description="Batches (steps) kept for replay.")] = 10_000
    hwm: Annotated[int, Meta(ge=0, le=1 << 30, description="ZMQ high-water mark of the PUB socket (0: none).")] = (
        100_000
    )
    max_queue_size: Annotated[
        int, Meta(ge=1, le=1 << 24, description="Batches waiting for the sender thread before new ones are dropped.")
    ] = 100_000
    topic: Annotated[
        str, Meta(max_length=1024, description="First frame of every message; llm-d reads kv@<pod-id>@<model>.")
    ] = ""

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


class ServerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The `[server]` table of helios.toml."""

    host: Annotated[str, Meta(description="Address to bind.")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="TCP port.")] = 8000
    api_key: Annotated[str, Meta(description="Bearer key for API routes; empty disables authentication.")] = ""
    aliases: Annotated[list[str], Meta(description="Served model names; the first nonempty one is the id.")] = []
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 34, description="Bound on encoded and decoded bodies.")] = (
        32 * MiB
    )
    max_concurrency: _Slots | None = None  # model slots; None: the core's graph plan
    max_waiting: Annotated[int, Meta(ge=1, le=1 << 20, description="Model request queue bound (503 beyond).")] = 256
    admission_slots: _Count | None = None  # HTTP admission slots, one per choice (429 beyond); None: slots + queue
    default_max_tokens: _Int32 | None = None  # output budget of requests omitting it; None: the core's
    thinking_token_budget: _Int32 | None = None  # default reasoning-token cap for chat requests; None: uncapped
    max_num_batched_tokens: Annotated[int, Meta(ge=1, le=1 << 20, description="Token budget of one step.")] = 2048
    decode_stall_ratio: Annotated[
        float, Meta(ge=0, le=1e6, description="While requests decode, a step's prompt tokens stay within what the "
                    "measured prefill rate does in this many decode steps (arriving prompts stretch an inter-token "
                    "gap to at most 1 + ratio decode steps), unless the oldest waiting request has waited 4 steps; "
                    "0: only the token budget and the prompt graphs' cap limit them.")
    ] = 1.0
    kv_cache_tokens: Annotated[int, Meta(ge=16, le=1 << 24, description="KV pool capacity in tokens (CPU).")] = 32768
    prefix_caching: Annotated[
        bool, Meta(description="Reuse the KV pages of earlier requests' identical prefixes (GPU prefix cache).")
    ] = True
    host_cache_bytes: Annotated[
        int, Meta(ge=0, le=1 << 44, description="Host DRAM behind the prefix cache for evicted KV pages; 0: off.")
    ] = 0
    state_checkpoints: Annotated[
        int, Meta(ge=-1, le=1 << 16, description="Hybrid models: state slots holding checkpoints of the recurrent "
                  "state for prefix reuse (with prefix_caching); -1: as many as max_concurrency; 0: no reuse.")
    ] = -1
    host_disk_dir: Annotated[
        str, Meta(max_length=4096, description="Directory of the disk records behind the host DRAM tier (a subdirectory per core KV identity); empty: off.")
    ] = ""
    host_disk_bytes: Annotated[
        int, Meta(ge=0, le=1 << 50, description="Disk behind the host DRAM tier for KV pages it evicts (needs host_disk_dir and host_cache_bytes); 0: off.")
    ] = 0
    device: Annotated[
        Literal["auto", "cpu", "cuda"], Meta(description="auto: CUDA when a GPU is visible (KV pool sized from free memory), else CPU.")
    ] = "auto"
    frontend_workers: Annotated[
        int, Meta(ge=1, le=256, description="Threads per HTTP process for decompression, templates and tokenization.")
    ] = 2
    http_workers: Annotated[
        int, Meta(ge=0, le=64, description="HTTP processes sharing the one engine process on the port (admission slots split among them); 0: 1 on the CPU, 4 on a GPU.")
    ] = 0
    tensor_parallel: Annotated[
        int, Meta(ge=1, le=64, description="Ranks (one GPU each) the model is split over by tensor parallelism: rank 0 in the engine process, the others in worker processes it starts; 1: none.")
    ] = 1
    host_embeddings: Annotated[
        Literal["auto", "on", "off"], Meta(description="Row tables a step reads a few rows of (per-layer embeddings) "
                                       "kept in host memory behind a GPU row cache: auto when the weights would "
                                       "take most of the free GPU memory (never on the CPU), on: always, off: never.")
    ] = "auto"
    kv_events: KVEventsConfig = KVEventsConfig()  # KV cache events for a prefix-aware router; off by default


class HeliosConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    server: ServerConfig = ServerConfig()


def load_config(path: Path | None) -> HeliosConfig:
    """Read helios.toml (None: all defaults); a bad key or value raises ConfigError naming it."""
    if path is None:
        return HeliosConfig()
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the configuration: {e.strerror}") from None
    try:
        return msgspec.toml.decode(raw, type=HeliosConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None


def json_schema() -> dict:
    return msgspec.json.schema(HeliosConfig)
