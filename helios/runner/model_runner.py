"""The model runner: executes one engine plan (SchedulerOutput) on the model over the paged KV cache.

One step: drop finished requests, register new ones, flatten every scheduled request (prefill chunks
and decodes mixed) into one token batch, run the model once, compute logits only for the rows that
are used, sample, and extract logprobs. Plain data in and out (helios.engine.messages); tensors never
cross the boundary. Sampling and logprob extraction live in runner/sampler.py and runner/logprobs.py.
"""

from __future__ import annotations

import torch

from helios.core.manifest import Architecture
from helios.engine.messages import (
    ModelRunnerOutput,
    NewRequestData,
    PositionLogprobs,
    RequestResult,
    SchedulerOutput,
    ScheduledRequest,
)
from helios.models import build_model
from helios.runner.input_batch import PreparedBatch, RequestState, prepare_batch
from helios.runner.kv_cache import KVCache
from helios.runner.logprobs import logprobs_for, prompt_logprobs_for
from helios.runner.sampler import SamplerState, sample


class ModelRunner:
    """Owns the model, the KV cache and the per-request state of live requests."""

    def __init__(
        self,
        arch: Architecture,
        tensors: dict[str, torch.Tensor],
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
    ):
        self.arch = arch
        self.device = torch.device(device)
        self.dtype = dtype or tensors["embed.weight"].dtype
        self.page_size = page_size
        self.model = build_model(arch, tensors, self.device, self.dtype, attention_backend)
        self.kv_cache = KVCache.from_arch(arch, num_pages, page_size, self.dtype, self.device)
        self.requests: dict[str, RequestState] = {}

    # --- the step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        # NOTE: drops first: a preempted request can be dropped and re-sent as new in one plan.
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in plan.new_requests:
            self.requests[new.req_id] = self._new_state(new)
        if not plan.scheduled:
            return ModelRunnerOutput(results=[])
        unknown = [s.req_id for s in plan.scheduled if s.req_id not in self.requests]
        if unknown:
            raise KeyError(f"scheduled request {unknown[0]} was never sent as a new request")

        batch = prepare_batch(plan.scheduled, self.requests, self.page_size, self.device)
        hidden = self.model.forward(batch.token_ids, batch.meta, self.kv_cache.layers)  # [T, H]
        # float32 logits for the used rows only: sampling and logprobs both read the raw distribution
        logits = self.model.compute_logits(hidden[batch.logits_indices]).float()  # [N, V]
        return ModelRunnerOutput(results=self._postprocess(plan.scheduled, batch, logits))

    def _new_state(self, new: NewRequestData) -> RequestState:
        sampler_state = SamplerState(new.sampling, list(new.prompt_token_ids))
        # a request re-sent after preemption carries its outputs: they count for penalties again
        for token_id in new.output_token_ids:
            sampler_state.append(token_id)
        return RequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling=new.sampling,
            sampler_state=sampler_state,
        )

    def _postprocess(
        self,
        scheduled: list[ScheduledRequest],
        batch: PreparedBatch,
        logits: torch.Tensor,  # [N, V] float32
    ) -> list[RequestResult]:
        sampling_rows = [r for r in batch.rows if r.sample_row is not None]
        sampled: dict[str, int] = {}
        position_logprobs: dict[str, PositionLogprobs | None] = {}
        if sampling_rows:
            states = [self.requests[r.req_id] for r in sampling_rows]
            sample_logits = logits[[r.sample_row for r in sampling_rows]]  # [B, V]
            # NOTE: sample() leaves its input untouched, so logprobs below read the raw distribution.
            token_ids = sample(sample_logits, [st.sampler_state for st in states])
            for row, state, token_id in zip(sampling_rows, states, token_ids):
                sampled[row.req_id] = int(token_id)
                state.sampler_state.append(int(token_id))
            want = [i for i, st in enumerate(states) if st.wants_logprobs]
            if want:
                records = logprobs_for(
                    sample_logits[want],
                    torch.tensor([token_ids[i] for i in want], device=logits.device),
                    [states[i].sampling.logprobs for i in want],
                    [states[i].sampling.logprob_token_ids for i in want],
                )
                for i, record in zip(want, records):
                    position_logprobs[states[i].req_id] = record

        results = []
        for s, rows in zip(scheduled, batch.rows):
            prompt_records = None
            if s.want_prompt_logprobs:
                prompt_records = []
                if rows.prompt_next_token_ids:
                    n = len(rows.prompt_next_token_ids)
                    prompt_records = prompt_logprobs_for(
                        logits[rows.logits_start : rows.logits_start + n],
                        torch.tensor(rows.prompt_next_token_ids, device=logits.device),
                        self.requests[s.req_id].sampling.prompt_logprobs or 0,
                    )
            results.append(
                RequestResult(
                    req_id=s.req_id,
                    sampled_token_id=sampled.get(s.req_id),
                    logprobs=position_logprobs.get(s.req_id),
                    prompt_logprobs=prompt_records,
                )
            )
        return results

    # --- conveniences -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """[T, V] float32 logits of every position of one sequence, run through the paged path.

        For tests and scoring tools: it uses the *last* pages of the cache in reverse order (so the
        block table is not the identity) and overwrites them; do not mix with live requests.
        """
        num_blocks = (len(token_ids) + self.page_size - 1) // self.page_size
        if num_blocks > self.kv_cache.num_pages:
            raise ValueError(
                f"{len(token_ids)} tokens need {num_blocks} pages; the cache has {self.kv_cache.num_pages}"
            )
        block_ids = list(range(self.kv_cache.num_pages - 1, self.kv_cache.num_pages - 1 - num_blocks, -1))
        chunk_size = chunk_size or len(token_ids)
        out = []
        for start in range(0, len(token_ids), chunk_size):
            chunk = ScheduledRequest(
                req_id="forward_logits",
                token_ids=list(token_ids[start : start + chunk_size]),
                num_computed_tokens=start,
                block_ids=block_ids,
                sample=False,
            )
            batch = prepare_batch([chunk], {}, self.page_size, self.device)
            hidden = self.model.forward(batch.token_ids, batch.meta, self.kv_cache.layers)
            out.append(self.model.compute_logits(hidden).float())
        return torch.cat(out)
