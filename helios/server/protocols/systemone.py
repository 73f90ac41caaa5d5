"""POST /v1/systemone (TypeSafe System One) and POST /v1/decisions (the vLLM Decisions text protocol): one scorer.

Both routes decode into neutral `Item`s; each is one conversation (a user turn: the common state, the question,
its labelled options, an "Answer:" cue) rendered with the core's template, generation prompt on, thinking off
where the template reads enable_thinking / thinking. Synthetic labels must be distinct single tokens as the
first assistant token; one generated token per question reads their raw logprobs (logprob_token_ids), one
question after another (prefix reuse after the first). Imports no torch.

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
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from helios.engine.messages import EngineRequest, SamplingParams
from helios.frontend.chat import ChatMessage, ChatPrompt
from helios.frontend.sampling import InvalidRequest, SamplingFields, resolve_sampling
from helios.frontend.tokenizer import Tokenizer
from helios.output.processor import OutputProcessor
from helios.server.errors import ApiError, bad_request, from_invalid, from_validation, server_error
from helios.server.generation import Child, Generation, control_ids, failure
from helios.server.runtime import Runtime

MAX_QUESTIONS = 64
MAX_CRITERIA = 128  # choice options (System One 1.., Decisions 2..)
MAX_LEVELS = 10
MAX_SAFETY_IDENTIFIER = 128
ANSWER_CUE = "Answer:"
THINKING_KWARGS = ("enable_thinking", "thinking")  # template variables that switch reasoning; set False
IMAGE_PARTS = ("image_url", "input_image", "image", "input_file")
_NO_VISION = "image assets need a vision core (and TypeSafe-Danger-Zone-Images: true); this core is text-only"
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
    decisions: bool
    items: list[Item]


class SchemaError(ApiError):
    """System One schema failures: HTTP 422 with FastAPI-style {"detail": [{"type", "loc", "msg"}]}."""

    def __init__(self, detail: list[dict]):
        super().__init__(422, "invalid_request_error", detail[0]["msg"])
        self.detail = detail

    def encode(self) -> bytes:
        return msgspec.json.encode({"detail": self.detail})


def check_transport(headers: dict[str, str], decisions: bool) -> None:
    """Refusals decided by headers, before the body is read: multipart (image parts) needs a vision core."""
    content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "multipart/form-data":
        return
    if decisions:
        raise bad_request("multipart/form-data is not supported on /v1/decisions (a text-only route); send JSON")
    if headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
        raise ApiError(415, "invalid_request_error", "multipart bodies must use Content-Encoding identity",
                       code="unsupported_content_encoding")
    raise bad_request(_NO_VISION, "assets")


# --- System One: schema (422 detail entries) ----------------------------------------------------------------


def _is_entry(value: Any) -> bool:
    return isinstance(value, (str, dict, list))


# the accepted JSON shapes and their pydantic-style (type, msg) on failure
_SHAPES = {
    "string": (lambda v: isinstance(v, str), "string_type", "Input should be a valid string"),
    "entry": (_is_entry, "entry_type", "Input should be a valid string, object or array"),
    "dict": (lambda v: isinstance(v, dict), "dict_type", "Input should be a valid dictionary"),
    "list": (lambda v: isinstance(v, list), "list_type", "Input should be a valid list"),
}
_DEFAULT_INSTRUCTIONS = {"noul": "Is this true of the state?", "choice": "Which option fits the state best?",
                         "score": "Which level fits the state best?"}


class _Detail(list):
    """The 422 detail entries of one body, collected in document order."""

    def fail(self, loc: list, type_: str, msg: str) -> None:
        self.append({"type": type_, "loc": loc, "msg": msg})

    def shape(self, value: Any, loc: list, shape: str) -> bool:
        ok, type_, msg = _SHAPES[shape]
        if not ok(value):
            self.fail(loc, type_, msg)
        return ok(value)

    def field(self, obj: dict, loc: list, name: str, shape: str) -> bool:
        if name not in obj:
            self.fail([*loc, name], "missing", "Field required")
            return False
        return self.shape(obj[name], [*loc, name], shape)

    def count(self, value, loc: list, lo: int, hi: int) -> None:
        what, n = "Dictionary" if isinstance(value, dict) else "List", len(value)
        if n < lo:
            self.fail(loc, "too_short", f"{what} should have at least {lo} item{'s' * (lo > 1)} after validation, "
                                        f"not {n}")
        elif n > hi:
            self.fail(loc, "too_long", f"{what} should have at most {hi} items after validation, not {n}")


def _check_question(detail: _Detail, q: Any, loc: list) -> None:
    if not isinstance(q, dict):
        return detail.fail(loc, "model_attributes_type",
                           "Input should be a valid dictionary or object to extract fields from")
    if "type" not in q:
        return detail.fail(loc, "union_tag_not_found", "Unable to extract tag using discriminator 'type'")
    kind = q["type"]
    if not isinstance(kind, str) or kind not in _DEFAULT_INSTRUCTIONS:
        return detail.fail(loc, "union_tag_invalid", f"Input tag {kind!r} found using 'type' does not match any of "
                                                     "the expected tags: 'noul', 'choice', 'score'")
    loc = [*loc, kind]
    if q.get("instructions") is not None:  # optional: the spec's own example omits it
        detail.shape(q["instructions"], [*loc, "instructions"], "entry")
    criteria, where = q.get("criteria"), [*loc, "criteria"]
    if kind == "noul":  # optional {"true": entry, "false": entry}
        if criteria is not None and detail.shape(criteria, where, "dict"):
            for k, v in criteria.items():
                if k not in ("true", "false"):
                    detail.fail([*where, k], "extra_forbidden", "Extra inputs are not permitted")
                elif v is not None:
                    detail.shape(v, [*where, k], "entry")
    elif kind == "choice":  # {name: description or null}
        if detail.field(q, loc, "criteria", "dict"):
            detail.count(criteria, where, 1, MAX_CRITERIA)
            for k, v in criteria.items():
                if v is not None:
                    detail.shape(v, [*where, k], "entry")
    elif detail.field(q, loc, "criteria", "list"):  # score: ordered nonnull levels
        detail.count(criteria, where, 1, MAX_LEVELS)
        for i, v in enumerate(criteria):
            if v is None:
                detail.fail([*where, i], "value_error", "Value error, score levels must not be null")


def _check_systemone(body: Any) -> None:
    detail, loc = _Detail(), ["body"]
    if not isinstance(body, dict):
        detail.fail(loc, "model_attributes_type", "Input should be a valid dictionary or object to extract fields from")
        raise SchemaError(detail)
    detail.field(body, loc, "model", "string")
    detail.field(body, loc, "state", "entry")
    if detail.field(body, loc, "questions", "dict"):
        for qid, q in body["questions"].items():
            _check_question(detail, q, [*loc, "questions", qid])
        detail.count(body["questions"], [*loc, "questions"], 1, MAX_QUESTIONS)
    if detail:
        raise SchemaError(detail)


def _text(value: Any, indent: int = 0) -> str:
    """A string as it is; structured JSON as JSON text (key order preserved)."""
    if isinstance(value, str):
        return value
    encoded = msgspec.json.encode(value)
    return (msgspec.json.format(encoded, indent=indent) if indent else encoded).decode()


def _described(name: str, description: Any) -> str:
    return name if description is None or description == "" else f"{name}: {_text(description)}"


def prepare_systemone(body: bytes, runtime: Runtime) -> Prepared:
    """Blocking frontend work for /v1/systemone (decode, schema, render, labels): runs on the frontend pool."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise from_validation(e) from None
    if isinstance(obj, dict) and obj.get("assets") not in (None, [], {}):
        raise bad_request(_NO_VISION, "assets")
    _check_systemone(obj)
    items = []
    for qid, q in obj["questions"].items():
        kind, criteria = q["type"], q.get("criteria")
        given = q.get("instructions")
        instructions = _DEFAULT_INSTRUCTIONS[kind] if given is None else _text(given, indent=2)
        if kind == "noul":
            hints = criteria or {}
            items.append(Item("binary", qid, instructions,
                              [_text(hints["true"]) if hints.get("true") is not None else "",
                               _text(hints["false"]) if hints.get("false") is not None else ""]))
        elif kind == "choice":
            items.append(Item("choice", qid, instructions, [_described(k, v) for k, v in criteria.items()],
                              list(criteria), num_labels=len(criteria)))
        else:
            items.append(Item("score", qid, instructions, [_text(v) for v in criteria], list(criteria),
                              num_labels=len(criteria)))
    _compile(runtime, _text(obj["state"], indent=2), items)
    return Prepared(False, items)


# --- Decisions: strict Structs (400 on any schema failure) ----------------------------------------------------


class _Strict(Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class InputMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]]
    type: Literal["message"] | UnsetType = UNSET


class ChoiceValue(_Strict):
    value: str | bool
    description: str | UnsetType = UNSET


class ScoreLevel(_Strict):
    label: str
    description: str | UnsetType = UNSET


class PredicateQuestion(_Strict, tag="predicate", tag_field="type"):
    instructions: str
    name: str | UnsetType = UNSET  # NOTE: omission answers name: null; an explicit null is invalid


class ChoiceQuestion(_Strict, tag="choice", tag_field="type"):
    instructions: str
    choices: Annotated[list[ChoiceValue], Meta(min_length=2, max_length=MAX_CRITERIA)]
    name: str | UnsetType = UNSET


class ScoreQuestion(_Strict, tag="score", tag_field="type"):
    instructions: str
    levels: Annotated[list[ScoreLevel], Meta(min_length=2, max_length=MAX_LEVELS)]
    name: str | UnsetType = UNSET


class DecisionsRequest(_Strict):
    model: str
    input: str | list[InputMessage]
    questions: Annotated[list[PredicateQuestion | ChoiceQuestion | ScoreQuestion],
                         Meta(min_length=1, max_length=MAX_QUESTIONS)]
    safety_identifier: Annotated[str, Meta(max_length=MAX_SAFETY_IDENTIFIER)] | None = None  # inert metadata


def _input_text(value: str | list[InputMessage]) -> str:
    """Text parts join with newlines, messages with blank lines; only user text."""
    if isinstance(value, str):
        return value
    texts = []
    for m in value:
        if m.role != "user":
            raise bad_request(f"input messages must have role \"user\", not {m.role!r}", "input")
        if isinstance(m.content, str):
            texts.append(m.content)
            continue
        parts = []
        for part in m.content:
            kind = part.get("type")
            if kind in IMAGE_PARTS:
                raise bad_request("this route is text-only: image and file inputs are not supported", "input")
            is_text = kind in ("text", "input_text") and isinstance(part.get("text"), str)
            if not is_text or set(part) - {"type", "text"}:
                raise bad_request("input content parts must be {\"type\": \"text\" | \"input_text\", \"text\": string}",
                                  "input")
            parts.append(part["text"])
        texts.append("\n".join(parts))
    return "\n\n".join(texts)


def _shown_value(value: str | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else value


def prepare_decisions(body: bytes, runtime: Runtime) -> Prepared:
    """Blocking frontend work for /v1/decisions: runs on the frontend pool."""
    try:
        req = msgspec.json.decode(body, type=DecisionsRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None
    state = _input_text(req.input)
    items = []
    for j, q in enumerate(req.questions):
        name = None if q.name is UNSET else q.name
        if isinstance(q, PredicateQuestion):
            items.append(Item("binary", name, q.instructions, ["", ""]))
        elif isinstance(q, ChoiceQuestion):
            keys = [(type(c.value), c.value) for c in q.choices]
            if len(set(keys)) != len(keys):
                raise bad_request(f"questions[{j}].choices values must be distinct", "questions")
            items.append(Item("choice", name, q.instructions,
                              [_described(_shown_value(c.value), c.description or None) for c in q.choices],
                              [c.value for c in q.choices], num_labels=len(q.choices)))
        else:
            items.append(Item("score", name, q.instructions,
                              [_described(lv.label, lv.description or None) for lv in q.levels],
                              [lv.label for lv in q.levels], num_labels=len(q.levels)))
    _compile(runtime, state, items)
    return Prepared(True, items)


# --- the shared scorer: prompt, labels, engine requests -----------------------------------------------------


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


def _check_answer_position(runtime: Runtime, prompt: ChatPrompt) -> None:
    """The answer must not start inside reasoning: the text after the cue must not leave reasoning open."""
    syntax = runtime.manifest.template.reasoning
    if syntax is None:
        return
    tail = prompt.text[prompt.text.rfind(ANSWER_CUE) + len(ANSWER_CUE):]
    if syntax.open in tail and tail.rfind(syntax.open) > tail.rfind(syntax.close):
        raise bad_request("this core's chat template opens reasoning in the generation prompt and cannot turn it "
                          "off; System One scoring needs the answer as the first assistant token")


def _read_sampling(runtime: Runtime, label_ids: tuple[int, ...]) -> SamplingParams:
    """One read token with the labels' explicit logprobs: the core's logprob rules (400 naming a re-export when
    the core lacks explicit-ID inputs), then greedy and unpenalized, since only the raw logprobs are read."""
    fields = SamplingFields(max_tokens=1, logprobs=0, logprob_token_ids=list(label_ids), ignore_eos=True)
    sampling = resolve_sampling(fields, runtime.manifest, 1)
    return msgspec.structs.replace(sampling, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                                   presence_penalty=0.0, frequency_penalty=0.0)


def _compile(runtime: Runtime, state: str, items: list[Item]) -> None:
    """Render each question, verify its labels and build its engine request (in place)."""
    if not runtime.chat.available:
        raise bad_request("this core has no chat template; System One scoring needs one")
    kwargs = {k: False for k in THINKING_KWARGS if k in runtime.manifest.template.kwargs}
    base, cache, limit = f"decide-{uuid.uuid4().hex}", {}, runtime.serving.max_model_len
    try:
        for j, item in enumerate(items):
            if item.num_labels == 1:
                continue
            for labels in _label_sets(item.kind, item.num_labels):
                message = ChatMessage(role="user", content=_question_text(state, item, labels))
                prompt = runtime.chat.render([message], template_kwargs=kwargs)
                _check_answer_position(runtime, prompt)
                if (label_ids := _label_ids(runtime.tokenizer, prompt, labels, cache)) is not None:
                    break
            else:
                raise bad_request(f"this core's tokenizer has no distinct single-token labels for {item.num_labels} "
                                  "options", "questions")
            if len(prompt.token_ids) + 1 > limit:
                raise bad_request(f"a question expands to {len(prompt.token_ids)} prompt tokens; this model's maximum "
                                  f"context length is {limit} tokens", "questions")
            item.request = EngineRequest(req_id=f"{base}-{j}", prompt_token_ids=prompt.token_ids,
                                         sampling=_read_sampling(runtime, label_ids))
    except InvalidRequest as e:
        raise from_invalid(e) from None


# --- execution and answers ----------------------------------------------------------------------------------


async def _read(runtime: Runtime, request: EngineRequest) -> tuple[list[float], Child]:
    """One question's child: submit, drain, and the labels' raw logprobs in label order."""
    tok = runtime.tokenizer
    processor = OutputProcessor(tok.token_bytes, tok.special_ids, request.sampling, (), True, control_ids(runtime))
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


def _normalized(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


def _winner(probs: list[float]) -> int:
    return max(range(len(probs)), key=probs.__getitem__)  # max keeps the first of equal values


def _answer(item: Item, logprobs: list[float] | None, decisions: bool) -> dict:
    probs = _normalized(logprobs) if logprobs is not None else [1.0]
    if item.kind == "binary":
        return {"type": "predicate", "name": item.key, "probability": probs[0]} if decisions else \
            {"type": "noul", "noul": probs[0]}
    w = _winner(probs)
    # Decisions: p_w * total raw label mass = exp(lp_w); System One: p_w (1 for a singleton)
    confidence = math.exp(logprobs[w]) if decisions and logprobs is not None else probs[w]
    if item.kind == "choice":
        if decisions:
            return {"type": "choice", "name": item.key, "choice": item.values[w], "confidence": confidence,
                    "probabilities": [{"value": v, "probability": p} for v, p in zip(item.values, probs)]}
        return {"type": "choice", "choice": item.values[w], "confidence": confidence,
                "probabilities": dict(zip(item.values, probs))}
    score = sum(i * p for i, p in enumerate(probs))
    if decisions:
        return {"type": "score", "name": item.key, "score": score, "confidence": confidence,
                "probabilities": [{"value": i, "label": label, "probability": p}
                                  for i, (label, p) in enumerate(zip(item.values, probs))]}
    return {"type": "score", "score": score, "legend": {str(i): v for i, v in enumerate(item.values)},
            "probabilities": {str(i): p for i, p in enumerate(probs)}, "confidence": confidence}


async def execute(runtime: Runtime, prep: Prepared) -> dict:
    """Run the questions one after another and encode the route's response."""
    answers, num_prompt, num_cached, num_generated = [], 0, 0, 0
    for item in prep.items:
        logprobs = None
        if item.request is not None:
            logprobs, child = await _read(runtime, item.request)
            num_prompt += len(item.request.prompt_token_ids)
            num_cached += child.processor.num_cached_tokens
            num_generated += child.processor.num_generated
        answers.append(_answer(item, logprobs, prep.decisions))
    model = runtime.serving.model_id
    if not prep.decisions:
        return {"model": model, "answers": {item.key: a for item, a in zip(prep.items, answers)},
                "usage": {"input_tokens": num_prompt, "output_tokens": num_generated}}
    usage = {"input_tokens": num_prompt,
             "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},  # writes: not measured
             "output_tokens": num_generated, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": num_prompt + num_generated}
    return {"model": model, "answers": answers, "usage": usage}
