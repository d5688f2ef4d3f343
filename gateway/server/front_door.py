"""The front door: uvicorn's httptools protocol with the bounds a public HTTP server needs.

``gateway serve`` (and the test servers) run ``GatewayHttpProtocol`` instead of uvicorn's own
``HttpToolsProtocol``. It keeps uvicorn's request/response cycle and adds, per process:

- **Head bounds.** The request line (``max_request_line_bytes``, 414), the whole head
  (``max_header_bytes``, 431) and the number of header fields (``max_headers``, 431). A head that
  spans several reads is collected in one buffer and handed to the parser whole, once: httptools
  joins a header that arrives in pieces by re-concatenating it on every read (quadratic in its length),
  and uvicorn does the same for the URL. The search for the end of the head only looks at the new
  bytes, so a client sending a head pays, and makes the event loop pay, linearly in what it sends,
  and never beyond the bound.
- **Time bounds.** Idle before the first request (``first_request_timeout_s``: closed without a
  reply), a head that is not complete in ``header_timeout_s`` from its first byte (408), a body not
  complete in ``body_timeout_s`` from the end of its head (408), idle between requests (uvicorn's
  keep-alive timeout). No timer is armed for a request whose head (and body) arrive in one read.
- **Connections.** Beyond ``max_connections`` open connections a new one is answered 503 at once,
  without reading or parsing anything, and closed; established connections are served as before.
- **Answers in OpenAI's error shape** for everything refused before the app sees it (400 for a
  request the parser rejects: smuggling forms such as Content-Length with Transfer-Encoding, two
  Content-Lengths, obfuscated Transfer-Encoding, bare LF; two Host fields, an invalid Host, none on an
  HTTP/1.1 request; 414, 431, 408, 503). After such an answer
  the connection is half-closed and what the client still sends is read and dropped for a short
  while (a lingering close), so the client reads the answer rather than a connection reset. A
  WebSocket handshake the WebSocket protocol would reject gets the same shape (``ws_handshake``).

Each bound is a process setting (``GATEWAY_*``, see ``gateway.ops.settings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import re
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.ops.settings import Settings
from gateway.server.cycle import request_id_from
from gateway.server.head_answers import FrontDoorLimits, HeadRefused, answers_for, error_response, with_request_id
from gateway.server.uvicorn_internals import missing_internals
from gateway.server.ws_handshake import handshake_refusal

access_log = logging.getLogger("gateway.access")

#: How long a refused connection is still read (and the bytes dropped) after its answer.
LINGER_S = 2.0
_CRLF2 = b"\r\n\r\n"
#: A valid Host value (RFC 9110, section 7.2: uri-host [":" port]) with its trailing whitespace (llhttp
#: strips the leading). No comma, though a reg-name may have one: it is what separates a field's list
#: items, and a Host read as a list is two hosts to whatever splits it.
_HOST = re.compile(rb"(?:\[[0-9A-Za-z._~!$&'()*+;=:-]+\]|[0-9A-Za-z._~%!$&'()*+;=-]*)(?::[0-9]*)?[ \t]*")


class Phase(enum.Enum):
    """Where a connection is in its current request, as the parser has seen it."""

    BETWEEN = "between requests"  # no byte of the next request yet
    HEAD = "in a head"  # the parser began a request's head
    BODY = "in a body"  # the head is complete; its body (if any) is being read


def _nothing() -> None:
    return None


class _TrailerFields(list[tuple[bytes, bytes]]):
    """What ``self.headers`` becomes once a request's head is complete: uvicorn's ``on_header`` appends
    every field to it, and after the head those are a chunked body's trailers. They are counted against
    the head's bound on fields (a 431 beyond it) and dropped: appended to the head's list they would
    change the scope the app is reading. Overriding ``on_header`` instead would cost every field of every
    head a call."""

    __slots__ = ("answer", "left")

    def __init__(self, answer: bytes) -> None:
        super().__init__()
        self.left = 0  # set for each request: one list per connection, it never holds anything
        self.answer = answer

    def append(self, field: tuple[bytes, bytes]) -> None:
        self.left -= 1
        if self.left < 0:
            raise HeadRefused(self.answer)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the front door's bounds (see the module docstring)."""

    def __init__(self, *args: Any, limits: FrontDoorLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits = limits or FrontDoorLimits()
        self.answers = answers_for(limits)
        self._max_head = limits.max_header_bytes
        self._max_line = limits.max_request_line_bytes
        self._max_headers = limits.max_headers
        self._phase = Phase.BETWEEN
        self._head_checked = False  # the head being parsed went through _check_head
        self._head: bytearray | None = None  # a head that spans reads, until it is complete
        self._fed = 0  # how much of _head the parser has seen (complete lines only)
        self._from_start = False  # _head starts at its request line
        # One deadline at a time (first request, head or body), watched by at most one timer that is
        # never cancelled on the request path: clearing the deadline is an attribute write, and the
        # timer, when it fires, re-arms itself for a later deadline or does nothing.
        self._deadline: float | None = None
        self._on_deadline: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._linger: asyncio.TimerHandle | None = None
        self._stalled: asyncio.TimerHandle | None = None  # armed while the client's buffer is full
        self._trailers = _TrailerFields(self.answers.too_many_headers)
        self._refused = False  # answered and half-closed: drop what comes
        # Trailer bytes fed since the last chunk's header with no body after it (None: not in trailers),
        # and trailer fields; the trailers of a chunked body are bounded like a head.
        self._trailer: int | None = None
        self._chunk_header_fed = False
        # The request being answered; ``self.cycle`` is the last one parsed, which may be queued behind it.
        self._answering: RequestResponseCycle | None = None
        self._host = b""  # the last valid Host value on this connection

    # -- connections ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            # Refused before anything is read: one write, and the connection is not counted.
            self.transport = transport
            self._refuse(self.answers.too_many_connections)
            return
        super().connection_made(transport)
        self._set_deadline(self.limits.first_request_timeout_s, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline = self._on_deadline = None  # a bound method of self: no cycle left behind
        for timer in (self._timer, self._linger, self._stalled):
            if timer is not None:
                timer.cancel()
        self._timer = self._linger = self._stalled = None
        self._head = None
        if self.flow is None:  # refused in connection_made: uvicorn never saw it
            self.parser = None
            return
        answering, self._answering = self._answering, None
        if answering is not None and answering is not self.cycle and not answering.response_complete:
            # uvicorn tells only the last request parsed; the one being answered (a pipelined request is
            # queued behind it) must see the disconnect too, or its worker call runs on for nobody.
            answering.disconnected = True
            answering.message_event.set()
        super().connection_lost(exc)

    # -- writing ----------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.limits.send_timeout_s, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _send_expired(self) -> None:
        """The client took none of its answer for send_timeout_s: the answer waits on it with the worker
        call behind it (backpressure), so the connection is closed and its request sees the client gone."""
        self._stalled = None
        if not self.transport.is_closing():
            self.transport.abort()

    # -- reading ----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        if self._head is not None:
            self._collect(data)
            return
        if self._phase is not Phase.BODY:
            end = data.find(_CRLF2) if self._phase is Phase.BETWEEN else -1
            if end == -1 or end + 4 > self._max_head:
                self._start_collecting()
                self._collect(data)
                return
            # The usual case: a whole head in one read, checked with a few C-level scans.
            try:
                self._check_head(data, end)
            except HeadRefused as refused:
                self._refuse(refused.answer)
                return
            self._deadline = None  # the first request's idle deadline, if it was still set
        self._feed(data)

    def _start_collecting(self) -> None:
        self._head = bytearray()
        self._fed = 0
        self._from_start = self._phase is Phase.BETWEEN
        self._set_deadline(self.limits.header_timeout_s, self._head_expired)

    def _collect(self, data: bytes) -> None:
        """Add ``data`` to a head that spans reads. The parser gets its complete lines as they come
        (so a malformed line is refused at once) and never a part of a line (so it never joins
        pieces); the end of the head is searched for in the new bytes only."""
        head = self._head
        assert head is not None
        old = len(head)
        head += data
        end = head.find(_CRLF2, max(0, old - 3))
        if end != -1:
            if end + 4 > self._max_head:
                self._refuse(self.answers.head_too_large)
                return
            if self._from_start:
                try:
                    self._check_head(head, end)
                except HeadRefused as refused:
                    self._refuse(refused.answer)
                    return
            self._finish_collecting()
            return
        if len(head) > self._max_head:
            self._refuse(self.answers.head_too_large)
            return
        cut = head.rfind(b"\n", max(old, self._fed)) + 1
        if cut == 0:
            if self._from_start and self._fed == 0 and len(head) > self._max_line + 2:
                self._refuse(self.answers.line_too_long)
            return
        if self._from_start and self._fed == 0 and head.find(b"\n") > self._max_line + 1:
            self._refuse(self.answers.line_too_long)  # the request line ends here, too long
            return
        self._feed(bytes(head[self._fed : cut]))
        self._fed = cut
        if self._head is not None and self._phase is Phase.BODY:  # a continued head ended on a line boundary
            self._finish_collecting()

    def _finish_collecting(self) -> None:
        head, fed = self._head, self._fed
        assert head is not None
        self._head = None
        self._deadline = None
        self._feed(bytes(head[fed:]))

    def _check_head(self, data: bytes | bytearray, end: int) -> None:
        """The bounds of the head ``data[:end + 4]`` (``end``: where its CRLF CRLF starts)."""
        line_end = data.find(b"\r\n", 0, end + 2)
        if line_end > self._max_line:
            raise HeadRefused(self.answers.line_too_long)
        # "<method> <target> HTTP/1.x": llhttp would also take HTTP/0.9 ("GET /") and other versions.
        if line_end < 14 or not (data.startswith(b" HTTP/1.", line_end - 9) and data[line_end - 1] in (48, 49)):
            raise HeadRefused(self.answers.bad_version)
        if data.count(b"\r\n", line_end + 2, end + 2) > self._max_headers:  # one CRLF per header line
            raise HeadRefused(self.answers.too_many_headers)
        self._head_checked = True

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, HeadRefused):
                self._refuse(refused.answer)
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserError as exc:
            self.send_400_response(f"Invalid HTTP request: {exc}.")
            return
        except httptools.HttpParserUpgrade:
            answering = self._answering
            # A WebSocket takes the connection over: never while a request before it is being answered
            # (its answer would be cut off, the WebSocket's written first); that one closes it instead.
            if self._should_upgrade() and (answering is None or answering.response_complete):
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
                self._after_unsupported_upgrade()
            return
        if self._trailer is not None and self._phase is Phase.BODY:
            if self._chunk_header_fed:  # the chunk's header came in this read: what followed it is unknown
                self._chunk_header_fed = False
            else:
                self._trailer += len(data)
                if self._trailer > self._max_head:
                    self._refuse(self.answers.head_too_large)
                    return
        # A body still to come: it has body_timeout_s from the end of its head.
        if self._phase is Phase.BODY and self._deadline is None and not self._refused and self.cycle.more_body:
            self._set_deadline(self.limits.body_timeout_s, self._body_expired)

    def handle_websocket_upgrade(self) -> None:
        """A handshake the WebSocket protocol would reject is answered here, in the error shape
        (``gateway.server.ws_handshake``); uvicorn's own answer to it is text/plain."""
        refusal = handshake_refusal(self.scope["method"].encode(), self.url, self.scope["headers"])
        if refusal is not None:
            self._refuse(refusal)
            return
        super().handle_websocket_upgrade()

    def _after_unsupported_upgrade(self) -> None:
        """llhttp stops at a request that asks for an Upgrade (not taken here): to it what follows
        is another protocol, the body its Content-Length announced included, so the request was parsed
        without a body. Parsing on would run those bytes as requests of their own (smuggled past a proxy
        that sent them as a body). The request is answered as parsed, with ``connection: close``, and
        nothing after it on this connection is read."""
        self._refused = True  # drop what comes
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        elif not self.transport.is_closing():
            self.transport.close()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._answering = cycle
        HttpToolsProtocol._start_asgi_task(self, cycle, app)  # not super(): once per request

    # -- parser callbacks -------------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        if not self._head_checked:
            # A head the pre-check did not see (it came in the same read as the request before it).
            size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
            if len(self.url) > self._max_line:
                raise HeadRefused(self.answers.line_too_long)
            if len(self.headers) > self._max_headers:
                raise HeadRefused(self.answers.too_many_headers)
            if size > self._max_head:
                raise HeadRefused(self.answers.head_too_large)
            if self.parser.get_http_version() not in ("1.0", "1.1"):
                raise HeadRefused(self.answers.bad_version)
        # Host (RFC 9112, section 3.2): one at most, valid, and one on HTTP/1.1. One pass over the parsed
        # names; the value is matched once per connection (a keep-alive client repeats it).
        host = None
        for name, value in self.headers:
            if name == b"host":
                if host is not None:
                    raise HeadRefused(self.answers.two_hosts)
                host = value
        if host is None:
            if self.parser.get_http_version() == "1.1":
                raise HeadRefused(self.answers.no_host)
        elif host != self._host:
            if _HOST.fullmatch(host) is None:
                raise HeadRefused(self.answers.bad_host)
            self._host = host
        self._head_checked = False
        self._phase = Phase.BODY
        self._deadline = None
        super().on_headers_complete()
        if not self.parser.should_upgrade():  # uvicorn reads an upgrade's headers again (_should_upgrade)
            trailers = self._trailers
            trailers.left = self._max_headers
            self.headers = trailers

    def on_message_begin(self) -> None:
        self._phase = Phase.HEAD
        self._trailer, self._chunk_header_fed = None, False
        super().on_message_begin()

    def on_chunk_header(self) -> None:
        self._trailer, self._chunk_header_fed = 0, True  # trailers follow, unless body does

    def on_body(self, body: bytes) -> None:
        self._trailer = None
        HttpToolsProtocol.on_body(self, body)  # not super(): one call per read of every body

    def on_message_complete(self) -> None:
        self._phase = Phase.BETWEEN
        self._deadline = None
        super().on_message_complete()

    # -- answers and deadlines --------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        self._refuse(error_response(400, msg, "invalid_http_request"))

    def _refuse(self, answer: bytes) -> None:
        """Answer, stop serving this connection, and drop what the client still sends for a while."""
        if self._refused:
            return
        self._refused = True
        self._deadline = None
        self._head = None
        if answer:
            answer = self._tagged(answer)
        cycle: RequestResponseCycle | None = self.cycle
        after_cycle = self._phase is not Phase.BODY  # the refused request is a head after self.cycle's
        if not after_cycle and self.pipeline and self.pipeline[0][0] is cycle:
            # The body of a request queued behind the one being answered: that request never runs, and
            # its answer waits for the requests before it, as a refused pipelined head's does.
            self.pipeline.popleft()
            cycle = self.pipeline[0][0] if self.pipeline else self._answering
            after_cycle = True
        if cycle is not None and not cycle.response_complete:
            if after_cycle and not cycle.disconnected:
                # Refusing a pipelined request while the requests before it are still being answered
                # (or queued, whole): their answers go first (a client matches answers to requests by
                # their order), then this one, after the last of them.
                cycle.on_response = functools.partial(self._answer_and_linger, answer)
                return
            # The app is waiting for a body that will not come: it sees a disconnect.
            if cycle.response_started:
                answer = b""  # the app's answer is on the wire already; it stays cut short
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is not None:
            cycle.on_response = _nothing  # no keep-alive timer, no pipelined request after this
        self._answer_and_linger(answer)

    def _tagged(self, answer: bytes) -> bytes:
        """``answer`` with an ``x-request-id`` (the client's, when the refused request's head was read and
        carried a sane one; else a new one), written to the access log as the app's answers are, so a
        client's report of a refusal can be found there."""
        request_id = request_id_from(list(self.scope["headers"]) if self._phase is Phase.BODY else [])
        if access_log.isEnabledFor(logging.INFO):
            fields = {"request_id": request_id, "route": "front_door", "status": int(answer[9:12])}
            access_log.handle(
                access_log.makeRecord(
                    access_log.name, logging.INFO, __file__, 0, "refused", (), None, extra={"fields": fields}
                )
            )
        return with_request_id(answer, request_id)

    def _answer_and_linger(self, answer: bytes) -> None:
        transport = self.transport
        if transport.is_closing():
            return
        if answer:
            transport.write(answer)
        with contextlib.suppress(Exception):
            if transport.can_write_eof():
                transport.write_eof()
        self._linger = self.loop.call_later(LINGER_S, transport.close)

    def _set_deadline(self, seconds: float, on_deadline: Callable[[], None]) -> None:
        deadline = self.loop.time() + seconds
        self._deadline, self._on_deadline = deadline, on_deadline
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._deadline_reached)
            self._timer_at = deadline

    def _deadline_reached(self) -> None:
        self._timer = None
        deadline, on_deadline = self._deadline, self._on_deadline
        if deadline is None or on_deadline is None:
            return  # met (or dropped) since the timer was armed
        if deadline > self.loop.time():  # a later deadline was set since
            self._timer = self.loop.call_at(deadline, self._deadline_reached)
            self._timer_at = deadline
            return
        self._deadline = None
        on_deadline()

    def _idle_expired(self) -> None:
        """No byte in first_request_timeout_s: close without a reply (there is no request to answer)."""
        if not self.transport.is_closing():
            self.transport.close()

    def _head_expired(self) -> None:
        self._refuse(self.answers.header_timeout)

    def _body_expired(self) -> None:
        if self.cycle is not None and self.cycle.response_complete:
            # Answered before its body was read (a 413 at its Content-Length): a second answer to the
            # same request would be read as the answer to the client's next one. Closed without it.
            self._refuse(b"")
            return
        self._refuse(self.answers.body_timeout)


def http_protocol(settings: Settings) -> Any:
    """What to give uvicorn as ``http``: the protocol with this process's limits (picklable, for
    ``--workers``). Refuses to start on a uvicorn that lacks an internal the protocol relies on."""
    missing = missing_internals()
    if missing:
        raise RuntimeError(
            "this uvicorn lacks what the gateway's front door relies on (" + ", ".join(missing) + "); install the "
            "uvicorn version pyproject.toml pins"
        )
    return functools.partial(GatewayHttpProtocol, limits=FrontDoorLimits.from_settings(settings))
