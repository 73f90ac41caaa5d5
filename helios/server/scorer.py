"""The scorer shared by /v1/systemone and /v1/decisions: neutral `Item`s in, engine requests, label logprobs out.

Each item is one conversation (a user turn: the common state, the question, its labelled options, an "Answer:"
cue) rendered with the core's template, generation prompt on, thinking off where the template reads
enable_thinking / thinking. Synthetic labels must be distinct single tokens as the first assistant token; one
generated token per question reads their raw logprobs (logprob_token_ids), one question after another (prefix
reuse after the first). Route modules decode and encode; this module imports none of them, and no torch.

Formulas (lp_i: a label's raw full-vocabulary logprob; p_i = exp(lp_i) / sum_j exp(lp_j) over the question's labels):
- noul / predicate: P(true) = p_yes / (p_yes + p_no).
- choice: the winner is argmax p_i, the first option on ties. score: sum(i * p_i) over zero-based levels; its
  winner (for confidence) is the most probable level, the first on ties.
- confidence: System One reports the winner's normalized probability p_w; a singleton choice or score is
  answered p = 1, confidence 1, without running the model. Decisions reports p_w * sum_j exp(lp_j) =
  exp(lp_w), the winner's full-vocabulary probability. Neither promises empirical calibration.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from helios.engine.messages import EngineRequest, SamplingParams
from helios.frontend.chat import ChatMessage, ChatPrompt
from helios.frontend.context import ModelContext
from helios.frontend.sampling import InvalidRequest, SamplingFields, resolve_sampling
from helios.frontend.tokenizer import Tokenizer
from helios.output.processor import OutputProcessor
from helios.server.errors import bad_request, from_invalid, server_error
from helios.server.generation import Child, Generation, failure
from helios.server.runtime import Runtime

MAX_QUESTIONS = 64
MAX_CRITERIA = 128  # choice options (System One 1.., Decisions 2..)
MAX_LEVELS = 10
ANSWER_CUE = "Answer:"
THINKING_KWARGS = ("enable_thinking", "thinking")  # template variables that switch reasoning; set False
_UPPER = [chr(c) for c in range(ord("A"), ord("Z") + 1)]
_LOWER = [chr(c) for c in range(ord("a"), ord("z") + 1)]
_BINARY_LABELS = (("yes", "no"), ("Yes", "No"), ("true", "false"), ("True", "False"))

Kind = Literal["binary", "choice", "score"]


@dataclass
class Item:
    """One neutral question: what its prompt shows, how its answer is keyed, and what prepare resolved."""

    kind: Kind
    key: Any  # System One: the question id; Decisions: the name (None when omitted)
    instructions: str
    shown: list[str]  # choice/score: one line per option in order; binary: what true / false mean ("" if unsaid)
    values: list[Any] = field(default_factory=list)  # choice: names / typed values; score: levels / labels
    request: EngineRequest | None = None  # None: a singleton, answered without the model
    num_labels: int = 2


@dataclass
class Prepared:
    items: list[Item]


@dataclass
class Usage:
    """Token sums over a request's questions."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0


# --- question text ------------------------------------------------------------------------------------------


def as_text(value: Any, indent: int = 0) -> str:
    """A string as it is; structured JSON as JSON text (key order preserved)."""
    if isinstance(value, str):
        return value
    encoded = msgspec.json.encode(value)
    return (msgspec.json.format(encoded, indent=indent) if indent else encoded).decode()


def described(name: str, description: Any) -> str:
    return name if description is None or description == "" else f"{name}: {as_text(description)}"


def _label_sets(kind: Kind, n: int) -> list[tuple[str, ...]]:
    """Candidate synthetic labels, most natural first; the first set that verifies is used."""
    if kind == "binary":
        return list(_BINARY_LABELS)
    sets = [tuple(str(i) for i in range(n))] if kind == "score" else []  # zero-based, like the score
    if n <= len(_UPPER):
        sets.append(tuple(_UPPER[:n]))
    sets.append(tuple(str(i) for i in range(1, n + 1)))
    if n <= len(_UPPER) + len(_LOWER):
        sets.append(tuple((_UPPER + _LOWER)[:n]))
    return list(dict.fromkeys(sets))


def _question_text(state: str, item: Item, labels: tuple[str, ...]) -> str:
    """The user turn. NOTE: the state comes first, identical for every question, so questions share a prefix."""
    lines = ["State:", state, "", f"Question: {item.instructions}"]
    if item.kind == "binary":
        for label, hint in zip(labels, item.shown):
            if hint:
                lines.append(f"{label}: {hint}")
        lines.append(f"Reply with {labels[0]} or {labels[1]} only.")
    else:
        lines.append("Options:" if item.kind == "choice" else "Levels, from lowest to highest:")
        lines += [f"{label}. {shown}" for label, shown in zip(labels, item.shown)]
        lines.append(f"Reply with the label of one {'option' if item.kind == 'choice' else 'level'} "
                     f"({', '.join(labels)}) only.")
    lines.append(ANSWER_CUE)
    return "\n".join(lines)


# --- labels, prompt checks, engine requests -----------------------------------------------------------------


def _label_ids(tok: Tokenizer, prompt: ChatPrompt, labels: tuple[str, ...], cache: dict) -> tuple[int, ...] | None:
    """Each label's id when encode(prompt + label) == prompt ids + [one id], all distinct; else None.

    NOTE: HF tokenizers split the text at added special tokens before normalizing and pre-tokenizing, so the
    check runs on the text from the prompt's last special token on (the generation prompt, shared by every
    question); it falls back to the whole prompt when that suffix does not re-encode to the prompt's own ids.
    """
    ids = prompt.token_ids
    last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in tok.special_ids), None)
    text, context = prompt.text, ids
    if last is not None:
        start = prompt.text.rfind(tok.token_bytes[ids[last]].decode("utf-8", errors="replace"))
        if start >= 0 and tok.encode(prompt.text[start:], add_special_tokens=False) == ids[last:]:
            text, context = prompt.text[start:], ids[last:]
    key = (text, labels)
    if key not in cache:
        found = []
        for label in labels:
            got = tok.encode(text + label, add_special_tokens=False)
            if len(got) != len(context) + 1 or got[:-1] != context:
                break
            found.append(got[-1])
        cache[key] = tuple(found) if len(found) == len(labels) == len(set(found)) else None
    return cache[key]


def _check_answer_position(ctx: ModelContext, prompt: ChatPrompt) -> None:
    """The answer must not start inside reasoning: the text after the cue must not leave reasoning open."""
    syntax = ctx.manifest.template.reasoning
    if syntax is None:
        return
    tail = prompt.text[prompt.text.rfind(ANSWER_CUE) + len(ANSWER_CUE):]
    if syntax.open in tail and tail.rfind(syntax.open) > tail.rfind(syntax.close):
        raise bad_request("this core's chat template opens reasoning in the generation prompt and cannot turn it "
                          "off; System One scoring needs the answer as the first assistant token")


def _read_sampling(ctx: ModelContext, label_ids: tuple[int, ...]) -> SamplingParams:
    """One read token with the labels' explicit logprobs: the core's logprob rules (400 naming a re-export when
    the core lacks explicit-ID inputs), then greedy and unpenalized, since only the raw logprobs are read."""
    fields = SamplingFields(max_tokens=1, logprobs=0, logprob_token_ids=list(label_ids), ignore_eos=True)
    sampling = resolve_sampling(fields, ctx.manifest, 1)
    return msgspec.structs.replace(sampling, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                                   presence_penalty=0.0, frequency_penalty=0.0)


def compile_questions(ctx: ModelContext, state: str, items: list[Item]) -> None:
    """Render each question, verify its labels and build its engine request (in place)."""
    if not ctx.chat.available:
        raise bad_request("this core has no chat template; System One scoring needs one")
    kwargs = {k: False for k in THINKING_KWARGS if k in ctx.manifest.template.kwargs}
    base, cache, limit = f"decide-{uuid.uuid4().hex}", {}, ctx.limits.max_model_len
    try:
        for j, item in enumerate(items):
            if item.num_labels == 1:
                continue
            for labels in _label_sets(item.kind, item.num_labels):
                message = ChatMessage(role="user", content=_question_text(state, item, labels))
                prompt = ctx.chat.render([message], template_kwargs=kwargs)
                _check_answer_position(ctx, prompt)
                if (label_ids := _label_ids(ctx.tokenizer, prompt, labels, cache)) is not None:
                    break
            else:
                raise bad_request(f"this core's tokenizer has no distinct single-token labels for {item.num_labels} "
                                  "options", "questions")
            if len(prompt.token_ids) + 1 > limit:
                raise bad_request(f"a question expands to {len(prompt.token_ids)} prompt tokens; this model's maximum "
                                  f"context length is {limit} tokens", "questions")
            item.request = EngineRequest(req_id=f"{base}-{j}", prompt_token_ids=prompt.token_ids,
                                         sampling=_read_sampling(ctx, label_ids))
    except InvalidRequest as e:
        raise from_invalid(e) from None


# --- execution and probabilities ----------------------------------------------------------------------------


async def _read(runtime: Runtime, request: EngineRequest) -> tuple[list[float], Child]:
    """One question's child: submit, drain, and the labels' raw logprobs in label order."""
    tok = runtime.model.tokenizer
    processor = OutputProcessor(tok.token_bytes, tok.special_ids, request.sampling, (), True,
                                runtime.model.control_ids)
    child = Child(0, request, processor)
    gen = Generation(runtime, [child])
    try:
        await gen.submit()
        await gen.run()
    finally:
        gen.abort_all()  # NOTE: a no-op once finished; a dropped request cancels us mid-flight
    if (err := failure(child)) is not None:
        raise err
    values = {t.token_id: t.logprob for t in child.entries[0].top} if child.entries else {}
    label_ids = request.sampling.logprob_token_ids or ()
    if any(i not in values for i in label_ids):
        raise server_error("the engine returned no logprobs for the answer labels")
    return [values[i] for i in label_ids], child


async def run(runtime: Runtime, items: list[Item],
              answer: Callable[[Item, list[float] | None], dict]) -> tuple[list[dict], Usage]:
    """Run the questions one after another; `answer` (the route's encoder) gets each item's label logprobs, None
    for a singleton."""
    answers, usage = [], Usage()
    for item in items:
        logprobs = None
        if item.request is not None:
            logprobs, child = await _read(runtime, item.request)
            usage.num_prompt_tokens += len(item.request.prompt_token_ids)
            usage.num_cached_tokens += child.processor.num_cached_tokens
            usage.num_generated_tokens += child.processor.num_generated
        answers.append(answer(item, logprobs))
    return answers, usage


def normalized(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def winner(probs: list[float]) -> int:
    return max(range(len(probs)), key=probs.__getitem__)  # max keeps the first of equal values
