"""prepare_batch on CUDA makes every tensor on the host and moves them in one asynchronous copy per dtype
(input_batch.upload): the same batch as made on the host, each tensor a 16-byte aligned view of its dtype's buffer.
On this machine the packing (input_batch.stage) and the rebuilt batch run with the copy stood in for; the gpu-marked
test runs the real pinned copies."""

from __future__ import annotations

import pytest
import torch

from helios.engine.messages import SamplingParams, ScheduledRequest
from helios.runner import input_batch
from helios.runner.input_batch import RequestState, prepare_batch, stage
from helios.runner.sampler import SamplerState

PAGE = 4


def scheduled() -> list[ScheduledRequest]:
    return [
        ScheduledRequest(req_id="a", token_ids=[5, 6, 7], num_computed_tokens=0, block_ids=[3], sample=True,
                         state_slot=1, group_block_ids=[[3]]),
        ScheduledRequest(req_id="b", token_ids=[9], num_computed_tokens=6, block_ids=[4, 8], sample=True,
                         state_slot=0, group_block_ids=[[-1, 8]]),
    ]


def requests() -> dict[str, RequestState]:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    return {r: RequestState(req_id=r, prompt_token_ids=list(range(1, 8)), sampling=params,
                            sampler_state=SamplerState(params, list(range(1, 8)))) for r in ("a", "b")}


def flat(batch) -> dict:
    """Every tensor of a prepared batch, by name, on the host."""
    m = batch.meta
    out = {name: getattr(m, name) for name in input_batch._META_TENSORS if getattr(m, name) is not None}
    for w, (tables, slots) in m.window_groups.items():
        out[f"w{w}.tables"], out[f"w{w}.slots"] = tables, slots
    out.update(token_ids=batch.token_ids, logits_indices=batch.logits_indices)
    return {k: v.cpu() for k, v in out.items()}


def test_stage_packs_each_dtype_at_aligned_offsets():
    tensors = [torch.arange(3), torch.arange(5, dtype=torch.int32), torch.arange(6).view(2, 3), torch.zeros(0),
               torch.arange(7, dtype=torch.int32).view(7, 1)]
    packed = stage(tensors, pin=False)
    assert [buf.dtype for buf, _ in packed] == [torch.int64, torch.int32, torch.float32]
    seen = set()
    for buf, places in packed:
        for i, offset in places:
            assert (offset * buf.element_size()) % 16 == 0
            view = buf[offset : offset + tensors[i].numel()].view(tensors[i].shape)
            assert torch.equal(view, tensors[i]) and view.dtype == tensors[i].dtype
            seen.add(i)
    assert seen == set(range(len(tensors)))


def test_a_cuda_batch_is_the_host_batch_moved(monkeypatch):
    """With the device copy stood in for (the staged buffer itself), prepare_batch's CUDA branch rebuilds every
    field: the host batch's values, shapes and dtypes, the host lists untouched, window groups and n-gram context
    too."""

    def fake_upload(tensors, device):
        out = [None] * len(tensors)
        for staged, places in stage(tensors, pin=False):
            for i, offset in places:
                out[i] = staged[offset : offset + tensors[i].numel()].view(tensors[i].shape)
        return out

    monkeypatch.setattr(input_batch, "upload", fake_upload)
    options = dict(scratch_slot=7, context=(2, 0), window=8)
    host = prepare_batch(scheduled(), requests(), PAGE, "cpu", **options)
    moved = prepare_batch(scheduled(), requests(), PAGE, "cuda", **options)
    want, got = flat(host), flat(moved)
    assert want.keys() == got.keys() and "w8.tables" in want and "context_token_ids" in want
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert moved.meta.query_start_loc_cpu == host.meta.query_start_loc_cpu
    assert moved.meta.state_slots_cpu == host.meta.state_slots_cpu and moved.rows == host.rows
    assert moved.meta.derived == {} and moved.meta.derived is not host.meta.derived


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_pinned_copies_give_the_host_batch():
    options = dict(scratch_slot=7, context=(2, 0), window=8)
    host = flat(prepare_batch(scheduled(), requests(), PAGE, "cpu", **options))
    batch = prepare_batch(scheduled(), requests(), PAGE, "cuda", **options)
    torch.cuda.synchronize()
    assert batch.token_ids.is_cuda and batch.meta.block_tables.is_cuda
    for name, value in flat(batch).items():
        assert torch.equal(value, host[name]), name


def test_a_mixed_steps_single_rows_are_made_once_for_every_layer():
    """attention.single_rows: the token rows of a mixed step's one-token sequences, derived once per step (every MLA,
    DSA, compressed or torch-backend layer reads the same tensor) and moved without a stream sync (transfer)."""
    from helios.layers.attention import single_rows
    from helios.layers.transfer import device_tensor, to_device

    meta = prepare_batch(scheduled(), requests(), PAGE).meta  # "a" a 3-token chunk at rows 0-2, "b" one token at 3
    rows = single_rows(meta, [1], torch.device("cpu"))
    assert rows.tolist() == [3] and rows.dtype == torch.int64
    assert single_rows(meta, [1], torch.device("cpu")) is rows
    assert torch.equal(device_tensor([1, 2], torch.int32, "cpu"), torch.tensor([1, 2], dtype=torch.int32))
    t = torch.arange(4)
    assert to_device(t, "cpu") is t
