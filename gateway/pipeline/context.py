"""The per-request state plugins see (RequestContext) and the response value they pass around."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from gateway.wire.streaming import USAGE_MEMBER, wants_usage

log = logging.getLogger("gateway.context")

if TYPE_CHECKING:
    from gateway.pipeline.batch_config import BatchLine
    from gateway.pipeline.config import GatewayConfig, ModelConfig
    from gateway.pipeline.models import ModelTable
    from gateway.upstream.workers import Worker
    from gateway.wire.errors import GatewayError


class HookChain(Protocol):
    """What the core calls on the pinned snapshot's plugins (``gateway.pipeline.chain.Pipeline``).

    Declared here, structurally, so that the context (which every plugin imports) does not name the
    runtime that is built from plugins: the types a plugin sees stay below the code that uses them.
    """

    chunk_plugins: Any

    async def run_request(self, ctx: RequestContext) -> ModelResponse | None: ...

    def inspects_stream(self, ctx: RequestContext) -> bool: ...

    def settles_from_usage(self, ctx: RequestContext) -> bool: ...

    async def run_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse: ...

    async def run_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None: ...


class PinnedSnapshot(Protocol):
    """The config snapshot a request pinned for its whole life (``gateway.pipeline.runtime.RuntimeSnapshot``)."""

    @property
    def config(self) -> GatewayConfig: ...

    @property
    def pipeline(self) -> HookChain: ...

    @property
    def models(self) -> ModelTable: ...


class ModelResponse:
    """A complete (non-streamed, or assembled) OpenAI response.

    Holds the body as bytes, the parsed object, or both, and converts lazily: a response that no
    plugin looks at is passed to the client as the bytes the worker sent.

    ``chunks``: for an early answer to a streaming request (a cache hit), the stream events it came
    from, in order, as their JSON payloads one per line (without ``[DONE]``): the core replays them as
    they are instead of synthesizing events from the object. ``replace_json`` drops them, since they no
    longer add up to the object.

    ``recorded``: for a completed stream that a plugin asked to have recorded (``ctx.record_stream``) and
    that passed through as bytes, its events as they went out, parsed, in order (the usage event
    included, also when the client was not sent it); None otherwise. ``recorded_events``: the same
    events as the worker wrote them, their JSON payloads one per line (the form of ``chunks``), not
    parsed; None when they were not kept (past the recording's budget, or an event of several lines).

    ``assemble``: instead of a body or an object, a function that gives the object and the parsed
    ``recorded`` events on first use: a recorded stream's answer is only parsed when a plugin reads it.
    """

    __slots__ = ("_assemble", "_body", "_json", "_recorded", "chunks", "headers", "recorded_events", "status")

    def __init__(
        self,
        *,
        body: bytes | None = None,
        json: dict[str, Any] | None = None,
        status: int = 200,
        headers: dict[str, str] | None = None,
        chunks: bytes | None = None,
        assemble: Callable[[], tuple[dict[str, Any], list[dict[str, Any]] | None]] | None = None,
    ) -> None:
        if body is None and json is None and assemble is None:
            raise ValueError("a ModelResponse needs a body, a json object or a way to assemble one")
        self._body = body
        self._json = json
        self._assemble = assemble
        self._recorded: list[dict[str, Any]] | None = None
        self.status = status
        self.headers = headers or {}
        self.chunks = chunks
        self.recorded_events: bytes | None = None

    @property
    def json(self) -> dict[str, Any]:
        if self._json is None:
            if self._body is None:
                self._assembled()
                assert self._json is not None
                return self._json
            parsed = orjson.loads(self._body)
            self._json = parsed if isinstance(parsed, dict) else {"value": parsed}
        return self._json

    @property
    def usage(self) -> Any:
        """The answer's ``usage`` (None without one). An answer still to be assembled from stream events
        (a recorded stream, a cached one replayed) is not: the last event that carries a usage object is
        read alone (a member name cannot match inside a string, where quotes are escaped)."""
        events = self.chunks if self.chunks is not None else self.recorded_events
        if self._json is not None or self._body is not None or events is None:
            return self.json.get("usage")
        at = events.rfind(USAGE_MEMBER)
        if at >= 0:
            end = events.find(b"\n", at)
            try:
                event = orjson.loads(events[events.rfind(b"\n", 0, at) + 1 : end if end >= 0 else len(events)])
            except orjson.JSONDecodeError:
                event = None
            usage = event.get("usage") if isinstance(event, dict) else None
            if usage and isinstance(usage, dict):
                return usage
        return self.json.get("usage")

    @property
    def recorded(self) -> list[dict[str, Any]] | None:
        if self._assemble is not None:
            self._assembled()
        return self._recorded

    @recorded.setter
    def recorded(self, events: list[dict[str, Any]] | None) -> None:
        self._recorded = events

    def _assembled(self) -> None:
        assemble, self._assemble = self._assemble, None
        assert assemble is not None
        obj, self._recorded = assemble()
        if self._json is None and self._body is None:
            self._json = obj

    @property
    def body(self) -> bytes:
        if self._body is None:
            self._body = orjson.dumps(self.json)
        return self._body

    def replace_json(self, obj: dict[str, Any]) -> None:
        """Swap the object (the bytes are re-rendered from it when needed)."""
        self._json = obj
        self._body = None
        self.chunks = None
        self.recorded_events = None  # no longer the answer's events either


class RoutePlan(Protocol):
    """How a routing plugin hands its choice to the core, including what to do after a failure.

    The core calls ``next_worker(None, None)`` for the first attempt; after a failure that is safe to
    retry (no byte has reached the client) it calls ``next_worker(failed, error)`` and tries the worker
    it returns, or gives up with ``error`` when it returns None. ``finished`` is called exactly once
    per attempt with the outcome, so load counters and outlier detection stay exact. A plan may also have
    ``async prepare(worker)``, which the core awaits before each attempt on ``worker`` (the first, a retry,
    a stream's continuation): e.g. loading the request's LoRA adapter there; what it raises fails the
    attempt and reaches the client. And it may have ``model_missing(worker) -> bool``, which the core calls
    when ``worker`` answered an attempt with vLLM's 404 for the request's model (``The model `X` does not
    exist.``, ``gateway.wire.errors.model_not_on_worker``): a plan that sent the request there believing
    the worker held that model (a LoRA adapter that another gateway replica has since unloaded there)
    forgets that belief and returns True; the core then calls ``finished`` for the attempt (``ok=True``: not
    the worker's failure) and makes one more attempt on the same worker, ``prepare`` first, as if chosen by
    ``next_worker`` (a plan that holds an admission slot per attempt takes it again here). At most once per
    request, and never for a stream's continuation; False, or no such method, and the 404 reaches the client.
    """

    def next_worker(self, failed: Worker | None, error: GatewayError | None) -> Worker | None: ...

    def finished(self, worker: Worker, *, ok: bool, error: GatewayError | None = None) -> None: ...

    def has_alternative(self) -> bool:
        """Whether ``next_worker`` could still offer another healthy worker of the request's model (not
        tried yet, attempts left): a stream cut midway is continued only then."""
        ...


@dataclass(frozen=True, slots=True)
class StreamError:
    """The error event the core ended a stream with: its HTTP status and its ``error`` object (OpenAI's
    shape). Kept as data: the exception it was rendered from holds the frames that raised it, and those the
    request, which would keep the request in a reference cycle."""

    status: int
    error: dict[str, Any]


@dataclass(slots=True)
class Delivered:
    """What the client was given, set by the core once it is known; read by plugins in a finalizer
    (``ctx.add_finalizer``), e.g. to bill a request for what it received.

    - A JSON answer (or an early one, e.g. a cache hit, also when replayed as a stream): set when the
      response passed every ``on_response`` hook (``status`` is the one sent; its usage is the
      response's, which ``on_response`` saw). An error reply (a refusal, an upstream failure) leaves
      ``ctx.delivered`` None. A batch line's answer is delivered when it is written as the line's
      result, before its finalizers run: a run of the line whose answer was not (another run, on a
      replica that took its lapsed lease over, wrote one first) has ``ctx.delivered`` set back to None.
    - A stream: set when its first event is about to go out, then kept current until it ends, however
      it ends (``[DONE]``, the client went away, the worker cut it): ``stream_tokens`` counts the
      completion tokens already handed to the client's connection (one per worker choice delta that
      carried text, reasoning or a tool call: vLLM sends one per generated token; text a chunk hook
      held back counts once a later piece went out), ``usage`` is the worker's usage when the stream
      carried it (``stream_options.include_usage``), and once it completed only with a completion count
      its events can hold (``gateway.wire.completion_bound``: a faulty or hostile worker's claim is None),
      ``complete`` whether it ended with ``[DONE]``. A byte pass-through stream is counted only when a
      plugin needs its usage (``Plugin.reads_stream_text = False``) or a recording of it
      (``record_stream``): its usage event, else its events less the role event; otherwise
      ``stream_tokens`` is None.
    """

    status: int = 200
    usage: dict[str, Any] | None = None
    stream_tokens: int | None = None
    complete: bool = True


@dataclass(slots=True)
class RequestContext:
    """Everything known about one request, from parse to last byte.

    ``body`` is the parsed JSON the client sent; a plugin that changes it calls ``mark_body_changed``
    so the core re-serializes it once before the upstream call (unchanged bodies go upstream as the
    bytes the client sent). ``state`` is per-plugin scratch space, keyed by plugin name, and nothing else:
    what the core and the contract define are typed fields.
    """

    request_id: str
    endpoint: str  # "chat/completions" | "completions" | "embeddings"
    path: str  # upstream path, e.g. "/v1/chat/completions"
    body: dict[str, Any]
    raw_body: bytes
    headers: dict[str, str]  # lower-cased names
    model: ModelConfig
    requested_model: str
    snapshot: PinnedSnapshot
    stream: bool
    started: float
    tenant: str | None = None
    priority: int = 0  # admission order when a model is full (higher first); set from tenant config
    api_key_id: str | None = None
    plan: RoutePlan | None = None
    worker: Worker | None = None
    delivered: Delivered | None = None
    #: Set by the core when an attempt is sent to a worker (its generation may have begun): a request that
    #: ends before then cost the fleet nothing.
    reached_worker: bool = False
    #: Set by the core when the client went away before its answer was complete (the request was then
    #: cancelled; for a batch line, its batch's owner cancelled the batch while the line ran): a request
    #: that ends without it and without ``delivered`` failed, was refused, or was stopped by the gateway.
    client_gone: bool = False
    #: Set by an access-control plugin (tenancy): may this request be served by the named model?
    #: A plugin that moves the request to another model (routing: canaries, fallbacks) asks first.
    model_allowed: Callable[[str], bool] | None = None
    #: Set by an admission plugin (tenancy's ``without_max_tokens: clamp``) that wrote ``max_tokens`` into
    #: a body whose client sent none: the value it wrote. The body's ``max_tokens`` is then the gateway's,
    #: not the client's: a plugin that keys on what the client asked (the cache) leaves it out, and one that
    #: would answer without the worker (a cache hit) gives no choice more completion tokens than it.
    clamped_max_tokens: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    log: dict[str, Any] = field(default_factory=dict)  # extra fields for the access log line
    body_changed: bool = False
    resumed: int = 0  # times a cut stream was continued on another worker (plugins see one stream)
    #: Set by the batch runner only (a client cannot): whose batch this line is (``gateway.pipeline.batch_config``).
    batch_line: BatchLine | None = None
    #: Set by a chunk hook that must end the stream early (an output check that fired): the core stops
    #: reading the worker after that chunk and ends the stream with ``[DONE]``.
    close_stream: bool = False
    #: The pipeline's own record (``gateway.pipeline.chain``): the plugins whose ``on_request`` ran and did
    #: not step aside, i.e. whose ``on_response`` / ``on_chunk`` this request calls. Not for plugins.
    returning: list[Any] = field(default_factory=list)
    #: Plugins that called ``step_aside`` for this request (None: none did).
    stepped_aside: set[object] | None = None
    #: Plugins that asked for a recording of the stream instead of its chunks (``record_stream``), and
    #: the most SSE bytes the core keeps for them.
    recorders: tuple[object, ...] = ()
    record_max_bytes: int = 0
    #: The gateway, not the client, asked the worker for the stream's usage event
    #: (``stream_options.include_usage``): the client is not sent it.
    usage_added: bool = False
    #: Set by the core when it ends the stream with an error event of its own (a hook's refusal, a worker's
    #: failure it could not hide, read into the gateway's vocabulary): that event. A reader of the chat
    #: stream that renders it in another API's shape takes that event for what it is, not for a worker's.
    stream_error: StreamError | None = None
    _finalizers: list[Callable[[], None]] = field(default_factory=list)

    def step_aside(self, plugin: object) -> None:
        """Called by a plugin's ``on_request`` (``ctx.step_aside(self)``) when it has nothing more to do
        for this request: its ``on_chunk`` and ``on_response`` are then not called. When every plugin
        that would look at a stream has stepped aside, the worker's SSE bytes pass through unparsed."""
        if self.stepped_aside is None:
            self.stepped_aside = set()
        self.stepped_aside.add(plugin)

    def record_stream(self, plugin: object, max_bytes: int) -> None:
        """Called by an ``on_request`` whose plugin reads the stream's text only once it is complete and
        changes no chunk (the cache, to store it): when no other plugin must read the stream chunk by
        chunk, it passes through as bytes and this plugin's ``on_chunk`` is not called; the core keeps the
        events (up to ``max_bytes`` of SSE: past that the recording is dropped) and, if the stream
        completes, ``on_response`` gets the assembled answer with ``response.recorded``. When the stream
        is parsed anyway, ``on_chunk`` runs as usual and ``response.recorded`` is None."""
        if plugin not in self.recorders:
            self.recorders = (*self.recorders, plugin)
        self.record_max_bytes = max(self.record_max_bytes, max_bytes)

    def ask_for_usage(self) -> bool:
        """Make the worker end this request's stream with a usage event (``stream_options.include_usage``),
        for a plugin or the core that needs it (billing, a stored answer). Returns whether the client asked
        for it itself; when not, ``usage_added`` is set and the event is kept from the client. The body
        is changed as bytes when the client sent no ``stream_options`` (one member in front of the
        client's JSON, no re-serializing)."""
        body = self.body
        if wants_usage(body):
            return not self.usage_added
        if "stream_options" in body:
            options = body["stream_options"]
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            self.mark_body_changed()
        else:
            self.put_member("stream_options", {"include_usage": True}, b'{"stream_options":{"include_usage":true},')
        self.usage_added = True
        return False

    def put_member(self, name: str, value: Any, head: bytes | None = None) -> None:
        """Add the top-level member ``name``, which the body does not have. While the body is otherwise
        unchanged it is added to the bytes, as one member in front of the client's JSON, not by
        re-serializing the whole body (a long prompt is not run through the encoder again); ``head`` is
        that front, ``{"name":value,``, when the caller has it ready."""
        body = self.body
        raw = self.raw_body.lstrip()
        # A member in front needs one after it for its comma: an empty body is re-serialized instead.
        if body and not self.body_changed and raw[:1] == b"{":
            front = head if head is not None else b"{" + orjson.dumps(name) + b":" + orjson.dumps(value) + b","
            self.raw_body = front + raw[1:]
        else:
            self.mark_body_changed()
        body[name] = value

    def add_finalizer(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the request is over, whatever the outcome (answered, refused,
        failed, cut, or the client went away): for a plugin that holds something for the life of a
        request (e.g. the cache's single-flight lock). It must not block; schedule async work."""
        self._finalizers.append(callback)

    def finalize(self) -> None:
        """Called by the core exactly once, after the last byte (or the error) was sent."""
        callbacks, self._finalizers = self._finalizers, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one plugin's cleanup must not skip another's
                log.exception("request %s: a finalizer failed", self.request_id)
        # A route plan usually holds its context (a fallback retargets it): dropping the link once the
        # request is over lets both be freed by reference counting. Left to the cycle collector, the
        # requests of hundreds of streams pile up between its full collections and make each one a
        # pause of tens of milliseconds.
        self.plan = None

    def allows_model(self, name: str) -> bool:
        """Whether this request may be served by model ``name`` (True when no plugin restricts it)."""
        check = self.model_allowed
        return check is None or check(name)

    def mark_body_changed(self) -> None:
        self.body_changed = True

    def upstream_body(self) -> bytes:
        if self.body_changed:
            return orjson.dumps(self.body)
        return self.raw_body
