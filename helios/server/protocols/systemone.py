"""POST /v1/systemone (TypeSafe System One): transport check, 422 schema validation, lowering into `Item`s, answers.

Scoring (prompt, labels, engine reads, formulas) is `helios.server.scorer`; this module owns only System One's
wire format. Imports no torch and nothing from the other routes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from helios.server import scorer
from helios.server.errors import ApiError, bad_request, from_validation
from helios.frontend.context import ModelContext
from helios.server.runtime import Runtime
from helios.server.scorer import MAX_CRITERIA, MAX_LEVELS, MAX_QUESTIONS, Item, Prepared, as_text, described

_NO_VISION = "image assets need a vision core (and TypeSafe-Danger-Zone-Images: true); this core is text-only"


class SchemaError(ApiError):
    """System One schema failures: HTTP 422 with FastAPI-style {"detail": [{"type", "loc", "msg"}]}."""

    def __init__(self, detail: list[dict]):
        super().__init__(422, "invalid_request_error", detail[0]["msg"])
        self.detail = detail

    def encode(self) -> bytes:
        return msgspec.json.encode({"detail": self.detail})


def check_transport(headers: dict[str, str]) -> None:
    """Refusals decided by headers, before the body is read: multipart (image parts) needs a vision core."""
    content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "multipart/form-data":
        return
    if headers.get("content-encoding", "identity").strip().lower() not in ("", "identity"):
        raise ApiError(415, "invalid_request_error", "multipart bodies must use Content-Encoding identity",
                       code="unsupported_content_encoding")
    raise bad_request(_NO_VISION, "assets")


# --- schema (422 detail entries) ----------------------------------------------------------------------------


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


# --- lowering, answers, response ----------------------------------------------------------------------------


def prepare(body: bytes, ctx: ModelContext) -> Prepared:
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
        instructions = _DEFAULT_INSTRUCTIONS[kind] if given is None else as_text(given, indent=2)
        if kind == "noul":
            hints = criteria or {}
            items.append(Item("binary", qid, instructions,
                              [as_text(hints["true"]) if hints.get("true") is not None else "",
                               as_text(hints["false"]) if hints.get("false") is not None else ""]))
        elif kind == "choice":
            items.append(Item("choice", qid, instructions, [described(k, v) for k, v in criteria.items()],
                              list(criteria), num_labels=len(criteria)))
        else:
            items.append(Item("score", qid, instructions, [as_text(v) for v in criteria], list(criteria),
                              num_labels=len(criteria)))
    scorer.compile_questions(ctx, as_text(obj["state"], indent=2), items)
    return Prepared(items)


def _answer(item: Item, logprobs: list[float] | None) -> dict:
    probs = scorer.normalized(logprobs) if logprobs is not None else [1.0]
    if item.kind == "binary":
        return {"type": "noul", "noul": probs[0]}
    w = scorer.winner(probs)
    confidence = probs[w]  # p_w (1 for a singleton)
    if item.kind == "choice":
        return {"type": "choice", "choice": item.values[w], "confidence": confidence,
                "probabilities": dict(zip(item.values, probs))}
    score = sum(i * p for i, p in enumerate(probs))
    return {"type": "score", "score": score, "legend": {str(i): v for i, v in enumerate(item.values)},
            "probabilities": {str(i): p for i, p in enumerate(probs)}, "confidence": confidence}


async def execute(runtime: Runtime, prep: Prepared) -> dict:
    """Run the questions one after another and encode System One's response."""
    answers, usage = await scorer.run(runtime, prep.items, _answer)
    return {"model": runtime.serving.model_id, "answers": {item.key: a for item, a in zip(prep.items, answers)},
            "usage": {"input_tokens": usage.num_prompt_tokens, "output_tokens": usage.num_generated_tokens}}
