"""Ollama model discovery (GET /api/tags, POST /api/show) against a real `helios serve`, field by field."""

from __future__ import annotations

import gzip
import hashlib
import json
import re

import httpx
import msgspec
import pytest

from helios.server.protocols import ollama

ALIAS = "smollm2-135m-instruct"
CHECKPOINT = "SmolLM2-135M-Instruct.Q4_1"
DETAILS = {"parent_model": "", "format": "flare", "family": "", "families": [], "parameter_size": "",
           "quantization_level": ""}


def _ollama_error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


def test_tags(http, client):
    r = http.get("/api/tags")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"models"} and len(body["models"]) == 1
    [m] = body["models"]
    assert set(m) == {"name", "model", "modified_at", "size", "digest", "details"}
    model_id = client.models.list().data[0].id
    assert m["name"] == m["model"] == model_id == ALIAS
    assert m["modified_at"] == "0001-01-01T00:00:00Z" and m["size"] == 0
    assert re.fullmatch(r"[0-9a-f]{64}", m["digest"])
    assert m["details"] == DETAILS
    assert http.get("/api/tags").json() == body  # stable


@pytest.mark.parametrize("name", [ALIAS, CHECKPOINT])
def test_show(http, name):
    r = http.post("/api/show", json={"model": name})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"details", "model_info", "capabilities", "modified_at"}  # no template, no tensors
    assert body["details"] == DETAILS
    assert body["model_info"] == {"general.name": CHECKPOINT, "flare.context_length": 8192,
                                  "flare.vocab_size": 49152}
    assert body["capabilities"] == ["completion"]  # text-only, no tool or reasoning parser declared
    assert body["modified_at"] == "0001-01-01T00:00:00Z"
    for verbose in (True, False):
        assert http.post("/api/show", json={"model": name, "verbose": verbose}).json() == body
    # Ollama's older spelling names the model as "name"; "model" wins when both come
    assert http.post("/api/show", json={"name": name}).json() == body
    assert http.post("/api/show", json={"model": name, "name": "nope"}).json() == body
    assert "nope" in _ollama_error(http.post("/api/show", json={"name": "nope"}), 404)


def test_context_length_matches_model_card(http, client):
    card = client.models.list().data[0].model_dump()
    info = http.post("/api/show", json={"model": ALIAS}).json()["model_info"]
    assert info["flare.context_length"] == card["max_model_len"]
    assert info["flare.vocab_size"] == card["flare"]["vocab_size"]


@pytest.mark.parametrize("body", [{}, {"model": ""}, {"model": 3}, {"model": None}, {"model": [ALIAS]},
                                  {"name": ""}, {"name": 3}, {"model": None, "name": ALIAS},
                                  {"model": ALIAS, "verbose": "yes"}, [ALIAS]])
def test_show_400(http, body):
    _ollama_error(http.post("/api/show", json=body), 400)


def test_show_400_malformed_and_404_unknown(http):
    _ollama_error(http.post("/api/show", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "nope" in _ollama_error(http.post("/api/show", json={"model": "nope"}), 404)
    _ollama_error(http.post("/api/show", json={"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}), 404)


def test_show_uncompressed_only(http):
    body = gzip.compress(json.dumps({"model": ALIAS}).encode())
    _ollama_error(http.post("/api/show", content=body, headers={"content-encoding": "gzip"}), 415)


def test_auth_errors_use_openai_format(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for r in (c.get("/api/tags"), c.post("/api/show", json={"model": ALIAS}),
                  c.get("/api/tags", headers={"authorization": "Bearer wrong"})):
            assert r.status_code == 401
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and set(err) == {"type", "message", "param", "code"}


def test_methods_and_unsupported_routes(http):
    assert http.post("/api/tags").status_code == 405
    assert http.get("/api/show").status_code == 405
    for path in ("/api/chat", "/api/generate", "/api/pull"):
        assert http.post(path, json={}).status_code == 404


def test_digest_covers_identity_and_advertised_details(core_runtime):
    d = ollama.digest(core_runtime)
    assert d == ollama.digest(core_runtime)
    identity = {
        "model": msgspec.to_builtins(core_runtime.manifest.model),
        "files": sorted(f.sha256 for f in core_runtime.manifest.files),
        "name": core_runtime.serving.model_id, "details": DETAILS,
        "model_info": ollama.model_info(core_runtime), "capabilities": ollama.capabilities(core_runtime),
    }
    assert d == hashlib.sha256(msgspec.json.encode(identity, order="sorted")).hexdigest()
    renamed = msgspec.structs.replace(core_runtime.serving, model_id="other")
    shorter = msgspec.structs.replace(core_runtime.serving, max_model_len=4096)
    original = core_runtime.serving
    try:
        for serving in (renamed, shorter):
            core_runtime.serving = serving
            assert ollama.digest(core_runtime) != d
    finally:
        core_runtime.serving = original
