"""Scheduler configuration: frozen msgspec Structs, each field with a one-line doc and a bound.

Owns only the declared knobs; values derived at start-up (e.g. num_pages from free device memory) are
resolved by the caller before this Struct is built, never written back. Must not import torch or numpy.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from helios.engine.kv_groups import window_pages_per_request


def _check_bounds(obj: Struct) -> None:
    """Enforce the Meta bounds on direct construction too (msgspec checks them only when decoding); ints only."""
    for field in msgspec.inspect.type_info(type(obj)).fields:
        info = field.type
        if isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        if not isinstance(info, msgspec.inspect.IntType):
            continue
        value = getattr(obj, field.name)
        if (info.ge is not None and value < info.ge) or (info.le is not None and value > info.le):
            raise ValueError(f"{type(obj).__name__}.{field.name}={value} is outside [{info.ge}, {info.le}]")


class SchedulerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Continuous-batching limits of one engine; one step never exceeds any of them."""

    max_concurrency: Annotated[
        int, Meta(ge=1, le=4096, description="Model slots: requests running (holding KV pages) at once.")
    ] = 16
    max_num_batched_tokens: Annotated[
        int, Meta(ge=1, le=1 << 20, description="Token budget of one step, decode and prefill tokens together.")
    ] = 2048
    prefill_chunk_size: Annotated[
        int, Meta(ge=1, le=1 << 20, description="Most prompt tokens one request prefills in one step.")
    ] = 512
    decode_stall_ratio: Annotated[
        float, Meta(ge=0, le=1e6, description="While requests decode, a step's prompt tokens are limited so that "
                    "their predicted time (the measured prefill rate) stays within this multiple of the measured "
                    "decode step: arriving prompts stretch a decoding request's inter-token gap to at most "
                    "(1 + ratio) decode steps, unless the waiting queue's head has waited STALL_MAX_WAIT_STEPS "
                    "(scheduler.py) steps; 0: no limit beyond the token budget and the prompt-step caps.")
    ] = 0.0
    prompt_step_tokens: Annotated[
        int, Meta(ge=0, le=1 << 20, description="While requests decode, the most prompt tokens a step takes beside "
                  "them (the runner's prompt graphs' largest bucket: such a step replays one graph, whose time is "
                  "bounded); 0: no such limit.")
    ] = 0
    prompt_step_seqs: Annotated[
        int, Meta(ge=0, le=1 << 16, description="Likewise, the most prompt chunks (sequences) a step takes beside "
                  "decodes; 0: no such limit.")
    ] = 0
    one_pass_rows: Annotated[
        int, Meta(ge=0, le=1 << 16, description="Where the runner runs a step of prompts beside decodes in one pass "
                  "(the one_pass switch), the most rows (decodes and prompt chunks) such a step holds: after a "
                  "decode-only step, whose successor the runner runs ahead, waiting prompts that would fit are held "
                  "back one step, and that step is not run ahead, so the next takes them in one pass; 0: never.")
    ] = 0
    one_pass_prompt_tokens: Annotated[
        int, Meta(ge=0, le=1 << 20, description="prompt_step_tokens for a step that may run in one pass (fewer "
                  "running requests than one_pass_rows): prompts held back a step arrive together, and their "
                  "padded tokens delay the decode rows riding with them; 0: prompt_step_tokens.")
    ] = 0
    max_waiting: Annotated[
        int, Meta(ge=1, le=1 << 20, description="Requests waiting for a model slot past the free ones (QueueFull).")
    ] = 256
    page_size: Annotated[int, Meta(ge=1, le=1024, description="Tokens per KV page.")] = 16
    num_pages: Annotated[int, Meta(ge=1, le=1 << 24, description="Pages in the KV pool.")] = 1024
    max_model_len: Annotated[
        int, Meta(ge=1, le=1 << 24, description="Most tokens (prompt + output) one request may hold.")
    ] = 4096
    enable_prefix_caching: Annotated[
        bool, Meta(description="Reuse the KV pages of earlier requests' identical full-page prefixes.")
    ] = True
    host_cache_pages: Annotated[
        int, Meta(ge=0, le=1 << 24, description="Host DRAM records (one KV page each) behind the prefix cache; 0: off.")
    ] = 0
    host_disk_pages: Annotated[
        int, Meta(ge=0, le=1 << 32, description="Disk records (one KV page each) behind the host DRAM tier; 0: off.")
    ] = 0
    num_state_slots: Annotated[
        int, Meta(ge=0, le=1 << 20, description="Recurrent-state slots of a hybrid model's linear layers (a running "
                  "request holds one); 0: the model keeps no per-request state.")
    ] = 0
    state_chunk: Annotated[
        int, Meta(ge=0, le=1 << 16, description="A hybrid model's recurrent chunk: a split prefill chunk ends on a "
                  "multiple of it, so the recurrent layers' arithmetic does not depend on the split; 0: none.")
    ] = 0
    state_checkpoint_slots: Annotated[
        int, Meta(ge=0, le=1 << 20, description="State slots (beyond num_state_slots' running share) that hold "
                  "checkpoints of a hybrid model's recurrent state for prefix reuse; 0: no reuse for such models.")
    ] = 0
    host_state_records: Annotated[
        int, Meta(ge=0, le=1 << 24, description="Host DRAM records (one state slot each) behind the GPU checkpoints "
                  "of a hybrid model; 0: off.")
    ] = 0
    host_state_disk_records: Annotated[
        int, Meta(ge=0, le=1 << 32, description="Disk records (one state slot each) behind the host DRAM state "
                  "records; 0: off.")
    ] = 0
    host_copy_bytes_per_s: Annotated[
        float, Meta(ge=0, le=1e15, description="Host <-> device copy bandwidth, for the host lookups' predicted "
                    "transfer time (/metrics' flare_host_cache_estimated_transfer_ns).")
    ] = 1e10
    state_slot_bytes: Annotated[
        int, Meta(ge=0, le=1 << 40, description="Bytes one state slot holds across all recurrent layers.")
    ] = 0
    state_copy_bytes_per_s: Annotated[
        float, Meta(ge=0, le=1e15, description="The device's slot-copy bandwidth, for the checkpoint cost rule.")
    ] = 1e10
    page_bytes: Annotated[
        int, Meta(ge=0, le=1 << 40, description="Bytes one KV page holds across all layers (host tier byte counts).")
    ] = 0
    sliding_window: Annotated[
        int, Meta(ge=0, le=1 << 24, description="Tokens a query of the sliding-window layers sees, when they keep a "
                  "page group of their own (window_pages); 0: every layer shares num_pages' tables.")
    ] = 0
    window_pages: Annotated[
        int, Meta(ge=0, le=1 << 24, description="Pages of the sliding-window layers' own pool (helios/engine/"
                  "kv_groups.py: their pages before the window go back to it); 0: no window group.")
    ] = 0

    def __post_init__(self) -> None:
        _check_bounds(self)
        # NOTE: this is what lets every running request advance by at least one token every step.
        if self.max_num_batched_tokens < self.max_concurrency:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_concurrency ({self.max_concurrency})"
            )
        # NOTE: and this lets the first running request's prefill chunk reach the next multiple of the recurrent
        # chunk whatever the others take (Scheduler._chunk_size), so a hybrid model's prefill always progresses
        if self.state_chunk and self.max_num_batched_tokens < self.max_concurrency + self.state_chunk - 1:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_concurrency + state_chunk - 1 "
                f"({self.max_concurrency + self.state_chunk - 1}) for a model with recurrent layers"
            )
        if bool(self.sliding_window) != bool(self.window_pages):
            raise ValueError(f"sliding_window ({self.sliding_window}) and window_pages ({self.window_pages}) are set "
                             "together or not at all")
        if self.window_pages:
            # NOTE: the oldest running request alone always fits every pool (its progress guarantee)
            needed = window_pages_per_request(self.sliding_window, self.page_size, self.prefill_chunk_size)
            if self.window_pages < needed:
                raise ValueError(f"window_pages ({self.window_pages}) must be >= {needed} (one request's window of "
                                 f"{self.sliding_window} tokens and its prefill chunk)")
            if self.num_state_slots or self.host_cache_pages:
                raise ValueError("a window group goes without recurrent state slots and host tiers (not built yet)")
        if self.state_chunk and self.prefill_chunk_size < self.state_chunk:
            raise ValueError(f"prefill_chunk_size ({self.prefill_chunk_size}) must be >= state_chunk "
                             f"({self.state_chunk}) for a model with recurrent layers")

    @property
    def page_capacity_tokens(self) -> int:
        """Tokens the whole KV pool can hold."""
        return self.page_size * self.num_pages
