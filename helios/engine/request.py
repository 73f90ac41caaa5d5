"""Per-request engine state: status, token ids, computed-token count, block table, stop checking.

Owned and mutated by the scheduler only (never shared with the runner: it gets plain messages).
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

import enum

from helios.engine.messages import EngineRequest, FinishReason, PositionLogprobs, SamplingParams
from helios.engine.reasoning_budget import ReasoningBudgetState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its tokens so far are recomputed on resumption
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
# NOTE: a tuple, not the dict: membership by identity skips Enum's Python-level __hash__ (is_finished runs for every
# request of every step)
_FINISHED = tuple(_FINISH_REASONS)


class Request:
    """One request's state. `all_token_ids` = prompt + output; positions < num_computed_tokens are in KV.

    NOTE: a terminal EOS or stop token IS appended to `output_token_ids` (and reported in `new_token_ids`);
    the frontend hides it from text and logprob entries. Between steps a running request always has at
    least one token not yet in the KV cache (the prompt remainder, or the last sampled token).
    """

    __slots__ = (
        "req_id",
        "queued_at_step",
        "sampling",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "block_ids",
        "group_block_ids",
        "state_slot",
        "checkpoint_hash",
        "anchor_end",
        "message_ends",
        "checkpoint_plan",
        "anchor_guard",
        "status",
        "stop_token",
        "error",
        "prompt_logprobs",
        "is_prompt_logprobs_sent",
        "is_prefill_counted",
        "is_known_to_runner",
        "num_preemptions",
        "is_decoding",
        "reasoning",
        "has_constraint",
        "page_hashes",
        "num_published_pages",
        "num_cached_tokens",
        "num_reused_tokens",
    )

    def __init__(self, request: EngineRequest) -> None:
        self.req_id = request.req_id
        self.queued_at_step = 0  # the scheduler's step count when it last entered the waiting queue
        self.sampling: SamplingParams = request.sampling
        self.prompt_token_ids: list[int] = list(request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # the window groups' tables (helios/engine/kv_groups.py), each as long as block_ids; [] for one group
        self.group_block_ids: list[list[int]] = []
        self.state_slot = -1  # its row of the recurrent layers' state while running (hybrid models); -1: none
        self.checkpoint_hash: bytes | None = None  # its latest decode endpoint (helios/engine/state_checkpoints)
        self.anchor_end = request.anchor_end  # the template's positions of anchor and message checkpoints
        self.message_ends = request.message_ends
        self.checkpoint_plan: dict[int, str] = {}  # grid position -> role chosen at admission, captured on reaching it
        self.anchor_guard: bytes | None = None  # the hash of the anchor guard it holds (StateCheckpoints.reserve)
        self.status = RequestStatus.WAITING
        self.stop_token: int | list[int] | None = None
        self.error: str | None = None
        self.prompt_logprobs: list[PositionLogprobs] = []  # collected chunk by chunk during prefill
        self.is_prompt_logprobs_sent = False
        self.is_prefill_counted = False  # prefill_tokens metric: a prompt counts once, not per recompute
        self.is_known_to_runner = False  # sent in new_requests and not yet in finished_req_ids
        self.num_preemptions = 0
        self.is_decoding = False  # its next step feeds its last sampled token (a decode round); not after preemption
        budget = request.reasoning_budget
        self.reasoning = ReasoningBudgetState(budget) if budget is not None else None
        self.has_constraint = request.constraint is not None  # its grammar state lives with the ConstraintOwner
        # prefix cache (helios/engine/prefix_cache.py): the chained hashes of the first full pages of
        # all_token_ids, extended on demand (kept across preemption: they depend on the tokens alone)
        self.page_hashes: list[bytes] = []
        self.num_published_pages = 0  # leading pages of block_ids already offered to the cache (hits included)
        self.num_cached_tokens = 0  # tokens reused at the first admission (usage's cached_tokens)
        self.num_reused_tokens = 0  # tokens reused at the latest admission

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None and not self.is_prompt_logprobs_sent

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS[self.status] if self.status in _FINISHED else None

    @property
    def forced_token_id(self) -> int | None:
        """The token the next sample must be (the reasoning close at the thinking budget), else None."""
        return self.reasoning.forced_token_id() if self.reasoning is not None else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.reasoning is not None:
            self.reasoning.observe(token_id)

    def finish(self, status: RequestStatus, *, stop_token: int | list[int] | None = None, error: str | None = None) -> None:
        assert status in _FINISH_REASONS, status
        self.status = status
        self.stop_token = stop_token
        self.error = error

    def check_stop(self, max_model_len: int) -> bool:
        """Apply the stop rules after a token was appended; finishes the request and returns True on a stop.

        Stops are checked before limits: the cause is decided at the terminal token, so a stop that lands on
        the final allowed token reports "stop", not "length". Under ignore_eos an EOS is an ordinary token.
        """
        sampling = self.sampling
        last = self.output_token_ids[-1]
        if (not sampling.ignore_eos and last in sampling.eos_token_ids) or last in sampling.stop_token_ids:
            self.finish(RequestStatus.FINISHED_STOPPED, stop_token=last)
            return True
        outputs = self.output_token_ids
        for sequence in sampling.stop_token_sequences:
            n = len(sequence)
            if 0 < n <= len(outputs) and tuple(outputs[-n:]) == tuple(sequence):
                self.finish(RequestStatus.FINISHED_STOPPED, stop_token=list(sequence))
                return True
        if len(outputs) >= sampling.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.finish(RequestStatus.FINISHED_LENGTH)
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
