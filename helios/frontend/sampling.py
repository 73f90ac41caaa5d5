"""Request sampling fields -> the engine's SamplingParams, under the core's declared defaults and ranges.

Prepared defaults fill omitted fields; numeric values are clamped to the core's inclusive ranges, and a
parameter without a range is fixed at its default (spec: "Reasoning, sampling, and usage"). Stop, logprob
and output-limit rules live here too, so every protocol applies them identically. Violations raise
InvalidRequest; the protocol turns it into its error object. No torch.
"""

from __future__ import annotations

import math

from msgspec import Struct

from helios.core.manifest import Manifest, Range
from helios.engine.messages import SamplingParams

MAX_STOP_STRINGS = 4
MAX_STOP_BYTES = 4096
MAX_STOP_TOKEN_SEQUENCES = 16
MAX_STOP_SEQUENCE_LEN = 64
MAX_LOGPROBS = 20
MAX_EXPLICIT_IDS = 128
MAX_LOGIT_BIAS = 1024  # logit_bias entries
LOGIT_BIAS_RANGE = 100.0  # |bias| bound (OpenAI's)
_CLAMPED = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class InvalidRequest(Exception):
    """A request the frontend rejects (HTTP 400 invalid_request_error); `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class SamplingRequest(Struct, kw_only=True):
    """The sampling and token-stop fields every generating protocol's request body carries under the same names;
    the protocol request Structs inherit them (None: the client omitted the field)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    stop_token_sequences: list[list[int]] | None = None
    ignore_eos: bool = False


class SamplingFields(SamplingRequest, kw_only=True):
    """Neutral sampling request, as a protocol decoded it: the shared fields plus the protocol-specific ones."""

    max_tokens: int | None = None
    stop: list[str] = []
    logprobs: int | None = None  # generation logprobs: None off, N natural alternatives
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> added to its logit for the draw

    @property
    def has_stops(self) -> bool:
        """Custom stops of any kind (strings, token ids, token sequences)."""
        return bool(self.stop or self.stop_token_ids or self.stop_token_sequences)


def sampling_fields(req: SamplingRequest, *, stop: list[str], **extra) -> SamplingFields:
    """SamplingFields from any protocol request (a SamplingRequest); `stop` and the protocol-specific logprob
    fields come from the caller."""
    shared = {name: getattr(req, name) for name in SamplingRequest.__struct_fields__}
    return SamplingFields(**shared, stop=stop, **extra)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """The OpenAI routes' stop: one string, a list of strings, or none."""
    return [stop] if isinstance(stop, str) else list(stop or [])


def _clamp(value: float, rng: Range | None, default: float, name: str) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number", name)
    if rng is None:
        return default
    return min(max(value, rng.min), rng.max)


def _check_stops(fields: SamplingFields, vocab_size: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    stops = fields.stop
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop accepts at most {MAX_STOP_STRINGS} strings", "stop")
    if any(not s for s in stops):
        raise InvalidRequest("stop strings must be nonempty", "stop")
    if sum(len(s.encode()) for s in stops) > MAX_STOP_BYTES:
        raise InvalidRequest(f"stop strings may total at most {MAX_STOP_BYTES} UTF-8 bytes", "stop")
    token_ids, token_sequences = list(fields.stop_token_ids or []), list(fields.stop_token_sequences or [])
    sequences = [[t] for t in token_ids] + token_sequences
    if len(sequences) > MAX_STOP_TOKEN_SEQUENCES:
        raise InvalidRequest(
            f"stop_token_ids and stop_token_sequences accept at most {MAX_STOP_TOKEN_SEQUENCES} sequences in all",
            "stop_token_ids" if token_ids else "stop_token_sequences",
        )
    for seq in sequences:
        if not seq or len(seq) > MAX_STOP_SEQUENCE_LEN:
            raise InvalidRequest(
                f"each stop token sequence needs 1 to {MAX_STOP_SEQUENCE_LEN} token ids", "stop_token_sequences"
            )
        if any(not 0 <= t < vocab_size for t in seq):
            raise InvalidRequest(f"stop token ids must be in [0, {vocab_size})", "stop_token_ids")
    if stops and sequences:
        raise InvalidRequest("string stops cannot be combined with token stops", "stop")
    return tuple(token_ids), tuple(tuple(s) for s in token_sequences)


def _check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{"id": bias} -> ((id, bias), ...) in id order; ids in the vocabulary, biases finite within +-100."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias accepts at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids; got {key!r}", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
        if not (math.isfinite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
            raise InvalidRequest(f"logit_bias values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
                                 "logit_bias")
        out[token_id] = float(value)
    return tuple(sorted(out.items()))


def _check_logprobs(fields: SamplingFields, manifest: Manifest) -> tuple[int, ...] | None:
    caps = manifest.logprobs
    if fields.logprobs is not None:
        if not 0 <= fields.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs alternatives must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if caps.max_top_logprobs == 0:
            raise InvalidRequest("this core was exported without generation logprob outputs", "logprobs")
        if fields.logprobs > caps.max_top_logprobs:
            raise InvalidRequest(
                f"at most {caps.max_top_logprobs} logprob alternatives are supported by this core", "top_logprobs"
            )
    if fields.prompt_logprobs is not None:
        if not 0 <= fields.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
        if not caps.prompt_logprobs:
            raise InvalidRequest(
                "this core has no prompt-logprob graphs; re-export it with ignition export --prompt-logprobs",
                "prompt_logprobs",
            )
        if fields.prompt_logprobs > caps.max_top_logprobs:
            raise InvalidRequest(
                f"at most {caps.max_top_logprobs} prompt logprob alternatives are supported", "prompt_logprobs"
            )
    ids = fields.logprob_token_ids
    if not ids:  # null and [] behave as omission
        return None
    if fields.logprobs is None:
        raise InvalidRequest("logprob_token_ids requires generation logprobs to be enabled", "logprob_token_ids")
    if not caps.explicit_token_ids:
        raise InvalidRequest(
            "this core has no explicit-ID logprob inputs; re-export it to use logprob_token_ids", "logprob_token_ids"
        )
    limit = min(MAX_EXPLICIT_IDS, caps.max_explicit_token_ids or MAX_EXPLICIT_IDS)
    if len(ids) > limit:
        raise InvalidRequest(f"logprob_token_ids accepts at most {limit} ids", "logprob_token_ids")
    vocab = manifest.arch.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidRequest(f"logprob_token_ids must be in [0, {vocab})", "logprob_token_ids")
    return tuple(dict.fromkeys(ids))  # first-occurrence order


def resolve_max_tokens(
    requested: int | None, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int, allow_zero: bool,
    param: str = "max_tokens",
) -> int:
    """The output budget: explicit or default, bounded by the remaining context (400 when it cannot fit)."""
    remaining = max_model_len - num_prompt_tokens
    if remaining < 0 or (remaining == 0 and not (allow_zero and requested == 0)):
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt_tokens}",
            "messages",
        )
    if requested is None:
        return min(default_max_tokens, remaining)
    if requested < 0 or (requested == 0 and not allow_zero):
        raise InvalidRequest(f"{param} must be a positive integer", param)
    if requested > remaining:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt_tokens} "
            f"and {requested} output tokens were requested",
            param,
        )
    return requested


def resolve_sampling(fields: SamplingFields, manifest: Manifest, max_tokens: int, seed_offset: int = 0) -> SamplingParams:
    """Defaults, clamping, stop and logprob rules -> SamplingParams (max_tokens already resolved)."""
    defaults, ranges = manifest.sampling.defaults, manifest.sampling.ranges
    values = {}
    for name in _CLAMPED:
        value = getattr(fields, name)
        default = getattr(defaults, name)
        values[name] = default if value is None else _clamp(float(value), getattr(ranges, name), default, name)
    if values["temperature"] <= 0:  # only reachable through a malformed core range; keep the sampler valid
        values["temperature"] = defaults.temperature
    top_k = defaults.top_k
    if fields.top_k is not None:
        requested = -1 if fields.top_k == 0 else fields.top_k
        if requested < -1:
            raise InvalidRequest("top_k must be -1 (disabled) or a positive integer", "top_k")
        if ranges.top_k is not None:
            top_k = int(min(max(requested, ranges.top_k.min), ranges.top_k.max))
    seed = defaults.seed if fields.seed is None else fields.seed
    if not -(2**63) <= seed < 2**64:
        raise InvalidRequest("seed must be a 64-bit integer", "seed")
    stop_token_ids, stop_token_sequences = _check_stops(fields, manifest.arch.vocab_size)
    explicit = _check_logprobs(fields, manifest)
    return SamplingParams(
        **values,
        top_k=top_k,
        seed=(seed + seed_offset) % 2**64,
        max_tokens=max_tokens,
        ignore_eos=fields.ignore_eos,
        eos_token_ids=tuple(manifest.tokenizer.eos_token_ids),
        stop_token_ids=stop_token_ids,
        stop_token_sequences=stop_token_sequences,
        logprobs=fields.logprobs,
        logprob_token_ids=explicit,
        prompt_logprobs=fields.prompt_logprobs,
        logit_bias=_check_logit_bias(fields.logit_bias, manifest.arch.vocab_size),
    )
