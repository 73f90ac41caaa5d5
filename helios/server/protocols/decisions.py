"""POST /v1/decisions (the vLLM Decisions text protocol): strict Structs (400), lowering into `Item`s, answers.

Scoring (prompt, labels, engine reads, formulas) is `helios.server.scorer`; this module owns only the Decisions
wire format. Imports no torch and nothing from the other routes.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from helios.frontend.context import ModelContext
from helios.server import scorer
from helios.server.errors import bad_request, decode_body
from helios.server.runtime import Runtime
from helios.server.scorer import MAX_CRITERIA, MAX_LEVELS, MAX_QUESTIONS, Item, Prepared, described

MAX_SAFETY_IDENTIFIER = 128
IMAGE_PARTS = ("image_url", "input_image", "image", "input_file")


def check_transport(headers: dict[str, str]) -> None:
    """Refusals decided by headers, before the body is read: this route reads JSON only."""
    content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type == "multipart/form-data":
        raise bad_request("multipart/form-data is not supported on /v1/decisions (a text-only route); send JSON")


# --- strict Structs (400 on any schema failure) -------------------------------------------------------------


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


# --- lowering, answers, response ----------------------------------------------------------------------------


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


def prepare(body: bytes, ctx: ModelContext) -> Prepared:
    """Blocking frontend work for /v1/decisions: runs on the frontend pool."""
    req = decode_body(body, DecisionsRequest)
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
                              [described(_shown_value(c.value), c.description or None) for c in q.choices],
                              [c.value for c in q.choices], num_labels=len(q.choices)))
        else:
            items.append(Item("score", name, q.instructions,
                              [described(lv.label, lv.description or None) for lv in q.levels],
                              [lv.label for lv in q.levels], num_labels=len(q.levels)))
    scorer.compile_questions(ctx, state, items)
    return Prepared(items)


def _answer(item: Item, logprobs: list[float] | None) -> dict:
    probs = scorer.normalized(logprobs) if logprobs is not None else [1.0]
    if item.kind == "binary":
        return {"type": "predicate", "name": item.key, "probability": probs[0]}
    w = scorer.winner(probs)
    # p_w * total raw label mass = exp(lp_w)
    confidence = math.exp(logprobs[w]) if logprobs is not None else probs[w]
    if item.kind == "choice":
        return {"type": "choice", "name": item.key, "choice": item.values[w], "confidence": confidence,
                "probabilities": [{"value": v, "probability": p} for v, p in zip(item.values, probs)]}
    score = sum(i * p for i, p in enumerate(probs))
    return {"type": "score", "name": item.key, "score": score, "confidence": confidence,
            "probabilities": [{"value": i, "label": label, "probability": p}
                              for i, (label, p) in enumerate(zip(item.values, probs))]}


async def execute(runtime: Runtime, prep: Prepared) -> dict:
    """Run the questions one after another and encode the Decisions response."""
    answers, usage = await scorer.run(runtime, prep.items, _answer)
    num_prompt, num_generated = usage.num_prompt_tokens, usage.num_generated_tokens
    cached = {"cached_tokens": usage.num_cached_tokens, "cache_write_tokens": 0}  # writes: not measured
    return {"model": runtime.serving.model_id, "answers": answers,
            "usage": {"input_tokens": num_prompt, "input_tokens_details": cached, "output_tokens": num_generated,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": num_prompt + num_generated}}
