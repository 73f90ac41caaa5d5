"""POST /v1/completions: raw prompts (string, strings, ids, id lists), n, echo, logprobs, prompt scoring.

Choice index = prompt_index * n + choice_index; the seed advances by choice index. max_tokens 0 returns
the (optional) echo without submission, or scores the prompt when prompt logprobs are asked for.
decode (raw prompts' ids, SamplingFields, OutputFormat) -> helios.frontend.prepare -> encode (text_completion
objects or SSE chunks). Refusals become ApiError in `prepare`. No torch.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from msgspec import Struct

from helios.frontend.context import ModelContext
from helios.frontend.prepare import GenerationRequest, prepare as prepare_request
from helios.frontend import structured
from helios.frontend.sampling import InvalidRequest, SamplingRequest, sampling_fields, stop_strings
from helios.output.processor import TokenEntry, finite
from helios.server.errors import bad_request, decode_body, from_invalid
from helios.server.generation import (Child, Generation, encode_prompt_logprobs, failure, finish_reason,
                                      reported_stop_reason, token_string, usage)
from helios.server.http import SSE_DONE, sse_event
from helios.server.protocols.openai_chat import StreamOptions
from helios.server.runtime import Runtime

MAX_N = 128


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: Any = None
    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    tools: Any = None
    tool_choice: Any = None
    thinking_token_budget: Any = None
    response_format: Any = None
    structured_outputs: Any = None  # native extension: json | json_object | regex | grammar | choice
    user: str | None = None


class Prompt(Struct):
    text: str  # what echo returns: the original text, or the decoded ids
    token_ids: list[int]


# --- decode -------------------------------------------------------------------------------------------------


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(req: CompletionRequest, ctx: ModelContext) -> list[Prompt]:
    p, tok = req.prompt, ctx.tokenizer
    if isinstance(p, str):
        items: list = [p]
    elif _is_ids(p) and p:
        items = [p]
    elif isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(_is_ids(x) for x in p)):
        items = p
    else:
        raise bad_request("prompt must be a string, an array of strings, a token-ID array or an array of "
                          "token-ID arrays (nonempty)", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = tok.encode(item)
            if not ids:  # empty text: the prepared BOS token alone, where the core has one
                bos = tok.info.bos_token_id
                if bos is None:
                    raise bad_request("an empty text prompt needs a core with a BOS token; this one has none",
                                      "prompt")
                ids = [bos]
            out.append(Prompt(item, ids))
        else:
            if not item:
                raise bad_request("token-ID prompts must be nonempty", "prompt")
            if any(not 0 <= t < ctx.manifest.arch.vocab_size for t in item):
                raise bad_request(f"prompt token ids must be in [0, {ctx.manifest.arch.vocab_size})", "prompt")
            out.append(Prompt(tok.decode(item), list(item)))
    return out


def _check_unsupported(req: CompletionRequest) -> None:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}]", "n")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (ranked sampling is not supported)", "best_of")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.tools or req.tool_choice is not None:
        raise bad_request("raw completions do not accept tools", "tools")
    if req.thinking_token_budget is not None:
        raise bad_request("raw completions do not accept thinking_token_budget", "thinking_token_budget")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise bad_request("logprobs must be in [0, 20]", "logprobs")
    if req.stream and req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs cannot be combined with stream: true", "prompt_logprobs")


class Prepared(Struct):
    req: CompletionRequest
    prompts: list[Prompt]
    children: list  # list[Child]; empty for max_tokens 0 without scoring
    prompt_k: int | None  # prompt logprob alternatives fetched from the engine

    @property
    def stream(self) -> bool:
        return self.req.stream


def decode(body: bytes, ctx: ModelContext) -> tuple[CompletionRequest, list[Prompt], int | None, GenerationRequest]:
    """The body -> (request, its prompts, the prompt logprob count, the neutral request); Completions' own checks
    on the way. Raises ApiError, or InvalidRequest from the shared sampling rules."""
    req = decode_body(body, CompletionRequest)
    _check_unsupported(req)
    prompts = _prompts(req, ctx)
    fmt = structured.one_format(structured.chat_response_format(req.response_format),
                                structured.native_structured_outputs(req.structured_outputs))
    scoring = req.echo and req.logprobs is not None
    # NOTE: echo + logprobs scores the prompt; an explicit prompt_logprobs overrides that count.
    prompt_k = req.prompt_logprobs if req.prompt_logprobs is not None else (req.logprobs if scoring else None)
    fields = sampling_fields(
        req, stop=stop_strings(req.stop), logprobs=req.logprobs, logprob_token_ids=req.logprob_token_ids,
        prompt_logprobs=max(prompt_k, req.logprobs or 0) if prompt_k is not None else None,
        logit_bias=req.logit_bias,
    )
    neutral = GenerationRequest([p.token_ids for p in prompts], fields, req.max_tokens, allow_zero_tokens=True,
                                submit_zero_tokens=prompt_k is not None, n=req.n, fmt=fmt,
                                skip_special_tokens=req.skip_special_tokens)
    return req, prompts, prompt_k, neutral


def prepare(body: bytes, ctx: ModelContext) -> Prepared:
    try:
        req, prompts, prompt_k, neutral = decode(body, ctx)
        prep = prepare_request(ctx, neutral, f"cmpl-{uuid.uuid4().hex}")
    except InvalidRequest as e:
        raise from_invalid(e) from None
    return Prepared(req, prompts, [Child.of(c) for c in prep.choices], prompt_k)


# --- encode -------------------------------------------------------------------------------------------------


def _top_map(ctx: ModelContext, chosen, alternatives, as_ids: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in [*alternatives, chosen]:
        key = token_string(ctx, t.token_id, as_ids)
        out.setdefault(key, finite(t.logprob))  # first entry wins when ids decode alike
    return out


def _prompt_arrays(ctx: ModelContext, prompt: Prompt, records, k: int, as_ids: bool,
                   start: int = 0, stop: int | None = None) -> dict:
    """Echoed prompt positions [start, stop): position 0 has null logprobs; offsets count preceding tokens."""
    tok = ctx.tokenizer
    stop = len(prompt.token_ids) if stop is None else stop
    tokens, lps, tops, offsets = [], [], [], []
    pos = sum(len(tok.token_text(t)) for t in prompt.token_ids[:start])
    for p in range(start, stop):
        tid = prompt.token_ids[p]
        tokens.append(token_string(ctx, tid, as_ids))
        offsets.append(pos)
        pos += len(tok.token_text(tid))
        rec = records[p - 1] if 0 < p <= len(records) else None
        lps.append(finite(rec.token.logprob) if rec else None)
        tops.append(_top_map(ctx, rec.token, rec.alternatives[:k], as_ids) if rec else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _gen_arrays(ctx: ModelContext, entries: list[TokenEntry], start: int, as_ids: bool) -> dict:
    return {
        "tokens": [token_string(ctx, e.token_id, as_ids) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_map(ctx, _chosen(e), e.top, as_ids) for e in entries],
        "text_offset": [start + e.text_offset for e in entries],
    }


class _Chosen(Struct):
    token_id: int
    logprob: float


def _chosen(e: TokenEntry) -> _Chosen:
    return _Chosen(e.token_id, e.logprob)


def _merge(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def _choice_logprobs(ctx, prep: Prepared, prompt: Prompt, child: Child | None, entries, with_prompt: bool):
    req = prep.req
    if req.logprobs is None:
        return None
    as_ids = req.return_tokens_as_token_ids
    start = len(prompt.text) if req.echo else 0
    gen = _gen_arrays(ctx, entries, start, as_ids)
    if with_prompt and req.echo:
        records = child.prompt_logprobs if child is not None else []
        return _merge(_prompt_arrays(ctx, prompt, records, req.logprobs, as_ids), gen)
    return gen


async def buffered(runtime: Runtime, prep: Prepared, gen: Generation) -> dict:
    """The text_completion object once every choice finished (echo-only choices were never submitted)."""
    await gen.run()
    req, ctx = prep.req, runtime.model
    for child in prep.children:
        if (err := failure(child)) is not None:
            raise err
    by_index = {c.index: c for c in prep.children}
    choices = []
    for i, prompt in enumerate(prep.prompts):
        for j in range(req.n):
            child = by_index.get(i * req.n + j)
            text = (prompt.text if req.echo else "") + (child.text if child else "")
            choice = {
                "index": i * req.n + j,
                "text": text,
                "logprobs": _choice_logprobs(ctx, prep, prompt, child, child.entries if child else [], True),
                "finish_reason": "length" if child is None else finish_reason(child, "completions"),
                "stop_reason": reported_stop_reason(child) if child is not None else None,
            }
            if prep.prompt_k is not None:
                records = child.prompt_logprobs if child else []
                choice["prompt_logprobs"] = encode_prompt_logprobs(ctx, records, prep.prompt_k)
            choices.append(choice)
    return {
        "id": prep.children[0].req_id.rsplit("-", 1)[0] if prep.children else f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": runtime.serving.model_id,
        "choices": choices,
        "usage": _usage(prep),
    }


def _usage(prep: Prepared) -> dict:
    by_index = {c.index: c for c in prep.children}
    num_prompt = sum(len(p.token_ids) for p in prep.prompts)
    cached = sum(by_index[i * prep.req.n].processor.num_cached_tokens
                 for i in range(len(prep.prompts)) if i * prep.req.n in by_index)
    return usage(num_prompt, sum(c.processor.num_generated for c in prep.children), cached, reasoning=False)


async def stream_events(runtime: Runtime, prep: Prepared, gen: Generation):
    """text_completion SSE events. Echo goes first; with logprobs, one frame per scored prompt chunk; the
    finishing chunk of a choice carries its stop_reason."""
    req, ctx = prep.req, runtime.model
    opts = req.stream_options or StreamOptions()
    include_usage, continuous = opts.include_usage, opts.include_usage and opts.continuous_usage_stats
    base = {"id": prep.children[0].req_id.rsplit("-", 1)[0] if prep.children else f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion", "created": int(time.time()), "model": runtime.serving.model_id}
    as_ids = req.return_tokens_as_token_ids
    scored: dict[int, int] = {}  # choice index -> prompt positions already sent

    def chunk(index: int, text: str, logprobs, finish: str | None = None, child: Child | None = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = reported_stop_reason(child) if child is not None else None
        body = {**base, "choices": [choice]}
        if continuous:
            body["usage"] = _usage(prep)
        elif include_usage:
            body["usage"] = None
        return sse_event(msgspec.json.encode(body))

    def echo(index: int, prompt: Prompt, records) -> bytes | None:
        sent = scored.get(index)
        if req.logprobs is None:
            if sent is not None:
                return None
            scored[index] = len(prompt.token_ids)
            return chunk(index, prompt.text, None)
        # NOTE: position p is scored once record p-1 arrived; position 0 goes with the first frame
        ready = min(len(records) + 1, len(prompt.token_ids))
        if sent is not None and ready <= sent:
            return None
        scored[index] = ready
        lp = _prompt_arrays(ctx, prompt, records, req.logprobs, as_ids, sent or 0, ready)
        return chunk(index, prompt.text if sent is None else "", lp)

    if not gen.children:  # max_tokens 0 without scoring: echo only, nothing submitted
        for i, prompt in enumerate(prep.prompts):
            for j in range(req.n):
                index = i * req.n + j
                yield chunk(index, prompt.text if req.echo else "", None, "length")
    else:
        async for child, delta in gen.deltas():
            if (err := failure(child)) is not None:
                yield sse_event(err.encode())
                return
            prompt = prep.prompts[child.index // req.n]
            if req.echo and (frame := echo(child.index, prompt, child.prompt_logprobs)) is not None:
                yield frame
            if delta.text or delta.entries or delta.finished:
                lp = _choice_logprobs(ctx, prep, prompt, child, delta.entries, False)
                finish = finish_reason(child, "completions") if delta.finished else None
                yield chunk(child.index, delta.text, lp, finish, child)
    if include_usage:
        yield sse_event(msgspec.json.encode({**base, "choices": [], "usage": _usage(prep)}))
    yield SSE_DONE
