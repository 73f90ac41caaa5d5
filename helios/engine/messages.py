"""Engine boundary messages: requests in, outputs out, and the step contract with the runner.

Plain msgspec data only: no torch, numpy, tokenizer or live objects here, so each message could cross a process
boundary (tests/engine/test_messages.py round-trips every one through msgpack). One engine step is
`plan = scheduler.schedule()` -> `out = runner.execute(plan)` -> `scheduler.update(plan, out)`.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(Struct, frozen=True, kw_only=True):
    """Resolved sampling for one request: already defaulted and clamped by the frontend."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    max_tokens: int = 16  # 0 is allowed only for prompt scoring
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # None: no generation logprobs; N: top-N natural alternatives
    logprob_token_ids: tuple[int, ...] | None = None  # explicit alternatives, replaces top-N
    prompt_logprobs: int | None = None  # None: none; N: top-N alternatives per prompt position
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits the draw reads


class ReasoningBudget(Struct, frozen=True, kw_only=True):
    """A hard cap on generated reasoning tokens (thinking_token_budget), resolved by the frontend.

    The engine reads reasoning state from token ids alone: at the cap, while reasoning is unambiguously
    open, the next token is forced to `close_token_id` instead of sampled (helios/engine/reasoning_budget.py).
    """

    max_reasoning_tokens: int  # the cap, >= 1; counted from the start of this request's output
    close_token_id: int  # the prepared single-token reasoning close delimiter
    starts_in_reasoning: bool  # the generation prompt opened reasoning; False: output starts in content, no cut
    # single-token tool openers that may end reasoning implicitly (Qwen's <tool_call> while tools are parsed)
    tool_open_token_ids: tuple[int, ...] = ()


class ConstraintSpec(Struct, frozen=True, kw_only=True):
    """A request's output grammar (structured output) and the envelopes around it, resolved by the frontend.

    The grammar constrains the final answer: while the prompt left output inside reasoning it waits for the
    reasoning close token (or, for a close of several tokens, the output's ending with `close_token_ids`), and at
    the answer's first token a single-token tool opener (the tool-call envelope) is allowed as well and releases
    the request from the grammar. Compiled by the engine's ConstraintOwner.
    """

    grammar: str  # llguidance's serialized grammar (LLMatcher.grammar_from_*), validated by the frontend
    starts_in_reasoning: bool = False  # output opens inside reasoning: the grammar starts after the close
    close_token_id: int | None = None  # the prepared single-token reasoning close delimiter
    # a close of several tokens, with the answer channel's opener after it where the syntax has one (Kimi K3's
    # `<|close|>think<|sep|><|open|>response<|sep|>`): the grammar starts once the output ends with these ids
    close_token_ids: tuple[int, ...] = ()
    tool_open_token_ids: tuple[int, ...] = ()  # single-token tool openers allowed in place of the answer


class EngineRequest(Struct, frozen=True, kw_only=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reasoning_budget: ReasoningBudget | None = None
    # structured output: the grammar the answer must follow (its state lives with the ConstraintOwner)
    constraint: ConstraintSpec | None = None
    # where the rendered chat prompt's stable prefix ends (the leading system message with the tools; 0: none)
    # and where each of its messages ends, as token offsets into prompt_token_ids (helios/frontend/boundaries.py):
    # a hybrid model's scheduler may keep state checkpoints there (helios/engine/state_checkpoints.py)
    anchor_end: int = 0
    message_ends: list[int] = []
    # NOTE: a request with prompt_logprobs must prefill from scratch (no prefix reuse).


class AbortRequest(Struct, frozen=True, kw_only=True):
    """Cancel a request in any state: its pages are freed at the next step boundary, its stream ends "abort"."""

    req_id: str


class TokenLogprob(Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float
    rank: int  # 1 + number of vocabulary entries with a strictly greater logprob


class PositionLogprobs(Struct, frozen=True):
    """The logprob record of one position: the actual token first, then the alternatives in order."""

    token: TokenLogprob
    alternatives: list[TokenLogprob]


class EngineOutput(Struct, kw_only=True):
    """Incremental output of one request after one step (or its terminal record)."""

    req_id: str
    new_token_ids: list[int] = []
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when requested
    # new_token_ids is one token the engine forced (the reasoning close at the thinking budget): it was not
    # sampled, so it has no logprob record; it still counts as a generated token
    is_forced: bool = False
    # prompt positions 1..n-1 (position 0 has none), sent once when prefill completes
    prompt_logprobs: list[PositionLogprobs] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_token: int | list[int] | None = None  # the token id or id sequence that stopped it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


# --- the step contract between scheduler and runner --------------------------------------------


class NewRequestData(Struct, frozen=True, kw_only=True):
    """Sent to the runner once, the first step a request is scheduled (and again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # NOTE: after preemption the request is resent with the tokens it generated so far: they are recomputed
    # as context after the prompt (ScheduledRequest.token_ids walk prompt_token_ids + output_token_ids) and
    # count for penalties; prompt logprobs and the prompt length refer to prompt_token_ids only.
    output_token_ids: list[int] = []


class ScheduledRequest(Struct, frozen=True, kw_only=True):
    req_id: str
    token_ids: list[int]  # tokens to compute this step: positions num_computed_tokens ..
    num_computed_tokens: int  # tokens already in the KV cache
    block_ids: list[int]  # the request's whole block table after this step's allocation
    sample: bool  # the last scheduled position produces a new token
    # the tables of its window groups (helios/engine/kv_groups.py; one today, SchedulerConfig.sliding_window's), each
    # as long as block_ids: the sliding layers' own pages, -1 (kv_groups.NULL_PAGE) where a page before the window
    # went back to the pool (no query reads it); empty for a model of one group
    group_block_ids: list[list[int]] = []
    # prompt positions covered by this chunk get prompt logprobs (prefill with prompt_logprobs)
    want_prompt_logprobs: bool = False
    # set only with sample: the runner returns this id instead of sampling (no draw, no logprob record) and
    # records it as an output token, as it does a sampled one
    forced_token_id: int | None = None
    # set only with sample: the tokens the sample may take (structured output), a bitmask of little-endian
    # int32 words (bit i of word w allows token 32w+i); the runner masks the rest before sampling, never the
    # logprobs, which describe the raw distribution
    token_mask: bytes | None = None
    # the row of the recurrent layers' state the request reads and updates (hybrid models); -1: none. The state
    # is read only when num_computed_tokens > 0 (a fresh request starts from zeros)
    state_slot: int = -1


class SchedulerOutput(Struct, frozen=True, kw_only=True):
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]
    # the runner drops their per-request state (finished, aborted or preempted since the last plan); it
    # applies them before new_requests (a req_id can reappear as new in the same plan) and a drop of an
    # unknown id is a no-op
    finished_req_ids: list[str]
    num_scheduled_tokens: int
    # the host tier of the prefix cache (helios/engine/host_cache.py): (page, slot) pages the pool evicted, copied
    # out to host records, then (slot, page) records copied into fresh pages; the runner applies every copy-out,
    # then every copy-in, before any forward of the plan (its forward writes into the evicted pages)
    copy_out: list[tuple[int, int]] = []
    copy_in: list[tuple[int, int]] = []
    # its disk tier: (slot, hash) DRAM records written to files before their slots are reused, hashes whose files
    # are deleted, (hash, slot) files read into DRAM slots. The runner's order: spill, disk_drop, copy_out, load,
    # copy_in (a slot spilled from is then written; a slot loaded into is then read)
    spill: list[tuple[int, bytes]] = []
    disk_drop: list[bytes] = []
    load: list[tuple[bytes, int]] = []
    # hybrid models' state slot copies (src, dst), in order, before any forward of the plan: checkpoint captures
    # (a running slot as a step left it -> a checkpoint slot), then restores (a checkpoint -> a running slot)
    state_copies: list[tuple[int, int]] = []
    # their host tiers, in the runner's order: (record, hash) spills to files and hashes whose files go, then
    # (state slot, record) copy-outs of evicted checkpoints (before state_copies reuse their slots), then
    # state_copies, then (hash, record) loads and (record, state slot) copy-ins into running slots
    state_spill: list[tuple[int, bytes]] = []
    state_disk_drop: list[bytes] = []
    state_copy_out: list[tuple[int, int]] = []
    state_load: list[tuple[bytes, int]] = []
    state_copy_in: list[tuple[int, int]] = []
    # one-pass steps (SchedulerConfig.one_pass_rows): this decode-only plan's next step takes the waiting prompts
    # beside these decodes, so the runner must not run that step ahead (runner/decode_overlap.py)
    hold_ahead: bool = False


class RequestResult(Struct, frozen=True, kw_only=True):
    req_id: str
    sampled_token_id: int | None = None  # None when the chunk did not sample; the forced id when one was forced
    logprobs: PositionLogprobs | None = None
    # for the chunk's positions p (num_computed .. +len(token_ids)-1): record of token p+1 given
    # 0..p, i.e. prompt logprobs of positions num_computed+1 .. (only those inside the prompt)
    prompt_logprobs: list[PositionLogprobs] | None = None


class ModelRunnerOutput(Struct, frozen=True, kw_only=True):
    results: list[RequestResult]


class Histogram(Struct, frozen=True, kw_only=True):
    """A Prometheus histogram's data: per-bucket counts (not cumulative) for `bounds` (upper, inclusive) plus one
    beyond the last, the sum and the count of the observations."""

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0
    count: int = 0


class RunnerStats(Struct, frozen=True, kw_only=True):
    """The runner's counters (runner.stats()), folded into EngineMetrics; totals since start."""

    graph_launches: dict[str, int] = {}  # forward passes by kind: graph (a decode graph's replay), speculative, eager
    replay_gpu_ns: int = 0  # GPU time of completed graph replays (zero on the CPU)
    graph_captures_pending: int = 0  # decode and prompt graph buckets left to capture (captured when idle)
    # Triton kernels a launch had to compile or fetch from Triton's disk cache after the start: a specialization
    # (a shape's divisibility, a new constant) no warm launch loaded; each stalls its step for ms to a second
    kernels_jit: int = 0
    # host embedding tables (helios/runner/host_embedding.py; zero without them): the time steps waited for their
    # rows' copies over the steps prepared, and the device row caches' lookups (rows per step), copies and bytes
    replay_readiness_wait_ns: int = 0
    replay_readiness_samples: int = 0
    embedding_row_cache_hits: int = 0
    embedding_row_cache_misses: int = 0
    embedding_row_cache_evictions: int = 0
    embedding_row_cache_bytes: int = 0


class FrontendStats(Struct, frozen=True, kw_only=True):
    """One HTTP frontend process's counters for /metrics; the engine process sums every frontend's."""

    http_requests: int = 0
    admission_slots: int = 0
    admission_in_use: int = 0
    first_response: list[tuple[float, float]] = []  # (seconds ago, admission -> first text seconds), in the window
