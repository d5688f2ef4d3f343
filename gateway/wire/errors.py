"""One error vocabulary for everything a client can see, rendered once in OpenAI's shape.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` with OpenAI's ``type`` values
and the matching HTTP status; ``code`` is a string or null. Plugins raise these classes to refuse a
request; the core renders them (as a JSON body before headers, as one SSE event after).
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson


class GatewayError(Exception):
    """Base of every client-visible error. Subclasses fix ``status`` and ``type``."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        if status is not None:
            self.status_code = status
        else:
            self.status_code = self.status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_json(self) -> bytes:
        return orjson.dumps(self.body())

    def to_sse(self) -> bytes:
        """The error as it is sent after SSE headers: one event, then ``[DONE]``."""
        return b"data: " + self.to_json() + b"\n\ndata: [DONE]\n\n"


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"


class UnprocessableEntity(GatewayError):
    """The request was understood, but what it asks for could not be produced (a retry cannot help)."""

    status = 422
    type = "invalid_request_error"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"


class ServerError(GatewayError):
    status = 500
    type = "server_error"


class BadGateway(GatewayError):
    """The worker failed or answered something that is not a valid response."""

    status = 502
    type = "server_error"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "server_error"


class GatewayTimeout(GatewayError):
    status = 504
    type = "server_error"


def model_not_found(name: object) -> NotFound:
    return NotFound(
        # OpenAI's words, the same whether the model does not exist or this caller may not use it.
        f"The model '{name}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


_TYPE_BY_STATUS = {
    400: InvalidRequest,
    401: AuthenticationFailed,
    403: PermissionDenied,
    404: NotFound,
    405: MethodNotAllowed,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    422: UnprocessableEntity,
    429: RateLimited,
    502: BadGateway,
    503: ServiceUnavailable,
    504: GatewayTimeout,
}


def error_for_status(status: int, message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    """An error of the class OpenAI uses for ``status``, keeping the status itself."""
    cls: type[GatewayError] = _TYPE_BY_STATUS.get(status) or (InvalidRequest if 400 <= status < 500 else ServerError)
    return cls(message, param=param, code=code, status=status)


#: Endpoints whose path is not ``/v1/<name>`` (vLLM serves them at the root), for messages that name them.
_UNVERSIONED = {"classify": "/classify", "pooling": "/pooling", "v2/rerank": "/v2/rerank", "tokenize": "/tokenize"}


def endpoint_not_served(status: int, body: bytes, model: str, endpoint: str) -> NotFound | None:
    """A worker that does not serve ``endpoint`` at all for its model (vLLM registers ``/v1/embeddings``
    only for embedding models: a generative worker answers the web framework's bare 404
    ``{"detail": "Not Found"}``, and a 501 where the route exists without a handler) becomes a 404
    naming the model, with a code; None for any other answer."""
    if status == 404:
        try:
            payload = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            payload = None
        if payload != {"detail": "Not Found"}:
            return None
    elif status != 501:
        return None
    path = _UNVERSIONED.get(endpoint, f"/v1/{endpoint}")
    return NotFound(
        f"The model '{model}' does not support {path}: none of its workers serves that endpoint.",
        param="model",
        code="unsupported_endpoint",
    )


def model_not_on_worker(status: int, body: bytes, model: str) -> bool:
    """Whether a worker's answer is vLLM's 404 for a request naming ``model``, a model (or LoRA adapter) it
    does not serve now: ``The model `<model>` does not exist.`` (followed by ``Valid aliases: ...`` when the
    request is checked before it is scheduled), under ``error`` or at the top level (older vLLM)."""
    if status != 404:
        return False
    try:
        payload = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return False
    err = payload.get("error", payload) if isinstance(payload, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return isinstance(message, str) and message.startswith(f"The model `{model}` does not exist.")


def _param_name(raw: object) -> str | None:
    """vLLM sends ``param`` like ``body.messages``; OpenAI names the field (``messages``)."""
    if not isinstance(raw, str) or not raw:
        return None
    for prefix in ("body.", "body -> "):
        if raw.startswith(prefix):
            raw = raw[len(prefix) :]
    return raw or None


def _readable_message(message: object) -> str:
    """vLLM's validation errors are pydantic dumps; keep the first line a person can act on."""
    text = str(message or "").strip()
    if not text:
        return "The model worker rejected the request."
    if text.startswith("[{") and "'msg':" in text:
        start = text.find("'msg':") + len("'msg':")
        text = text[start:].strip().lstrip("'\"").split("',", 1)[0].split('",', 1)[0]
    return text[:2000]


def from_upstream(status: int, body: bytes) -> GatewayError:
    """Translate a worker's error body (vLLM's or OpenAI's dialect) into the gateway vocabulary.

    The status and meaning are kept; ``type`` becomes OpenAI's, ``code`` a string or null, ``param`` a
    field name. A body that is not JSON is summarised, never echoed wholesale.
    """
    message: object = None
    param: object = None
    code: object = None
    try:
        payload = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            message = err.get("message") or err.get("detail")
            param = err.get("param")
            code = err.get("code")
        elif isinstance(err, str):
            message = err
    if message is None:
        message = f"The model worker answered HTTP {status}."
    code_str = code if isinstance(code, str) and not code.isdigit() else None
    if status >= 500:
        # A worker's internal failure is a gateway-side failure to the client: 502, never its trace.
        return BadGateway(f"The model worker failed (HTTP {status}): {_readable_message(message)}"[:500])
    return error_for_status(status, _readable_message(message), param=_param_name(param), code=code_str)


# -- Anthropic's rendering of the same errors ----------------------------------------------------------

#: The Anthropic Messages API's error ``type`` for an HTTP status (its documented table; a 503 here means
#: no worker has room or none is up, which is what Anthropic's ``overloaded_error`` tells a client).
_ANTHROPIC_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
#: After SSE headers there is no status: the OpenAI type (and for a few, the code) tells the kind.
_ANTHROPIC_BY_CODE = {
    "no_healthy_worker": "overloaded_error",
    "upstream_timeout": "timeout_error",
    "model_not_found": "not_found_error",
}
_ANTHROPIC_BY_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "rate_limit_error": "rate_limit_error",
}


def anthropic_type(status: int | None, error: dict[str, Any]) -> str:
    """Anthropic's error type for an error in OpenAI's shape (``error`` is its inner object), by the
    HTTP status when there is one, else by its code and type."""
    if status is not None:
        found = _ANTHROPIC_BY_STATUS.get(status)
        if found is not None:
            return found
        return "invalid_request_error" if 400 <= status < 500 else "api_error"
    code = error.get("code")
    if isinstance(code, str) and code in _ANTHROPIC_BY_CODE:
        return _ANTHROPIC_BY_CODE[code]
    return _ANTHROPIC_BY_TYPE.get(str(error.get("type")), "api_error")


def anthropic_body(status: int | None, error: dict[str, Any]) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``: the error in Anthropic's shape."""
    message = error.get("message")
    return {
        "type": "error",
        "error": {"type": anthropic_type(status, error), "message": message if isinstance(message, str) else ""},
    }


def anthropic_json(error: GatewayError) -> bytes:
    """A gateway error as an Anthropic Messages API error body."""
    return orjson.dumps(anthropic_body(error.status_code, error.body()["error"]))


def anthropic_sse(error: dict[str, Any]) -> bytes:
    """An error after SSE headers, as Anthropic streams one: an ``error`` event (the stream then ends)."""
    return b"event: error\ndata: " + orjson.dumps(anthropic_body(None, error)) + b"\n\n"


def anthropic_from_openai(status: int, body: bytes) -> bytes:
    """An error already rendered in OpenAI's shape (a refusal, a worker's 4xx) in Anthropic's."""
    try:
        payload = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        payload = None
    inner = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(inner, dict):
        inner = {"message": f"The request failed with HTTP {status}."}
    return orjson.dumps(anthropic_body(status, inner))
