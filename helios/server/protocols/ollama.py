"""GET /api/tags and POST /api/show: Ollama model discovery only (no /api/chat, /api/generate or management).

Everything comes from the loaded contract and serving limits, never from the model name. Discovery errors
are {"error": message} (ApiError.shape = "ollama"); authentication errors keep the OpenAI shape. No torch.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from helios.server.errors import ApiError
from helios.server.runtime import Runtime

UNKNOWN_TIME = "0001-01-01T00:00:00Z"


def _error(status: int, message: str) -> ApiError:
    err = ApiError(status, "invalid_request_error" if status < 500 else "server_error", message)
    err.shape = "ollama"
    return err


def _details() -> dict:
    # NOTE: family, parameter count and quantization are not part of the prepared contract: empty labels
    return {"parent_model": "", "format": "flare", "family": "", "families": [], "parameter_size": "",
            "quantization_level": ""}


def capabilities(runtime: Runtime) -> list[str]:
    m = runtime.manifest
    caps = ["completion"]
    if m.vision.enabled:
        caps.append("vision")
    if m.recipe.tool_parser:
        caps.append("tools")
    if m.recipe.reasoning_parser:
        caps.append("thinking")
    return caps


def model_info(runtime: Runtime) -> dict:
    m = runtime.manifest
    return {"general.name": m.model.name, "flare.context_length": runtime.serving.max_model_len,
            "flare.vocab_size": m.arch.vocab_size}


def digest(runtime: Runtime) -> str:
    """SHA-256 cache key over the prepared identity (model, file digests) and every advertised detail;
    not an Ollama manifest digest."""
    m = runtime.manifest
    identity = {
        "model": msgspec.to_builtins(m.model),
        "files": sorted(f.sha256 for f in m.files),
        "name": runtime.serving.model_id,
        "details": _details(),
        "model_info": model_info(runtime),
        "capabilities": capabilities(runtime),
    }
    return hashlib.sha256(msgspec.json.encode(identity, order="sorted")).hexdigest()


def tags(runtime: Runtime) -> dict:
    name = runtime.serving.model_id
    return {"models": [{"name": name, "model": name, "modified_at": UNKNOWN_TIME, "size": 0,
                        "digest": digest(runtime), "details": _details()}]}


def show(runtime: Runtime, body: bytes, content_encoding: str | None) -> dict:
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise _error(415, "/api/show accepts uncompressed JSON only")
    try:
        req: Any = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise _error(400, f"malformed JSON body: {e}") from None
    if not isinstance(req, dict):
        raise _error(400, "the body must be a JSON object")
    # NOTE: Ollama takes the older {"name": ...} too; "model" wins when both are given
    name = req["model"] if "model" in req else req.get("name")
    if not isinstance(name, str) or not name:
        raise _error(400, "model must be a nonempty string")
    if "verbose" in req and not isinstance(req["verbose"], bool):
        raise _error(400, "verbose must be a boolean")
    if name not in runtime.serving.names:
        raise _error(404, f"model {name!r} not found")
    # NOTE: verbose and terse modes return the same metadata; templates and tensors are not exposed
    return {"details": _details(), "model_info": model_info(runtime), "capabilities": capabilities(runtime),
            "modified_at": UNKNOWN_TIME}
