"""POST /v1/systemone and /v1/decisions: answers from the real SmolLM2 server, the formulas against a scripted
engine, the scorer's prompt and label rules offline on the real core, and every validation bound (400 vs 422)."""

from __future__ import annotations

import asyncio
import gzip
import json
import math

import httpx
import msgspec
import pytest

from helios.core.manifest import LogprobCaps, ReasoningSyntax
from helios.engine.messages import EngineOutput, PositionLogprobs, TokenLogprob
from helios.server import scorer
from helios.server.config import ServerConfig
from helios.server.errors import ApiError
from helios.server.protocols import decisions, systemone
from helios.server.runtime import Runtime
from tests.server.conftest import CORE

SPEC_SYSTEMONE = {"model": "local", "state": {"message": "Charged twice"}, "questions": {
    "refund": {"type": "noul", "instructions": "Is a refund requested?"},
    "team": {"type": "choice", "criteria": {"billing": None, "support": "Other help"}},
    "urgency": {"type": "score", "criteria": ["Routine", "Urgent"]}}}
SPEC_DECISIONS = {"model": "local", "input": "Charged twice", "questions": [
    {"type": "predicate", "name": "refund", "instructions": "Refund requested?"},
    {"type": "choice", "instructions": "Which team?", "choices": [
        {"value": "billing", "description": "Payments"}, {"value": False}]},
    {"type": "score", "instructions": "Urgency?", "levels": [
        {"label": "Routine"}, {"label": "Urgent", "description": "Act today"}]}]}


def _post(http, path: str, body, headers: dict | None = None):
    return http.post(path, content=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **(headers or {})})


def _prob(x: float) -> bool:
    return 0.0 <= x <= 1.0


# --- the real server ----------------------------------------------------------------------------------------


def test_systemone_answers_the_spec_example(http):
    body = json.loads(json.dumps(SPEC_SYSTEMONE))
    body["questions"]["only"] = {"type": "choice", "instructions": "Pick", "criteria": {"solo": "the only option"}}
    r = _post(http, "/v1/systemone", body, headers={"x-request-id": "so-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "so-1"
    out = r.json()
    assert out["model"] == http.get("/v1/models").json()["data"][0]["id"]
    assert list(out["answers"]) == ["refund", "team", "urgency", "only"]
    refund, team, urgency, only = (out["answers"][k] for k in ("refund", "team", "urgency", "only"))
    assert refund["type"] == "noul" and _prob(refund["noul"]) and set(refund) == {"type", "noul"}
    assert team["type"] == "choice" and list(team["probabilities"]) == ["billing", "support"]
    assert sum(team["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    assert team["confidence"] == team["probabilities"][team["choice"]] and _prob(team["confidence"])
    assert urgency["type"] == "score" and urgency["legend"] == {"0": "Routine", "1": "Urgent"}
    probs = urgency["probabilities"]
    assert list(probs) == ["0", "1"] and sum(probs.values()) == pytest.approx(1.0, abs=1e-6)
    assert 0.0 <= urgency["score"] <= 1.0 and urgency["score"] == pytest.approx(probs["1"], abs=1e-12)
    assert urgency["confidence"] == max(probs.values())
    # a singleton is certain and runs nothing
    assert only == {"type": "choice", "choice": "solo", "confidence": 1.0, "probabilities": {"solo": 1.0}}
    assert out["usage"]["input_tokens"] > 3 * 50 and out["usage"]["output_tokens"] == 3
    assert set(out["usage"]) == {"input_tokens", "output_tokens"}


def test_decisions_answers_in_order_with_typed_values(http):
    body = json.loads(json.dumps(SPEC_DECISIONS))
    body["questions"][1]["name"] = "refund"  # duplicate names are permitted
    body["safety_identifier"] = "user-42"
    r = _post(http, "/v1/decisions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    predicate, choice, score = out["answers"]
    assert predicate["type"] == "predicate" and predicate["name"] == "refund" and _prob(predicate["probability"])
    assert choice["type"] == "choice" and choice["name"] == "refund"
    assert [e["value"] for e in choice["probabilities"]] == ["billing", False]  # false stays a boolean
    assert sum(e["probability"] for e in choice["probabilities"]) == pytest.approx(1.0, abs=1e-6)
    best = max(choice["probabilities"], key=lambda e: e["probability"])
    assert choice["choice"] == best["value"] and type(choice["choice"]) is type(best["value"])
    # full-vocabulary probability of the winner: at most its normalized probability
    assert 0.0 < choice["confidence"] <= best["probability"] + 1e-12
    assert score["type"] == "score" and score["name"] is None
    assert [(e["value"], e["label"]) for e in score["probabilities"]] == [(0, "Routine"), (1, "Urgent")]
    assert sum(e["probability"] for e in score["probabilities"]) == pytest.approx(1.0, abs=1e-6)
    assert 0.0 <= score["score"] <= 1.0 and _prob(score["confidence"])
    usage = out["usage"]
    assert usage["output_tokens"] == 3 and usage["input_tokens"] > 3 * 50
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    # the common state prefix is reused after the first question
    assert 0 < usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]


def test_a_question_reads_what_completions_reports_for_its_prompt(http, core_runtime):
    """The same rendered prompt and label ids through /v1/completions with logprob_token_ids."""
    prep = decisions.prepare(json.dumps(SPEC_DECISIONS).encode(), core_runtime.model)
    item = prep.items[1]
    label_ids = list(item.request.sampling.logprob_token_ids)
    r = _post(http, "/v1/completions", {"model": "x", "prompt": item.request.prompt_token_ids, "max_tokens": 1,
                                        "logprobs": 0, "logprob_token_ids": label_ids,
                                        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    expected = scorer.normalized([top[f"token_id:{i}"] for i in label_ids])
    d = _post(http, "/v1/decisions", SPEC_DECISIONS).json()["answers"][1]
    assert [e["probability"] for e in d["probabilities"]] == pytest.approx(expected, abs=1e-4)
    assert d["confidence"] == pytest.approx(math.exp(max(top[f"token_id:{i}"] for i in label_ids)), abs=1e-4)


def _detail(r, status=422):
    assert r.status_code == status, r.text
    return r.json()["detail"]


def _error(r, status=400):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"]
    return err


def test_systemone_schema_failures_are_422_detail_entries(http):
    q = {"type": "noul", "instructions": "Yes?"}
    base = {"model": "m", "state": "s"}
    cases = [
        ({**base, "questions": {}}, ["body", "questions"], "too_short"),
        ({**base, "questions": {f"q{i}": q for i in range(65)}}, ["body", "questions"], "too_long"),
        ({"state": "s", "questions": {"a": q}}, ["body", "model"], "missing"),
        ({"model": "m", "questions": {"a": q}}, ["body", "state"], "missing"),
        ({**base, "state": 3, "questions": {"a": q}}, ["body", "state"], "entry_type"),
        ({**base, "questions": {"a": {"type": "box", "instructions": "x"}}}, ["body", "questions", "a"],
         "union_tag_invalid"),
        ({**base, "questions": {"a": {"instructions": "x"}}}, ["body", "questions", "a"], "union_tag_not_found"),
        ({**base, "questions": {"a": {"type": "choice", "criteria": {}}}}, ["body", "questions", "a", "choice",
                                                                           "criteria"], "too_short"),
        ({**base, "questions": {"a": {"type": "choice", "criteria": {f"c{i}": None for i in range(129)}}}},
         ["body", "questions", "a", "choice", "criteria"], "too_long"),
        ({**base, "questions": {"a": {"type": "choice"}}}, ["body", "questions", "a", "choice", "criteria"], "missing"),
        ({**base, "questions": {"a": {"type": "score", "criteria": []}}}, ["body", "questions", "a", "score",
                                                                          "criteria"], "too_short"),
        ({**base, "questions": {"a": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
         ["body", "questions", "a", "score", "criteria"], "too_long"),
        ({**base, "questions": {"a": {"type": "score", "criteria": ["low", None]}}},
         ["body", "questions", "a", "score", "criteria", 1], "value_error"),
        ({**base, "questions": {"a": {"type": "noul", "instructions": 5}}}, ["body", "questions", "a", "noul",
                                                                            "instructions"], "entry_type"),
        ([1, 2], ["body"], "model_attributes_type"),
    ]
    for body, loc, kind in cases:
        detail = _detail(_post(http, "/v1/systemone", body))
        assert {"loc": loc, "type": kind} in [{"loc": d["loc"], "type": d["type"]} for d in detail], (body, detail)
        assert all(isinstance(d["msg"], str) and d["msg"] for d in detail)


def test_systemone_400s_auth_and_images(http, server):
    bad = http.post("/v1/systemone", content=b"{not json", headers={"content-type": "application/json"})
    assert "malformed JSON" in _error(bad)["message"]
    assets = {**SPEC_SYSTEMONE, "assets": [{"name": "img", "data_base64": "iVBORw0KGgo="}]}
    assert "vision core" in _error(_post(http, "/v1/systemone", assets,
                                         headers={"TypeSafe-Danger-Zone-Images": "true"}))["message"]
    multipart = http.post("/v1/systemone", content=b"--x\r\n\r\n--x--\r\n",
                          headers={"content-type": "multipart/form-data; boundary=x"})
    assert "vision core" in _error(multipart)["message"]
    compressed = http.post("/v1/systemone", content=gzip.compress(b"--x--\r\n"),
                           headers={"content-type": "multipart/form-data; boundary=x", "content-encoding": "gzip"})
    _error(compressed, 415)
    assert http.get("/v1/systemone").status_code == 405
    anonymous = httpx.post(server.url + "/v1/systemone", json=SPEC_SYSTEMONE, timeout=30)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"


def test_decisions_validation_is_400(http):
    def with_question(q):
        return {"model": "m", "input": "x", "questions": [q]}

    choice = {"type": "choice", "instructions": "Which?", "choices": [{"value": "a"}, {"value": "b"}]}
    levels = [{"label": "low"}, {"label": "high"}]
    cases = {
        "no questions": {"model": "m", "input": "x", "questions": []},
        "65 questions": {"model": "m", "input": "x",
                         "questions": [{"type": "predicate", "instructions": "?"}] * 65},
        "duplicate values": with_question({**choice, "choices": [{"value": "a"}, {"value": "a"}]}),
        "one choice": with_question({**choice, "choices": [{"value": "a"}]}),
        "129 choices": with_question({**choice, "choices": [{"value": str(i)} for i in range(129)]}),
        "number value": with_question({**choice, "choices": [{"value": 1}, {"value": 2}]}),
        "one level": with_question({"type": "score", "instructions": "?", "levels": levels[:1]}),
        "11 levels": with_question({"type": "score", "instructions": "?", "levels": [{"label": "l"}] * 11}),
        "null name": with_question({"type": "predicate", "instructions": "?", "name": None}),
        "no instructions": with_question({"type": "predicate"}),
        "structured instructions": with_question({"type": "predicate", "instructions": {"q": "?"}}),
        "unknown field": {**with_question({"type": "predicate", "instructions": "?"}), "temperature": 0},
        "unknown question field": with_question({"type": "predicate", "instructions": "?", "criteria": {}}),
        "unsupported type": with_question({"type": "box", "instructions": "?"}),
        "assistant role": {"model": "m", "questions": [{"type": "predicate", "instructions": "?"}],
                           "input": [{"role": "assistant", "content": "hi"}]},
        "image part": {"model": "m", "questions": [{"type": "predicate", "instructions": "?"}],
                       "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
        "assets": {**with_question({"type": "predicate", "instructions": "?"}), "assets": []},
        "long safety_identifier": {**with_question({"type": "predicate", "instructions": "?"}),
                                   "safety_identifier": "x" * 129},
        "no model": {"input": "x", "questions": [{"type": "predicate", "instructions": "?"}]},
    }
    for why, body in cases.items():
        r = _post(http, "/v1/decisions", body)
        assert r.status_code == 400, (why, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", why
    multipart = http.post("/v1/decisions", content=b"--x--\r\n", headers={"content-type": "multipart/form-data; b=x"})
    assert "multipart" in _error(multipart)["message"]
    assert "malformed JSON" in _error(http.post("/v1/decisions", content=b"{\"model\": ")).get("message")


# --- offline on the real core: prompts, labels, template and core constraints ---------------------------------


def _runtime(core_runtime, source: str | None = None, engine=None, **manifest) -> Runtime:
    m = msgspec.structs.replace(core_runtime.manifest, **manifest) if manifest else core_runtime.manifest
    source = source if source is not None else (CORE / "template.jinja").read_text()
    return Runtime(m, core_runtime.tokenizer, source, engine, ServerConfig())


def _raises(prepare, body: bytes, runtime: Runtime) -> ApiError:
    with pytest.raises(ApiError) as info:
        prepare(body, runtime.model)
    return info.value


def test_prompts_share_the_state_and_labels_are_the_first_assistant_token(core_runtime):
    tok = core_runtime.tokenizer
    prep = systemone.prepare(json.dumps(SPEC_SYSTEMONE).encode(), core_runtime.model)
    prompts = [tok.decode(i.request.prompt_token_ids) for i in prep.items]
    head = prompts[0][: prompts[0].index("Question:")]
    assert '"message": "Charged twice"' in head and all(p.startswith(head) for p in prompts)
    assert all(p.endswith("Answer:<|im_end|>\n<|im_start|>assistant\n") for p in prompts)
    assert "A. billing\nB. support: Other help" in prompts[1] and "0. Routine\n1. Urgent" in prompts[2]
    for item, labels in zip(prep.items, [("yes", "no"), ("A", "B"), ("0", "1")]):
        ids = item.request.prompt_token_ids
        text = tok.decode(ids)
        expected = tuple(tok.encode(text + label, add_special_tokens=False)[-1] for label in labels)
        assert all(tok.encode(text + label, add_special_tokens=False)[:-1] == ids for label in labels)
        assert item.request.sampling.logprob_token_ids == expected
        assert item.request.sampling.max_tokens == 1 and item.request.sampling.temperature == 0.0


def test_labels_fall_back_then_run_out(core_runtime):
    """27 options: no letters A..Z, and SmolLM2 splits "10".."27" into digits, so A..Z a..z; 53: none left."""
    def choice(n):
        return {"model": "m", "state": "s", "questions": {"c": {"type": "choice",
                                                               "criteria": {f"o{i}": None for i in range(n)}}}}

    prep = systemone.prepare(json.dumps(choice(27)).encode(), core_runtime.model)
    ids = prep.items[0].request.sampling.logprob_token_ids
    assert len(set(ids)) == 27 and "\na. o26\n" in core_runtime.tokenizer.decode(prep.items[0].request.prompt_token_ids)
    err = _raises(systemone.prepare, json.dumps(choice(53)).encode(), core_runtime)
    assert err.status == 400 and "single-token labels" in err.message


def test_core_and_template_constraints_are_400(core_runtime):
    body = json.dumps(SPEC_SYSTEMONE).encode()
    no_ids = _runtime(core_runtime, logprobs=LogprobCaps(explicit_token_ids=False))
    err = _raises(systemone.prepare, body, no_ids)
    assert err.status == 400 and "re-export" in err.message
    thinking = msgspec.structs.replace(core_runtime.manifest.template, reasoning=ReasoningSyntax(
        open="<think>", close="</think>", starts_in_reasoning=True))
    opens = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
            "<|im_start|>assistant\n<think>\n"
    err = _raises(decisions.prepare, json.dumps(SPEC_DECISIONS).encode(),
                  _runtime(core_runtime, opens, template=thinking))
    assert err.status == 400 and "reasoning" in err.message
    # a template that reads enable_thinking gets false, and closes reasoning before the answer
    switch = opens.replace("<think>\n", "{% if enable_thinking is false %}<think>\n\n</think>\n{% else %}"
                                        "<think>\n{% endif %}")
    caps = msgspec.structs.replace(thinking, kwargs=["enable_thinking"])
    prep = decisions.prepare(json.dumps(SPEC_DECISIONS).encode(), _runtime(core_runtime, switch,
                                                                                      template=caps).model)
    assert core_runtime.tokenizer.decode(prep.items[0].request.prompt_token_ids).endswith("</think>\n")
    long_state = {**SPEC_SYSTEMONE, "state": "charged twice " * 5000}
    err = _raises(systemone.prepare, json.dumps(long_state).encode(), core_runtime)
    assert err.status == 400 and "context length" in err.message
    err = _raises(systemone.prepare, body, _runtime(core_runtime, ""))
    assert err.status == 400 and "chat template" in err.message


# --- a scripted engine: formulas, sequential children, abort on a dropped request ----------------------------


class ScriptedEngine:
    """Answers each request with one token whose label logprobs come from `logprobs[k]` (k: submission order);
    `hang` leaves a request unanswered. Records submissions, the most active at once, and aborts."""

    def __init__(self, logprobs: list[list[float]], hang: bool = False):
        self.logprobs, self.hang = logprobs, hang
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.active = self.max_active = 0

    async def submit(self, request):
        k = len(self.submitted)
        self.submitted.append(request.req_id)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        ids = request.sampling.logprob_token_ids
        alternatives = [TokenLogprob(t, lp, 1) for t, lp in zip(ids, self.logprobs[k])]

        async def stream():
            done = False
            try:
                await asyncio.sleep(0)
                if self.hang:
                    await asyncio.Event().wait()
                done = True
                yield EngineOutput(req_id=request.req_id, new_token_ids=[ids[0]], finished=True,
                                   finish_reason="length", logprobs=[PositionLogprobs(alternatives[0], alternatives)],
                                   num_prompt_tokens=len(request.prompt_token_ids), num_cached_tokens=7)
            finally:
                self.active -= 1
                if not done:
                    self.abort(request.req_id)

        return stream()

    def abort(self, req_id):
        self.aborted.append(req_id)


def test_formulas_and_sequential_children(core_runtime):
    lps = [[math.log(0.6), math.log(0.2)], [math.log(0.1), math.log(0.1)], [math.log(0.2), math.log(0.3)]]
    engine = ScriptedEngine(lps)
    rt = _runtime(core_runtime, engine=engine)
    prep = decisions.prepare(json.dumps(SPEC_DECISIONS).encode(), rt.model)
    out = asyncio.run(decisions.execute(rt, prep))
    assert engine.max_active == 1 and len(engine.submitted) == 3
    predicate, choice, score = out["answers"]
    assert predicate["probability"] == pytest.approx(0.75)
    assert choice["choice"] == "billing" and choice["confidence"] == pytest.approx(0.1)  # tie: the first option
    assert [e["probability"] for e in choice["probabilities"]] == pytest.approx([0.5, 0.5])
    assert score["score"] == pytest.approx(0.6) and score["confidence"] == pytest.approx(0.3)
    usage = out["usage"]
    assert usage["output_tokens"] == 3 and usage["input_tokens_details"]["cached_tokens"] == 21
    assert usage["input_tokens"] == sum(len(i.request.prompt_token_ids) for i in prep.items)
    engine = ScriptedEngine(lps)
    rt = _runtime(core_runtime, engine=engine)
    prep = systemone.prepare(json.dumps(SPEC_SYSTEMONE).encode(), rt.model)
    answers = asyncio.run(systemone.execute(rt, prep))["answers"]
    assert answers["refund"]["noul"] == pytest.approx(0.75)
    assert answers["team"]["choice"] == "billing" and answers["team"]["confidence"] == pytest.approx(0.5)
    assert answers["urgency"]["confidence"] == pytest.approx(0.6)  # the normalized winner


def test_a_dropped_request_aborts_its_current_child(core_runtime):
    engine = ScriptedEngine([[0.0, 0.0]] * 3, hang=True)
    rt = _runtime(core_runtime, engine=engine)
    prep = systemone.prepare(json.dumps(SPEC_SYSTEMONE).encode(), rt.model)

    async def main():
        task = asyncio.ensure_future(systemone.execute(rt, prep))
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert engine.submitted == [prep.items[0].request.req_id] and engine.aborted[:1] == engine.submitted
