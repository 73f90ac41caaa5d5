"""prepare_batch's recurrent state slots (a hybrid model): each request reads its own row, a request the engine gave
none (forward_logits) the scratch row, and two such requests in one step are refused rather than sharing a row."""

from __future__ import annotations

import pytest

from helios.engine.messages import ScheduledRequest
from helios.runner.input_batch import prepare_batch

PAGE = 4
SCRATCH = 9


def chunk(req_id: str, slot: int) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[1, 2], num_computed_tokens=0, block_ids=[3], sample=True,
                            state_slot=slot)


def test_each_request_reads_its_slot_and_one_without_reads_the_scratch_row():
    meta = prepare_batch([chunk("a", 2), chunk("b", -1), chunk("c", 0)], {}, PAGE, scratch_slot=SCRATCH).meta
    assert meta.state_slots_cpu == [2, SCRATCH, 0] and meta.state_slots.tolist() == [2, SCRATCH, 0]
    assert prepare_batch([chunk("a", 2)], {}, PAGE).meta.state_slots is None  # no recurrent layers: no slots


def test_two_requests_without_a_slot_in_one_step_are_refused():
    with pytest.raises(ValueError, match="no recurrent state slot"):
        prepare_batch([chunk("a", -1), chunk("b", -1)], {}, PAGE, scratch_slot=SCRATCH)
