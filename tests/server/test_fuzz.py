"""Property-based fuzzing of every POST route's body against the real server: never a 5xx, never a hang.

Three generators per route: arbitrary JSON values (top-level objects built from the route's own field names
included), mutations of valid requests (wrong types, huge and negative numbers, NaN-ish strings, unknown
fields, nested junk, empty arrays, deleted fields) and raw bytes (invalid UTF-8, truncated JSON, non-JSON
literals, deep nesting). A non-2xx answer must carry the route's error shape: OpenAI
{"error": {"type", "message", "param", "code"}}, Anthropic {"type": "error", "error": {...}} on
/v1/messages*, {"error": "..."} on /api/*. Accepted requests stay cheap: every output budget a mutation
leaves acceptable is forced to at most 2 tokens. Routes the server does not serve (404 "no route") skip.

derandomize=True keeps CI reproducible; FLARE_FUZZ_EXAMPLES scales the example counts (default 1.0).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("FLARE_FUZZ_EXAMPLES", "1.0"))
TIMEOUT_S = 60.0  # one answer (or one SSE chunk); a hang fails instead of blocking CI
CHEAP = 2  # largest output budget an accepted fuzz request may run with


def _settings(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# --- routes -------------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "Say OK."}]


@dataclass(frozen=True)
class Route:
    path: str
    shape: str  # "openai" | "anthropic" | "ollama"
    bases: tuple[dict, ...]  # valid requests (the model name is filled in at run time)
    fields: tuple[str, ...]  # the protocol's field names, for targeted mutations
    nested: tuple[str, ...] = ()  # list fields whose first element's keys get mutated
    headers: dict = field(default_factory=dict)
    budget: tuple[str, ...] = ("max_tokens",)  # output-budget fields (the first is set when all are omitted)


ROUTES = [
    Route("/v1/chat/completions", "openai", (
        {"messages": MSGS, "max_tokens": 2},
        {"messages": MSGS, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"messages": [{"role": "system", "content": "Be brief."}, *MSGS], "max_completion_tokens": 1,
         "logprobs": True, "top_logprobs": 2, "temperature": 0},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 1, "n": 2},
    ), ("messages", "model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "seed", "max_tokens", "max_completion_tokens", "n", "stop", "stop_token_ids",
        "stop_token_sequences", "ignore_eos", "logprobs", "top_logprobs", "logprob_token_ids", "prompt_logprobs",
        "return_tokens_as_token_ids", "skip_special_tokens", "stream", "stream_options", "add_generation_prompt",
        "continue_final_message", "chat_template_kwargs", "tools", "tool_choice", "response_format", "logit_bias",
        "thinking_token_budget", "reasoning_effort", "user", "structured_outputs", "return_token_ids",
        "return_token_timestamps"), ("messages",),
        budget=("max_tokens", "max_completion_tokens")),
    Route("/v1/completions", "openai", (
        {"prompt": "Hello", "max_tokens": 2},
        {"prompt": ["A", "B"], "max_tokens": 1, "stream": True},
        {"prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 2, "echo": True},
        {"prompt": "Hi", "max_tokens": 0, "echo": True, "prompt_logprobs": 1},
    ), ("prompt", "model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "seed", "max_tokens", "n", "best_of", "echo", "stop", "stop_token_ids",
        "stop_token_sequences", "ignore_eos", "logprobs", "logprob_token_ids", "prompt_logprobs",
        "return_tokens_as_token_ids", "skip_special_tokens", "stream", "stream_options", "suffix", "logit_bias",
        "tools", "tool_choice", "thinking_token_budget", "user", "response_format", "structured_outputs")),
    Route("/v1/messages", "anthropic", (
        {"model": "m", "max_tokens": 2, "messages": MSGS},
        {"model": "m", "max_tokens": 2, "messages": MSGS, "stream": True, "system": "Be brief."},
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "temperature": 0, "stop_sequences": ["x"]},
    ), ("model", "messages", "system", "max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences",
        "metadata", "tools", "tool_choice", "thinking", "service_tier"), ("messages",),
        {"anthropic-version": "2023-06-01"}),
    Route("/v1/messages/count_tokens", "anthropic", (
        {"model": "m", "messages": MSGS},
        {"model": "m", "messages": MSGS, "system": [{"type": "text", "text": "Be brief."}]},
    ), ("model", "messages", "system", "tools", "tool_choice", "thinking"), ("messages",),
        {"anthropic-version": "2023-06-01"}, budget=()),
    Route("/v1/responses", "openai", (
        {"model": "m", "input": "Say OK.", "max_output_tokens": 2},
        {"model": "m", "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 2, "stream": True},
        {"model": "m", "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
         "instructions": "Be brief.", "max_output_tokens": 1, "temperature": 0},
    ), ("model", "input", "instructions", "max_output_tokens", "stream", "temperature", "top_p", "tools",
        "tool_choice", "text", "reasoning", "include", "top_logprobs", "store", "background", "previous_response_id",
        "metadata", "parallel_tool_calls", "truncation", "user"), ("input",),
        budget=("max_output_tokens",)),
    Route("/v1/decisions", "openai", (
        {"model": "m", "input": "Charged twice", "questions": [{"type": "predicate", "instructions": "Refund?"}]},
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
         "questions": [{"type": "choice", "instructions": "Team?", "choices": [{"value": "a"}, {"value": False}]},
                       {"type": "score", "instructions": "Urgency?", "levels": [{"label": "Low"}, {"label": "High"}]}]},
    ), ("model", "input", "questions", "safety_identifier"), ("questions",), budget=()),
    # vLLM's render routes (a router's prompt ids): the generating routes' bodies, nothing generated
    Route("/v1/chat/completions/render", "openai", (
        {"messages": MSGS, "max_tokens": 2},
        {"messages": [{"role": "system", "content": "Be brief."}, *MSGS], "max_completion_tokens": 1,
         "temperature": 0, "seed": 3},
    ), ("messages", "model", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n", "stop",
        "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools", "tool_choice",
        "response_format", "reasoning_effort", "logit_bias", "seed"), ("messages",),
        budget=("max_tokens", "max_completion_tokens")),
    Route("/v1/completions/render", "openai", (
        {"prompt": "Hello", "max_tokens": 2},
        {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.5},
    ), ("prompt", "model", "temperature", "top_p", "top_k", "max_tokens", "n", "echo", "stop", "suffix", "seed",
        "logit_bias", "logprobs")),
    Route("/api/show", "ollama", ({"model": "m"}, {"model": "m", "verbose": True}), ("model", "verbose", "name"), budget=()),
]


# --- strategies ---------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=20))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16)
NASTY = [
    None, True, False, 0, -1, 1, 3, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**64) - 1,
    10**30, 1e308, -1e308, 5e-324, 0.5, -0.0, 3.0, 1e20, "", "NaN", "nan", "Infinity", "-Infinity", "1e999", "null",
    "\x00", "\u202e\ufeff", "\U0001f600" * 3, "a" * 5000, [], {}, [[]], [{}], [None], {"": {}}, [1, "a", None],
    {"type": "text"}, [{"type": "image_url", "image_url": {"url": "data:,"}}], {"role": "user"}, ["x"] * 40,
    [""], ["", "a"], [-1], [10**6], [2**64], [[-1]], [[1] * 50], [{"type": "function"}],
    [{"type": "function", "function": {"name": 1}}], [{"id": 1, "type": "function", "function": {"arguments": "{"}}],
    {"messages": 1}, {"tools": 5}, {"add_generation_prompt": "x"}, {"bos_token": []}, {"raise_exception": 1},
    {"include_usage": "yes"}, {"type": "json_schema"}, {"type": "enabled", "budget_tokens": -5}, "{{ 7*7 }}",
    "<|im_start|>assistant\n", "{% raw %}", "\ud83d", "low", "auto", "none", "required",
]
nasty = st.sampled_from(NASTY) | json_values
UNKNOWN = st.sampled_from(["extra", "__proto__", "constructor", "", " ", "model ", "MAX_TOKENS", "\u0000", "ñ"])


def _mutations(route: Route):
    key = st.sampled_from(route.fields) | UNKNOWN
    top = st.tuples(st.just("set"), key, nasty) | st.tuples(st.just("del"), st.sampled_from(route.fields), st.none())
    ops = [top]
    if route.nested:
        inner = st.sampled_from(["role", "content", "name", "type", "text", "tool_calls", "tool_call_id",
                                 "reasoning_content", "id", "input", "tool_use_id", "source", "extra"])
        ops.append(st.tuples(st.just("nested"), st.tuples(st.sampled_from(route.nested), inner), nasty))
        ops.append(st.tuples(st.just("list"), st.sampled_from(route.nested), nasty))
    return st.lists(st.one_of(*ops), min_size=1, max_size=4)


def _apply(base: dict, ops) -> dict:
    body = json.loads(json.dumps(base))
    for op, target, value in ops:
        value = copy.deepcopy(value)  # NOTE: strategies share their list values: one placed twice could nest itself
        if op == "set":
            body[target] = value
        elif op == "del":
            body.pop(target, None)
        elif op == "nested":
            name, key = target
            items = body.get(name)
            if isinstance(items, list) and items and isinstance(items[0], dict):
                items[0][key] = value
        elif op == "list":  # replace the whole list, append junk, or empty it
            items = body.get(target)
            if isinstance(value, list):
                body[target] = value
            elif isinstance(items, list):
                items.append(value)
    return body


def _cheap(route: Route, body):
    """Keep accepted requests short: an acceptable, null or omitted output budget becomes <= 2 tokens.

    Wrong types, negative and out-of-context budgets stay (they must be refused); an omitted or null one
    would mean the core's default budget (thousands of tokens), so it is set."""
    if not isinstance(body, dict) or not route.budget:
        return body
    for key in route.budget:
        value = body.get(key, 0)
        if value is None or (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
                             and CHEAP < value < 2**40):
            body[key] = CHEAP if not isinstance(value, float) else float(CHEAP)
    if all(key not in body for key in route.budget):
        body[route.budget[0]] = CHEAP
    return body


def _raw_bodies(route: Route):
    valid = st.sampled_from(route.bases).map(lambda b: json.dumps(b).encode())
    truncated = st.tuples(valid, st.integers(0, 400)).map(lambda t: t[0][: t[1] % max(1, len(t[0]))])
    invalid_utf8 = st.tuples(valid, st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
                                                     b"\x80", b"\xe2\x82"])).map(
        lambda t: t[0].replace(b"Say", t[1], 1).replace(b"Hi", t[1], 1).replace(b"Hello", t[1], 1)
        .replace(b'"m"', b'"' + t[1] + b'"', 1))
    literals = st.sampled_from([
        b"", b"null", b"true", b"0", b"[]", b"\"\"", b"{", b"}", b"{}", b"{}{}", b"[1,]", b"{\"a\":}", b"\xef\xbb\xbf{}",
        b"{\"max_tokens\": NaN}", b"{\"temperature\": Infinity}", b"{\"max_tokens\": -Infinity}",
        b"{\"max_tokens\": 1e400}", b"{\"seed\": 1" + b"0" * 400 + b"}", b"{\"n\": -0}",
        b"{\"max_tokens\": 2, \"max_tokens\": 99999999}", b"\"\\ud800\"", b"{\"messages\": \"\\udfff\"}",
        b"[" * 5000 + b"]" * 5000, b"{\"a\":" * 5000 + b"1" + b"}" * 5000, b"[" * 200000,
        b"{\"messages\": [" + b"[" * 3000 + b"]" * 3000 + b"]}", b"\x00" * 64, b"\x1f\x8b\x08\x00",
    ])
    return st.one_of(st.binary(max_size=256), truncated, invalid_utf8, literals).map(Body)


class Body(bytes):
    """Raw bytes with a short repr: a failing deep-nesting example prints in one line."""

    def __repr__(self) -> str:
        text = bytes.__repr__(self)
        return text if len(text) <= 300 else f"{text[:150]}...<{len(self)} bytes>...{text[-60:]}"


# --- checks -------------------------------------------------------------------------------------

def _check_error_shape(route: Route, status: int, payload) -> None:
    if route.shape == "anthropic":
        assert isinstance(payload, dict) and payload.get("type") == "error", payload
        err = payload.get("error")
        assert isinstance(err, dict) and isinstance(err.get("type"), str) and isinstance(err.get("message"), str), payload
    elif route.shape == "ollama" and status != 401:
        assert isinstance(payload, dict) and isinstance(payload.get("error"), str), payload
    else:
        assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
        err = payload["error"]
        assert set(err) == {"type", "message", "param", "code"}, payload
        assert isinstance(err["type"], str) and isinstance(err["message"], str), payload


def _check_stream(route: Route, text: str) -> None:
    """2xx SSE: an error event may end it (a protocol terminal error), but never a server failure."""
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        err = event.get("error") if isinstance(event, dict) else None
        if isinstance(err, dict):
            assert err.get("type") not in ("server_error", "api_error"), event


class Fuzzer:
    def __init__(self, server, client: httpx.Client, model: str):
        self.server, self.client, self.model = server, client, model
        self.statuses: dict[str, dict[int, int]] = {}  # path -> status -> count (printed at the end)

    def fill(self, base: dict) -> dict:
        return {**base, "model": self.model} if "model" in base else dict(base)

    def post(self, route: Route, body: bytes) -> httpx.Response:
        headers = {"content-type": "application/json", **route.headers}
        t0 = time.monotonic()
        r = self.client.post(route.path, content=body, headers=headers)
        counts = self.statuses.setdefault(route.path, {})
        counts[r.status_code] = counts.get(r.status_code, 0) + 1
        elapsed = time.monotonic() - t0
        shown = repr(Body(body))
        assert elapsed < 2 * TIMEOUT_S, f"{route.path} took {elapsed:.1f}s for {shown}"
        assert r.status_code < 500, f"{route.path} -> {r.status_code} {r.text[:500]} for {shown}"
        if r.status_code >= 400:
            try:
                payload = r.json()
            except ValueError:
                raise AssertionError(f"{route.path} -> {r.status_code} non-JSON {r.text[:300]!r} for {shown}") from None
            _check_error_shape(route, r.status_code, payload)
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            _check_stream(route, r.text)
        return r


@pytest.fixture(scope="module")
def fuzzer(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=TIMEOUT_S) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        fuzzer = Fuzzer(server, c, model)
        yield fuzzer
        for path, counts in fuzzer.statuses.items():
            print(f"\nfuzz {path}: {dict(sorted(counts.items()))}", end="")
    # the server survived: healthy and drained
    deadline = time.monotonic() + 15
    while True:
        snap = httpx.get(server.url + "/metrics?format=json", timeout=10).json()
        if (snap["active"], snap["pending"], snap["http_admission_in_use"]) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (snap["active"], snap["pending"], snap["http_admission_in_use"]) == (0, 0, 0), snap
    assert snap["free_pages"] == snap["total_pages"], snap
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


_present: dict[str, bool] = {}


def _route(fuzzer: Fuzzer, path: str) -> Route:
    route = next(r for r in ROUTES if r.path == path)
    if path not in _present:
        r = fuzzer.client.post(path, content=b"{}", headers={"content-type": "application/json", **route.headers})
        missing = r.status_code == 404 and r.headers.get("content-type", "").startswith("application/json") and \
            isinstance(r.json().get("error"), dict) and r.json()["error"].get("code") == "not_found"
        _present[path] = not missing
    if not _present[path]:
        pytest.skip(f"this server has no {path} route")
    return route


PATHS = [r.path for r in ROUTES]


@pytest.mark.parametrize("path", PATHS)
def test_valid_bases_succeed(fuzzer, path):
    """The seeds the mutations start from are themselves accepted (so mutations probe real branches)."""
    route = _route(fuzzer, path)
    for base in route.bases:
        r = fuzzer.post(route, json.dumps(fuzzer.fill(base)).encode())
        assert r.status_code == 200, (base, r.text)


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_random_json(fuzzer, path):
    route = _route(fuzzer, path)
    objects = st.dictionaries(st.sampled_from(route.fields) | st.text(max_size=6), nasty, max_size=6)

    @_settings(75)
    @given(st.one_of(json_values, objects))
    def run(value):
        fuzzer.post(route, json.dumps(_cheap(route, value)).encode())

    run()


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_mutations(fuzzer, path):
    route = _route(fuzzer, path)

    @_settings(150)
    @given(st.sampled_from(route.bases), _mutations(route))
    def run(base, ops):
        fuzzer.post(route, json.dumps(_cheap(route, _apply(fuzzer.fill(base), ops))).encode())

    run()


@pytest.mark.parametrize("path", PATHS)
def test_fuzz_raw_bytes(fuzzer, path):
    route = _route(fuzzer, path)

    @_settings(75)
    @given(_raw_bodies(route))
    def run(body):
        fuzzer.post(route, body)

    run()
