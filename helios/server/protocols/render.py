"""POST /v1/chat/completions/render and /v1/completions/render: vLLM's render routes, for routers.

A router (llm-d's inference scheduler, a prefix-aware gateway) asks a replica for a request's prompt token ids
without generating. Each route decodes its body with the generating route's own `decode` and runs the same
`helios.frontend.prepare` (template, tokenization, budgets, sampling, grammar), so it refuses what the generating
route refuses (400, OpenAI error shape) and returns the ids that route would prefill; nothing reaches the engine.

The answer is vLLM's `GenerateRequest` (vllm/entrypoints/.../serve/render: request_id, token_ids, features,
sampling_params, model, stream, stream_options, cache_salt, priority, kv_transfer_params): one object for chat,
a JSON array of one per prompt for completions. `sampling_params` spells the resolved engine SamplingParams with
vLLM's field names. No torch.
"""

from __future__ import annotations

import dataclasses
import uuid

from helios.engine.messages import SamplingParams
from helios.frontend.context import ModelContext
from helios.frontend.prepare import Choice, GenerationRequest, prepare as prepare_request
from helios.frontend.sampling import InvalidRequest
from helios.server.errors import from_invalid
from helios.server.protocols import openai_chat, openai_completions


def chat(body: bytes, ctx: ModelContext) -> dict:
    """The chat body -> one GenerateRequest object: the rendered conversation's ids and the first choice's
    resolved sampling (n choices differ only by seed + j)."""
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        req, neutral = openai_chat.decode(body, ctx)
        prep = prepare_request(ctx, neutral, request_id)
    except InvalidRequest as e:
        raise from_invalid(e) from None
    return _generate_request(request_id, prep.prompt_ids, prep.choices[0], neutral, req.model, req.stream,
                             req.stream_options)


def completions(body: bytes, ctx: ModelContext) -> list[dict]:
    """The completions body -> one GenerateRequest object per prompt, in prompt order."""
    try:
        req, _, _, neutral = openai_completions.decode(body, ctx)
        # NOTE: max_tokens 0 without scoring submits nothing; render still resolves each prompt's sampling
        neutral = dataclasses.replace(neutral, submit_zero_tokens=True)
        prep = prepare_request(ctx, neutral, "render")
    except InvalidRequest as e:
        raise from_invalid(e) from None
    firsts = [c for c in prep.choices if c.index % neutral.n == 0]  # choice index = prompt index * n + j
    return [_generate_request(f"cmpl-{uuid.uuid4().hex}", c.request.prompt_token_ids, c, neutral, req.model,
                              req.stream, req.stream_options) for c in firsts]


def _generate_request(request_id: str, token_ids: list[int], choice: Choice, neutral: GenerationRequest,
                      model: str | None, stream: bool, stream_options) -> dict:
    """vLLM's GenerateRequest fields; multimodal `features` are always null (text-only cores)."""
    return {
        "request_id": request_id,
        "token_ids": list(token_ids),
        "features": None,
        "sampling_params": sampling_params(choice.request.sampling, neutral),
        "model": model,
        "stream": bool(stream),
        "stream_options": stream_options if stream else None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": None,
    }


def sampling_params(s: SamplingParams, neutral: GenerationRequest) -> dict:
    """The resolved engine sampling under vLLM SamplingParams names (top_k -1: disabled, as vLLM reads it)."""
    return {
        "n": neutral.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
        "seed": s.seed,
        "max_tokens": s.max_tokens,
        "ignore_eos": s.ignore_eos,
        "stop": list(neutral.fields.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "logprobs": s.logprobs,
        "prompt_logprobs": s.prompt_logprobs,
        "skip_special_tokens": neutral.skip_special_tokens,
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None,
    }
