"""Speculative next decode step: the GPU runs step n+1 of a graphed decode batch while the host finishes step n.

After step n's graph and the device side of its sampling are enqueued, the runner copies the sampled ids to
pinned host memory, enqueues step n+1 (the same requests, each one position further, its token the id just
sampled, still on the device) through the same bucket's graph, and only then waits for the ids. The next plan
either is exactly that step (its logits are already in the static buffer) or the speculation is dropped.
Owns which steps may be speculated and which plans match; imports torch and the runner's graph module only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from helios.engine.messages import ScheduledRequest, SchedulerOutput
from helios.runner.cuda_graphs import blocks_needed
from helios.runner.input_batch import RequestState

# NOTE: why a dropped speculation is harmless. The speculative step writes KV only at the slot of position
# p+1, inside a block the request already holds at step n (speculable() checks it), and writes the static
# buffers and logits, which every later step reloads or overwrites. Blocks are handed out again only by a
# later schedule(), whose steps are enqueued after the speculative one on the same stream; attention reads
# only positions < seq_len, so nobody reads that slot before a real step for position p+1 rewrites it (a
# block holding p+1 is never a full, reusable prefix block of this request's computed tokens). With a window page
# group (helios/engine/kv_groups.py) step n+1 reads the group's pages from the window of p+1 on, all held at step n;
# the pages update(n) gives back lie before that window, and whoever gets them writes them in a later plan.


def speculable(
    scheduled: list[ScheduledRequest], requests: dict[str, RequestState], page_size: int, max_blocks: int
) -> bool:
    """Whether step n (a graphed decode step) may be followed by a speculative step n+1: every request
    samples, none is forced, none wants logprobs or prompt logprobs (their extraction reads the logits that
    the speculative replay overwrites), none samples its last token (max_tokens) at step n, and each next
    position lies in a block the request already holds (and within the static block table's `max_blocks`
    columns)."""
    for s in scheduled:
        state = requests[s.req_id]
        if not s.sample or s.forced_token_id is not None or s.want_prompt_logprobs:
            return False
        if state.wants_logprobs or state.sampling.prompt_logprobs is not None:
            return False
        # NOTE: a request that finishes at step n leaves the next plan, which then cannot match: the speculative
        # step would be a whole wasted step of the batch (staggered finishes cost ~6% at b=256 on the H200)
        if len(state.sampler_state.output_token_ids) + 1 >= state.sampling.max_tokens:
            return False
        next_block = (s.num_computed_tokens + 1) // page_size
        if next_block >= len(s.block_ids) or next_block >= max_blocks:
            return False
    return True


@dataclass(frozen=True)
class Speculation:
    """The step n+1 the GPU has run: what a plan must say for its logits to be used."""

    bucket: int
    # step n+1 as launched (next_step): req_id and num_computed_tokens per request, and as block_ids step n's plan
    # tables themselves, not copies (a plan's lists are never changed once it is made: the scheduler copies each
    # request's tables into every plan); it read the first blocks_needed entries of each
    steps: list[ScheduledRequest]
    token_ids: list[int]  # the ids sampled at step n: step n+1's inputs
    page_size: int
    num_loads: int  # StaticBuffers.num_loads right after its load: no other load may come in between
    # per request the window group's table as the plan of step n+1 holds it: step n+1's pages from its window on,
    # -1 before (what update(n) leaves); empty lists without a window group
    window_blocks: list[list[int]] = field(default_factory=list)

    def matches(self, plan: SchedulerOutput, bucket: int | None, num_loads: int,
                rows: list[ScheduledRequest] | None = None) -> bool:
        """Whether the plan's rows (`rows`: a mixed step's decode rows; default all of them) are this step."""
        scheduled = plan.scheduled if rows is None else rows
        if bucket != self.bucket or num_loads != self.num_loads or len(scheduled) != len(self.steps):
            return False
        if plan.new_requests:  # re-sent: fresh state
            req_ids = {step.req_id for step in self.steps}
            if any(new.req_id in req_ids for new in plan.new_requests):
                return False
        page_size = self.page_size
        for s, step, token_id in zip(scheduled, self.steps, self.token_ids):
            position = step.num_computed_tokens
            if (
                s.req_id != step.req_id
                or s.num_computed_tokens != position
                or s.token_ids != [token_id]
                or not s.sample
                or s.forced_token_id is not None
                or s.want_prompt_logprobs
            ):
                return False
            table, read = s.block_ids, step.block_ids
            if table != read:  # a page more (or another table): compare the entries step n+1 read
                needed = blocks_needed(step, page_size)
                if table[:needed] != read[:needed]:
                    return False
        for s, window in zip(scheduled, self.window_blocks):
            if window and s.group_block_ids[0][: len(window)] != window:
                return False
        return True


def next_step(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """Step n+1 as the scheduler would plan it, but with token 0 (the real ids are filled on the device)."""
    return [
        ScheduledRequest(req_id=s.req_id, token_ids=[0], num_computed_tokens=s.num_computed_tokens + 1,
                         block_ids=s.block_ids, group_block_ids=s.group_block_ids, sample=True)
        for s in scheduled
    ]


class DecodeOverlap:
    """Launches speculative steps and keeps the one pending; counts how many were used and dropped."""

    def __init__(self, graphs, page_size: int, device: torch.device, window: int | None = None):
        self.graphs = graphs  # helios.runner.cuda_graphs.GraphRunner
        self.page_size = page_size
        self.window = window  # the model's window page group, None without one
        self.is_cuda = device.type == "cuda"
        # step n's ids land here (pinned: the copy is truly asynchronous); on the CPU they are read directly
        self.host_ids = torch.zeros(graphs.buckets[-1], dtype=torch.int64, pin_memory=self.is_cuda)
        self.pending: Speculation | None = None
        self.num_hits = 0
        self.num_misses = 0

    def take(self, plan: SchedulerOutput, bucket: int | None, rows: list[ScheduledRequest] | None = None) -> bool:
        """Whether this plan (`rows`: only those of its rows, a mixed step's decode rows in `bucket`) is the pending
        speculation (then its logits are in the static buffer); either way nothing is pending afterwards."""
        spec, self.pending = self.pending, None
        if spec is None:
            return False
        if spec.matches(plan, bucket, self.graphs.buffers.num_loads, rows):
            self.num_hits += 1
            return True
        self.num_misses += 1
        return False

    def launch(self, scheduled: list[ScheduledRequest], bucket: int, token_ids: torch.Tensor) -> list[int]:
        """Enqueue step n+1 after step n, whose sampled ids (`token_ids`, [num_seqs] int64 on the device) are
        its inputs; returns those ids on the host once they (not step n+1) are ready."""
        n = len(scheduled)
        if self.is_cuda:
            host = self.host_ids[:n]
            host.copy_(token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        after = next_step(scheduled)
        inputs = self.graphs.prepare(after, bucket)
        # NOTE: step n's logits (a view of the static buffer) are read only by the sampling kernels already
        # enqueued; the replay below overwrites them after those in stream order.
        self.graphs.run_next(inputs, token_ids)
        if self.is_cuda:
            ready.synchronize()
            ids = host.tolist()
        else:
            ids = token_ids.tolist()
        self.pending = Speculation(
            bucket=bucket,
            steps=after,
            token_ids=ids,
            page_size=self.page_size,
            num_loads=self.graphs.buffers.num_loads,
            window_blocks=[self._window_blocks(s) for s in after] if self.window is not None else [],
        )
        return ids

    def _window_blocks(self, s: ScheduledRequest) -> list[int]:
        """Step n+1's window table as its plan will hold it: -1 before the window of its query (position p)."""
        first = max(0, s.num_computed_tokens - self.window + 1) // self.page_size
        table = s.group_block_ids[0][: blocks_needed(s, self.page_size)]
        return [-1] * min(first, len(table)) + table[first:]
