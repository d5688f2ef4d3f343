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
    return NotFound(
        f"The model '{model}' does not support /v1/{endpoint}: none of its workers serves that endpoint.",
        param="model",
        code="unsupported_endpoint",
    )


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
