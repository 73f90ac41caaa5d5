"""The OpenAI-style error object and the spec's status codes, in one place.

`ApiError` is the value every server layer raises for a request it refuses; the app turns it into
{"error": {"type", "message", "param", "code"}} with its status. Frontend InvalidRequest maps to 400 here.
No torch.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from helios.frontend.sampling import InvalidRequest

T = TypeVar("T")


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class ApiError(Exception):
    def __init__(self, status: int, type: str, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param
        self.code = code
        self.shape: str | None = None  # "ollama": a discovery error encoded as {"error": message}

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())

    def encode_anthropic(self) -> bytes:
        """Messages shape {"type": "error", "error": {"type", "message"}}; every 5xx is api_error."""
        return msgspec.json.encode({"type": "error", "error": {"type": anthropic_type(self), "message": self.message}})

    def encode_ollama(self) -> bytes:
        return msgspec.json.encode({"error": self.message})


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def anthropic_type(err: ApiError) -> str:
    return "api_error" if err.status >= 500 else _ANTHROPIC_TYPES.get(err.status, "invalid_request_error")


def encode_for(path: str, err: ApiError) -> bytes:
    """The one place a refusal picks its protocol's error shape: Messages routes, Ollama discovery
    errors (auth errors there keep the OpenAI shape), and the OpenAI shape everywhere else."""
    if err.shape == "ollama":
        return err.encode_ollama()
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return err.encode_anthropic()
    return err.encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", message, param, code)


def from_invalid(exc: InvalidRequest) -> ApiError:
    return bad_request(exc.message, exc.param, exc.code)


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """msgspec's message names the JSON path ("... - at `$.top_k`"); the param is its first segment."""
    message = str(exc)
    param = None
    if "`$." in message:
        param = message.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0] or None
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        message = f"malformed JSON body: {message}"
    return bad_request(message, param)


def decode_body(body: bytes, type: type[T]) -> T:
    """A JSON body into the route's request Struct; malformed JSON and schema errors are 400s naming the field."""
    try:
        return msgspec.json.decode(body, type=type)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise from_validation(e) from None


def unauthorized() -> ApiError:
    return ApiError(401, "authentication_error", "missing or invalid API key", code="invalid_api_key")


def model_not_found(name: str) -> ApiError:
    return ApiError(404, "invalid_request_error", f"the model {name!r} does not exist", "model", "model_not_found")


def not_found(path: str) -> ApiError:
    return ApiError(404, "invalid_request_error", f"no route for {path}", code="not_found")


def method_not_allowed(method: str, path: str) -> ApiError:
    return ApiError(405, "invalid_request_error", f"{method} is not allowed on {path}", code="method_not_allowed")


def too_large(limit: int, decoded: bool) -> ApiError:
    what = "decoded" if decoded else "encoded"
    return ApiError(413, "request_too_large", f"the {what} request body exceeds {limit} bytes", code="request_too_large")


def unsupported_encoding(encoding: str) -> ApiError:
    return ApiError(
        415, "invalid_request_error", f"unsupported Content-Encoding {encoding!r} (identity, gzip, deflate, br, zstd)",
        code="unsupported_content_encoding",
    )


def rate_limited(slots: int) -> ApiError:
    return ApiError(429, "rate_limit_error", f"all {slots} HTTP admission slots are in use; retry later",
                    code="admission_slots_exhausted")


def unavailable(message: str) -> ApiError:
    return ApiError(503, "server_error", message, code="service_unavailable")


def server_error(message: str) -> ApiError:
    return ApiError(500, "server_error", message, code="internal_error")
