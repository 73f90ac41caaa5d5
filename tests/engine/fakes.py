"""A fake runner that checks the step contract and samples tokens deterministically by position."""

from __future__ import annotations

from collections import defaultdict

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore, RequestExecutionError
from helios.engine.messages import (
    EngineOutput,
    EngineRequest,
    ModelRunnerOutput,
    PositionLogprobs,
    RequestResult,
    SamplingParams,
    SchedulerOutput,
    TokenLogprob,
)
from helios.engine.request import RequestStatus
from helios.engine.scheduler import Scheduler

VOCAB = 1000


def context_token(context: list[int]) -> int:
    """The fake model: the next token is a function of the whole context (so recompute must match)."""
    acc = len(context)
    for i, t in enumerate(context):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return 10 + acc % (VOCAB - 10)  # never 0..9: tests use those as EOS / stop ids


class FakeRunner:
    """Tracks a simulated paged KV (the token id in every slot, and in every host record of the host tier) and
    asserts the scheduler's plans are consistent: every chunk finds exactly its request's earlier tokens in its
    pages (cached, copied in from host records, or written by its own earlier chunks), and a page shared by two
    live requests is never written. Copies run as the real runner runs them: spill, disk_drop, copy-out, load,
    copy-in. `disk` (hash -> token ids) stands for the disk tier's record directory; a load of a missing record
    raises what the real runner raises (RequestExecutionError naming no request), after the earlier copies.

    With a window group (`window`: SchedulerConfig.sliding_window) it also keeps the group's pages apart: every chunk
    finds its request's tokens of its queries' windows in its group table's pages (and writes its own there, never
    into a page another live table holds), and its table names no page before that window (-1 there: the scheduler
    returned them), so a page the group's pool got back is never read.

    `script[req_id]` overrides the sampled tokens by output index; `fail(plan)` may return an exception.
    """

    def __init__(self, page_size: int, script: dict[str, list[int]] | None = None, fail=None,
                 disk: dict[bytes, list[int | None]] | None = None, window: int | None = None) -> None:
        self.page_size = page_size
        self.window = window
        self.window_slots: dict[int, list[int | None]] = defaultdict(lambda: [None] * page_size)  # its pages
        self.window_tables: dict[str, list[int]] = {}
        self.script = script or {}
        self.fail = fail
        self.kv: dict[str, list[int] | None] = {}  # tokens in KV per request; None until its first chunk
        self.slots: dict[int, list[int | None]] = defaultdict(lambda: [None] * page_size)  # page -> token ids
        self.host: dict[int, list[int | None]] = {}  # host record (slot) -> token ids
        self.num_copied_out = self.num_copied_in = 0
        self.disk: dict[bytes, list[int | None]] = disk if disk is not None else {}  # the disk tier's files
        self.num_spilled = self.num_loaded = 0
        self.known: dict[str, list[int]] = {}  # prompt + outputs as the runner knows them
        self.num_prompt: dict[str, int] = {}
        self.sampling: dict[str, SamplingParams] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.plans: list[SchedulerOutput] = []
        self.num_new = defaultdict(int)  # req_id -> times sent as new (1 + preemptions)
        self.ignore_masks = False  # a broken runner: samples outside structured output's token masks

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.plans.append(plan)
        assert plan.scheduled, "the runner is never handed an empty batch"
        assert plan.num_scheduled_tokens == sum(len(s.token_ids) for s in plan.scheduled)
        for req_id in plan.finished_req_ids:
            for table in (self.kv, self.known, self.num_prompt, self.sampling, self.block_tables, self.window_tables):
                table.pop(req_id, None)
        for new in plan.new_requests:
            assert new.req_id not in self.kv, f"{new.req_id} sent as new twice without a drop"
            self.kv[new.req_id] = None
            self.known[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.num_prompt[new.req_id] = len(new.prompt_token_ids)
            self.sampling[new.req_id] = new.sampling
            self.num_new[new.req_id] += 1
        if self.fail is not None and (exc := self.fail(plan)) is not None:
            raise exc
        self._copy(plan)
        for s in plan.scheduled:
            self.block_tables[s.req_id] = list(s.block_ids)
            assert len(s.group_block_ids) == (self.window is not None), s.req_id
            if self.window is not None:
                self.window_tables[s.req_id] = list(s.group_block_ids[0])
        owners: dict[int, int] = defaultdict(int)
        for table in self.block_tables.values():
            for block_id in table:
                owners[block_id] += 1
        window_owners: dict[int, int] = defaultdict(int)
        for table in self.window_tables.values():
            for block_id in table:
                window_owners[block_id] += block_id >= 0
        results = []
        for s in plan.scheduled:
            kv, known = self.kv[s.req_id], self.known[s.req_id]
            if kv is None:  # the first chunk: it may start after a cached prefix, read back from the pages
                kv = self.kv[s.req_id] = self._read(s.block_ids, s.num_computed_tokens)
                assert s.num_computed_tokens % self.page_size == 0 and kv == known[: len(kv)], s.req_id
            assert s.num_computed_tokens == len(kv), (s.req_id, s.num_computed_tokens, len(kv))
            # attention reads every earlier position from the pages: they must hold this request's tokens
            assert self._read(s.block_ids, len(kv)) == kv, f"{s.req_id} reads another prefix's KV"
            assert s.token_ids == known[len(kv) : len(kv) + len(s.token_ids)], s.req_id
            assert s.token_ids, "a scheduled request has tokens"
            start = len(kv)
            kv.extend(s.token_ids)
            # exactly the pages its tokens fill, or (a decode step) also the page of its next position
            extra = len(s.block_ids) - -(-len(kv) // self.page_size)
            lookahead = len(s.token_ids) == 1 and s.sample and len(kv) % self.page_size == 0
            assert extra == 0 or (extra == 1 and lookahead), (s.req_id, len(s.block_ids), len(kv))
            for position in range(start, len(kv)):
                block_id = s.block_ids[position // self.page_size]
                assert owners[block_id] == 1, f"{s.req_id} writes page {block_id}, shared by {owners[block_id]}"
                self.slots[block_id][position % self.page_size] = kv[position]
            if self.window is not None:
                self._run_window(s, kv, start, window_owners)
            num_prompt = self.num_prompt[s.req_id]
            prompt_logprobs = None
            if s.want_prompt_logprobs:
                positions = range(start + 1, min(len(kv), num_prompt - 1) + 1)
                prompt_logprobs = [_record(known[p], p) for p in positions]
            token = logprobs = None
            if s.sample:
                assert len(kv) == len(known), "sample only at the last known token"
                index = len(kv) - num_prompt
                scripted = self.script.get(s.req_id)
                token = scripted[index] if scripted is not None and index < len(scripted) else context_token(kv)
                if s.forced_token_id is not None:  # like the real runner: no draw, no logprob record
                    token = s.forced_token_id
                elif s.token_mask is not None and not self.ignore_masks and not allowed(s.token_mask, token):
                    token = min(t for t in range(VOCAB) if allowed(s.token_mask, t))  # a masked draw
                known.append(token)
                if self.sampling[s.req_id].logprobs is not None and s.forced_token_id is None:
                    logprobs = _record(token, len(kv))
            else:
                assert s.forced_token_id is None, "a token is forced only where one is sampled"
                assert s.token_mask is None, "a token mask comes only where one is sampled"
                assert len(kv) < len(known) or self.sampling[s.req_id].max_tokens == 0
            results.append(
                RequestResult(
                    req_id=s.req_id, sampled_token_id=token, logprobs=logprobs, prompt_logprobs=prompt_logprobs
                )
            )
        return ModelRunnerOutput(results=results)

    def _copy(self, plan: SchedulerOutput) -> None:
        out_slots = [slot for _, slot in plan.copy_out]
        in_slots = [slot for slot, _ in plan.copy_in]
        load_slots = [slot for _, slot in plan.load]
        spill_slots = [slot for slot, _ in plan.spill]
        assert len(set(out_slots)) == len(out_slots), "a host record written twice in one plan"
        assert not set(out_slots) & set(in_slots), "a host record written and read in one plan"
        assert len({b for _, b in plan.copy_in}) == len(plan.copy_in), "a page copied into twice"
        assert len(set(spill_slots)) == len(spill_slots), "a host record spilled twice in one plan"
        assert len(set(load_slots)) == len(load_slots), "a host record loaded twice in one plan"
        assert not set(load_slots) & set(out_slots), "a host record loaded and copied out in one plan"
        assert not {h for _, h in plan.load} & set(plan.disk_drop), "a disk record loaded and dropped in one plan"
        for slot, block_hash in plan.spill:
            assert slot in self.host, f"spill of host record {slot}, never written"
            if block_hash in self.disk:  # a record named by a hash always holds the same tokens
                assert self.disk[block_hash] == self.host[slot], "one hash, two records"
            self.disk[block_hash] = list(self.host[slot])
        for block_hash in plan.disk_drop:
            self.disk.pop(block_hash, None)
        for block_id, slot in plan.copy_out:
            assert block_id in self.slots, f"copy-out of page {block_id}, never written"
            self.host[slot] = list(self.slots[block_id])
        for block_hash, slot in plan.load:
            if block_hash not in self.disk:
                raise RequestExecutionError(set(), f"host disk tier: no record {block_hash.hex()}")
            self.host[slot] = list(self.disk[block_hash])
        for slot, block_id in plan.copy_in:
            assert slot in self.host, f"copy-in of host record {slot}, never written"
            self.slots[block_id] = list(self.host[slot])
        self.num_copied_out += len(plan.copy_out)
        self.num_copied_in += len(plan.copy_in)
        self.num_spilled += len(plan.spill)
        self.num_loaded += len(plan.load)

    def _run_window(self, s, kv: list[int], start: int, owners: dict[int, int]) -> None:
        """The window group's side of a chunk of positions start .. len(kv) - 1 (kv already holds them)."""
        table, page = s.group_block_ids[0], self.page_size
        assert len(table) == len(s.block_ids), (s.req_id, len(table), len(s.block_ids))
        lo = max(0, start - self.window + 1)  # the first key the chunk's first query sees
        assert all(b == -1 for b in table[: lo // page]), f"{s.req_id} holds a page before its window: {table}"
        for position in range(lo, len(kv)):
            block_id = table[position // page]
            assert block_id >= 0, f"{s.req_id} reads or writes position {position} in a returned page"
            if position < start:
                assert self.window_slots[block_id][position % page] == kv[position], f"{s.req_id} window KV"
            else:
                assert owners[block_id] == 1, f"{s.req_id} writes window page {block_id}, shared"
                self.window_slots[block_id][position % page] = kv[position]

    def _read(self, block_ids: list[int], num_tokens: int) -> list[int]:
        return [self.slots[block_ids[p // self.page_size]][p % self.page_size] for p in range(num_tokens)]


def allowed(mask: bytes, token_id: int) -> bool:
    """Whether a token mask (little-endian int32 bitmask words) allows token_id."""
    return token_id >> 3 < len(mask) and bool(mask[token_id >> 3] >> (token_id & 7) & 1)


def _record(token_id: int, position: int) -> PositionLogprobs:
    return PositionLogprobs(token=TokenLogprob(token_id, -0.01 * position, 1), alternatives=[])


def make_core(script=None, fail=None, disk=None, constraints=None, **config) -> tuple[EngineCore, FakeRunner]:
    """disk: the disk tier's records (hash -> token ids) a restarted server would find, least recently used first;
    constraints: structured output's grammar owner (helios.engine.constraint.ConstraintOwner)."""
    defaults = dict(max_concurrency=4, max_num_batched_tokens=64, prefill_chunk_size=16, page_size=4, num_pages=64)
    cfg = SchedulerConfig(**{**defaults, **config})
    runner = FakeRunner(cfg.page_size, script=script, fail=fail, disk=disk, window=cfg.sliding_window or None)
    return EngineCore(cfg, runner, list(runner.disk), constraints=constraints), runner


def request(req_id: str, prompt_len: int = 8, seed: int = 0, reasoning_budget=None, constraint=None,
            **sampling) -> EngineRequest:
    prompt = [10 + (seed * 131 + i * 17 + len(req_id)) % 500 for i in range(prompt_len)]
    return EngineRequest(req_id=req_id, prompt_token_ids=prompt, sampling=SamplingParams(**sampling),
                         reasoning_budget=reasoning_budget, constraint=constraint)


class Collected:
    """Outputs folded per request."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.outputs: dict[str, list[EngineOutput]] = defaultdict(list)
        self.final: dict[str, EngineOutput] = {}
        self.finish_order: list[str] = []

    def add(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            assert out.req_id not in self.final, f"output after the terminal one for {out.req_id}"
            self.tokens[out.req_id].extend(out.new_token_ids)
            self.outputs[out.req_id].append(out)
            if out.finished:
                self.final[out.req_id] = out
                self.finish_order.append(out.req_id)


def run_until_idle(core: EngineCore, collected: Collected | None = None, max_steps: int = 10_000) -> Collected:
    collected = collected or Collected()
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return collected
        collected.add(core.step())
    raise AssertionError("the engine did not drain")


def reference_tokens(req: EngineRequest, **config) -> list[int]:
    """Tokens of `req` run alone on a roomy engine."""
    core, _ = make_core(**{**config, "num_pages": 4096})
    core.add_request(req)
    return run_until_idle(core).tokens[req.req_id]


def page_owners(sched: Scheduler) -> dict[int, int]:
    """{page: how many requests hold it}, after checking the pool's invariants, that only running requests
    hold pages and that the pool counts exactly these pages as used."""
    pool = sched.block_pool
    pool.check_invariants()
    owners: dict[int, int] = {}
    for req in sched.requests.values():
        if req.status is not RequestStatus.RUNNING:
            assert not req.block_ids, req
        for b in req.block_ids:
            owners[b] = owners.get(b, 0) + 1
    assert len(owners) == pool.num_used_blocks
    window_page_owners(sched)
    return owners


def window_page_owners(sched: Scheduler) -> list[dict[int, int]]:
    """Per window group {page: tables naming it}, after checking its pool's invariants and that every page a live
    table names is held by exactly the tables naming it (so no returned page is still in a table to be read)."""
    result = []
    for i, group in enumerate(sched.window_groups):
        group.pool.check_invariants()
        owners: dict[int, int] = {}
        for req in sched.requests.values():
            if req.status is not RequestStatus.RUNNING:
                assert not req.group_block_ids, req
                continue
            assert len(req.group_block_ids[i]) == len(req.block_ids), req
            for b in req.group_block_ids[i]:
                if b >= 0:
                    owners[b] = owners.get(b, 0) + 1
        assert len(owners) == group.pool.num_used_blocks
        assert all(group.pool.ref_count(b) == n for b, n in owners.items())
        result.append(owners)
    return result
