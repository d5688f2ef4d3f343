"""The front door's limits (process settings) and its canned answers: complete HTTP/1.1 responses in the
gateway's error shape for what is refused before the app sees it (414, 431, 408, 400, 503), built once
per set of limits."""

from __future__ import annotations

import functools
import http
from dataclasses import dataclass

from gateway.ops.settings import Settings
from gateway.wire.errors import error_for_status


@dataclass(frozen=True, slots=True)
class FrontDoorLimits:
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    max_request_line_bytes: int = 8 * 1024
    first_request_timeout_s: float = 15.0
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    send_timeout_s: float = 60.0

    @classmethod
    def from_settings(cls, settings: Settings) -> FrontDoorLimits:
        return cls(
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            max_request_line_bytes=settings.max_request_line_bytes,
            first_request_timeout_s=settings.first_request_timeout_s,
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            max_connections=settings.max_connections,
            send_timeout_s=settings.send_timeout_s,
        )


def error_response(status: int, message: str, code: str, *, extra: bytes = b"") -> bytes:
    """A complete HTTP/1.1 answer in the gateway's error shape (``gateway.wire.errors``) that closes the
    connection."""
    body = error_for_status(status, message, code=code).to_json()
    phrase = http.HTTPStatus(status).phrase.encode()
    return (
        b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%b\r\n%b"
        % (status, phrase, len(body), extra, body)
    )


def with_request_id(answer: bytes, request_id: str) -> bytes:
    """``answer`` (an ``error_response``) with an ``x-request-id`` field after its status line: every
    answer the gateway gives carries one, its own refusals before the app included."""
    line_end = answer.index(b"\r\n") + 2
    return b"%bx-request-id: %b\r\n%b" % (answer[:line_end], request_id.encode("ascii"), answer[line_end:])


class HeadRefused(Exception):
    """A request head outside the bounds; ``answer`` is what the client gets."""

    def __init__(self, answer: bytes) -> None:
        super().__init__()
        self.answer = answer


class Answers:
    """The canned answers for one set of limits (built once per process)."""

    def __init__(self, limits: FrontDoorLimits) -> None:
        self.line_too_long = error_response(
            414,
            f"The request line is longer than this gateway accepts ({limits.max_request_line_bytes} bytes).",
            "uri_too_long",
        )
        self.head_too_large = error_response(
            431,
            f"The request headers are larger than this gateway accepts ({limits.max_header_bytes} bytes in all).",
            "request_header_fields_too_large",
        )
        self.too_many_headers = error_response(
            431,
            f"The request has more header fields than this gateway accepts ({limits.max_headers}).",
            "request_header_fields_too_large",
        )
        self.header_timeout = error_response(
            408,
            f"The request headers did not arrive within {limits.header_timeout_s:g} s.",
            "request_timeout",
        )
        self.body_timeout = error_response(
            408,
            f"The request body did not arrive within {limits.body_timeout_s:g} s.",
            "request_timeout",
        )
        self.bad_version = error_response(
            400, "Only HTTP/1.0 and HTTP/1.1 requests are served here.", "invalid_http_request"
        )
        self.no_host = error_response(
            400, "An HTTP/1.1 request needs a Host header (RFC 9112, section 3.2).", "invalid_http_request"
        )
        self.two_hosts = error_response(
            400, "The request has more than one Host header (RFC 9112, section 3.2).", "invalid_http_request"
        )
        self.bad_host = error_response(
            400,
            "The request's Host header is not a host with an optional port (RFC 9112, section 3.2).",
            "invalid_http_request",
        )
        self.too_many_connections = error_response(
            503,
            "The gateway has too many open connections; try again shortly.",
            "too_many_connections",
            extra=b"retry-after: 1\r\n",
        )


@functools.lru_cache(maxsize=16)
def answers_for(limits: FrontDoorLimits) -> Answers:
    return Answers(limits)
