"""State checkpoints at anchor and message positions (helios/engine/state_checkpoints.py, the scheduler's selection
at admission, anchor guards) with the fake recurrent-state runner of test_state_slots: a conversation under the same
system prompt resumes at the anchor, an edited last message resumes at the previous message's end, each with the
tokens of a run without reuse; the cost rule's skips, the anchor guard gauge, the anchors' eviction priority, the
host retention counters and their /metrics lines; the frontend's boundary offsets on the ChatML template."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from helios.engine.messages import EngineRequest, SamplingParams
from tests.engine.fakes import Collected, reference_tokens, run_until_idle
from tests.engine.test_state_slots import assert_slots_free, make_checkpointed

GRID = 8  # lcm(page 4, state chunk 8)


def tokens(n: int, seed: int) -> list[int]:
    return [10 + (seed * 131 + i * 17) % 500 for i in range(n)]


def chat(req_id: str, parts: list[list[int]], has_system: bool = True, max_tokens: int = 4) -> EngineRequest:
    """A rendered conversation of `parts` (system prompt first when has_system): the anchor after the system
    prompt, a message end after every part but the last (what helios/frontend/boundaries.py reports)."""
    ends = [sum(len(p) for p in parts[: i + 1]) for i in range(len(parts) - 1)]
    anchor = ends[0] if has_system else 0
    return EngineRequest(req_id=req_id, prompt_token_ids=[t for p in parts for t in p],
                         sampling=SamplingParams(max_tokens=max_tokens), anchor_end=anchor,
                         message_ends=ends[1:] if has_system else ends)


def run(core, req: EngineRequest) -> Collected:
    core.add_request(req)
    return run_until_idle(core, Collected())


SYSTEM = tokens(37, seed=1)  # the anchor at 37 -> grid position 32


def test_a_conversation_under_the_same_system_prompt_resumes_at_the_anchor():
    core, runner = make_checkpointed(prefill_chunk_size=24)
    first = chat("a", [SYSTEM, tokens(25, seed=2)])
    core.add_request(first)
    core.step()  # chunk 0-24: the anchor's guard is set aside until the chunk that ends at 32
    metrics = core.metrics()
    assert metrics.checkpoint_anchor_reservations == 1 and metrics.state_slots_in_use == 2
    core.step()
    assert runner.plans[-1].scheduled[0].num_computed_tokens == 24 and len(runner.plans[-1].scheduled[0].token_ids) == 8
    run_until_idle(core)
    metrics = core.metrics()
    assert metrics.checkpoint_captures["anchor"] == 1 and metrics.checkpoint_anchor_reservations == 0
    # the prompt's endpoint (56) and the decode's (64); a chat keeps no other chunk end (24)
    assert metrics.checkpoint_captures["endpoint"] == 2
    assert metrics.checkpoint_extra_work_ns > 0
    second = chat("b", [SYSTEM, tokens(30, seed=3)])  # another conversation: only the system prompt is shared
    out = run(core, second)
    assert out.final["b"].num_cached_tokens == 32 and out.tokens["b"] == reference_tokens(second)
    assert_slots_free(core)
    # a prompt whose endpoint is its anchor's position (39 tokens: both at 32) keeps it as an anchor
    core, _ = make_checkpointed()
    run(core, chat("c", [SYSTEM, tokens(2, seed=4)], max_tokens=1))
    assert core.metrics().checkpoint_captures == {"anchor": 1, "message": 0, "endpoint": 0}


def test_an_edited_last_message_resumes_at_the_previous_message_end():
    core, runner = make_checkpointed(state_checkpoint_slots=4)
    parts = [SYSTEM, tokens(20, seed=4), tokens(22, seed=5)]  # message ends at 57 (grid 56) and 79 (grid 72)
    first = chat("a", [*parts, tokens(15, seed=6)])
    run(core, first)
    ckpt = core.scheduler.checkpoints
    assert ckpt.captures["anchor"] == 1 and ckpt.captures["message"] == 2
    edited = chat("b", [*parts, tokens(18, seed=7)])
    out = run(core, edited)
    assert out.final["b"].num_cached_tokens == 72 and out.tokens["b"] == reference_tokens(edited)
    assert_slots_free(core)


def test_the_cost_rule_skips_by_reason_and_anchors_are_evicted_last():
    core, runner = make_checkpointed()
    sched = core.scheduler
    sched.prefill_ns_per_token = None  # unmeasured: no candidate can be priced
    sched.add_request(chat("u", [SYSTEM, tokens(20, seed=8), tokens(12, seed=9)]))
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    assert sched.checkpoints.skips["unknown_cost"] == 2 and not sched.requests["u"].checkpoint_plan
    # a copy dearer than the work allowance of a short prompt: its messages are not worth one
    core, _ = make_checkpointed(state_slot_bytes=10**9, state_copy_bytes_per_s=1e12)
    run(core, chat("w", [tokens(9, seed=10), tokens(9, seed=11), tokens(9, seed=12), tokens(9, seed=13)],
                   has_system=False))
    assert core.metrics().checkpoint_skips["work_budget"] == 3
    # one checkpoint slot, two anchors admitted in one step: the second finds no slot for its guard
    core, _ = make_checkpointed(state_checkpoint_slots=1)
    for rid, seed in (("s1", 20), ("s2", 21)):
        core.add_request(chat(rid, [tokens(37, seed=seed), tokens(20, seed=seed + 1)]))
    core.step()
    metrics = core.metrics()
    assert metrics.checkpoint_skips["storage"] == 1 and metrics.checkpoint_anchor_reservations == 1
    run_until_idle(core)
    assert core.metrics().checkpoint_anchor_reservations == 0
    # two slots: an anchor and endpoints; the endpoints of later unrelated requests evict each other, not the anchor
    core, _ = make_checkpointed()
    run(core, chat("c", [SYSTEM, tokens(25, seed=2)]))
    anchor = core.scheduler.checkpoints.roles
    for i in range(3):
        run(core, chat(f"f{i}", [tokens(30, seed=40 + i)], has_system=False, max_tokens=12))
    assert list(anchor.values()).count("anchor") == 1
    assert run(core, chat("d", [SYSTEM, tokens(9, seed=50)])).final["d"].num_cached_tokens == 32


def test_host_retention_counters_and_their_metrics_lines():
    from helios.server.metrics import Snapshot, render_prometheus
    from tests.engine.test_disk_cache import A, evict_to_disk_and_repeat
    from tests.engine.test_host_cache import prompt_request, run_one

    # checkpoints the one GPU slot lets go: into the one DRAM record, then onto a one-record disk, then dropped
    core, _ = make_checkpointed(state_checkpoint_slots=1, host_state_records=1, host_state_disk_records=1)
    parked = []
    for i in range(4):
        core.add_request(chat(f"r{i}", [tokens(21, seed=60 + i)], has_system=False, max_tokens=2))
        core.step()  # its prompt's endpoint at 16: the one GPU checkpoint before it goes to DRAM
        parked.append(core.metrics().host_parked_records)  # DRAM's record before it waits for the next plan
        run_until_idle(core)
    assert parked == [0, 0, 1, 1]
    metrics = core.metrics()
    assert metrics.host_held == {"dram": 3, "nvme": 2}
    assert metrics.host_dropped["nvme"] == {"end_of_chain": 1, "oversize": 0, "io_error": 0}
    assert metrics.host_slots_total == metrics.host_intake_slots == 1 and metrics.host_slots_in_use == 1
    assert metrics.host_parked_records == 0 and metrics.host_copyout_headroom_deferrals == 0
    # pages: a record whose disk file is gone fails its load (io_error); the same pages offered again are skipped
    core, runner, collected = evict_to_disk_and_repeat()
    runner.disk.clear()
    run_one(core, prompt_request("a2", A), collected)
    metrics = core.metrics()
    assert metrics.host_dropped["nvme"]["io_error"] >= 1 and metrics.host_store_skipped >= 1
    text = render_prometheus(Snapshot(**{f: getattr(metrics, f) for f in metrics.__struct_fields__
                                         if f in Snapshot.__struct_fields__})).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    dropped = {(s.labels["tier"], s.labels["reason"]): s.value for s in families["flare_host_cache_dropped"].samples
               if s.name.endswith("_total")}
    assert len(dropped) == 6 and dropped["nvme", "io_error"] == metrics.host_dropped["nvme"]["io_error"]
    held = {s.labels["tier"]: s.value for s in families["flare_host_cache_held"].samples if s.name.endswith("_total")}
    assert held == {"dram": metrics.host_held["dram"], "nvme": metrics.host_held["nvme"]}
    for name in ("flare_checkpoint_anchor_reservations", "flare_host_cache_parked_records",
                 "flare_host_cache_store_skipped_total", "flare_host_cache_slots_in_use",
                 "flare_host_cache_slots_total", "flare_host_cache_intake_slots",
                 "flare_host_cache_copyout_headroom_deferrals_total"):
        assert f"\n{name} " in text, name
    assert f"flare_host_cache_store_skipped_total {float(metrics.host_store_skipped)}" in text


def test_the_frontend_reports_the_anchor_and_message_ends_in_tokens(tmp_path):
    from helios.core.manifest import TemplateCaps, TokenizerInfo
    from helios.frontend.boundaries import message_boundaries
    from helios.frontend.chat import ChatMessage, ChatRenderer
    from helios.frontend.tokenizer import Tokenizer
    from tests.ignition.tiny_models import BOS_ID, CHATML_TEMPLATE, EOS_ID, VOCAB_SIZE, write_tokenizer

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json", TokenizerInfo(bos_token_id=BOS_ID, eos_token_ids=[EOS_ID]),
                              VOCAB_SIZE)
    renderer = ChatRenderer(CHATML_TEMPLATE, TemplateCaps(present=True, system_role=True), tok)
    messages = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="the cat sat"),
                ChatMessage(role="assistant", content="on the mat"), ChatMessage(role="user", content="and then?")]
    prompt = renderer.render(messages)
    anchor, ends = message_boundaries(renderer, messages, prompt)
    # each offset ends a message, with the next message's opening markup (its role is the probe's, or not)
    text = [tok.decode(prompt.token_ids[:n]) for n in (anchor, *ends)]
    assert text[0] == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
    assert text[1].endswith("the cat sat<|im_end|>\n<|im_start|>")
    assert text[2].endswith("on the mat<|im_end|>\n<|im_start|>user\n") and len(ends) == 2
