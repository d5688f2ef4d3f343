"""The plugin contract and the loop that runs it.

The contract
============

A plugin is a subclass of ``Plugin`` registered under the entry-point group ``gateway.plugins``
(built-ins too). ``config.yaml`` alone enables plugins and sets their order. Each plugin class has:

- ``Config``: a pydantic model for its ``config:`` section, validated before a config goes live.
- ``__init__(config, services)``: build from the validated config and the process-wide services
  (upstream client, Redis, worker table, metrics). No I/O here.
- ``prepare(config)``: optional; sees the whole ``GatewayConfig`` being prepared (e.g. the model table,
  to check names the plugin's own section refers to). Raising ``ValueError`` refuses that config.
- ``async start()``: open what the plugin needs (connections, files, compiled rules). A failure refuses
  the config that asked for it; the running config stays live. Open only this instance's own things
  here: state the live config uses too (``services.shared`` entries, what the worker table's feeds
  follow, the discovered workers) changes in ``went_live``, since a later plugin's ``start`` may still
  refuse this config, and a refused config must change nothing live.
- ``async on_request(ctx)``: runs in list order before the upstream call. Return None to go on, return
  a ``ModelResponse`` to answer early (later hooks and the upstream are skipped), or raise a
  ``GatewayError`` to refuse (a refusal is a decision, rendered as an OpenAI error; no upstream call).
- ``async on_response(ctx, response)``: runs in reverse order, only for plugins whose ``on_request``
  ran and did not itself answer early. Return None to keep the response or a replacement
  ``ModelResponse``; raise a ``GatewayError`` to turn it into an error. For a stream it runs once,
  after the last chunk, with the assembled response: it may raise (the stream then ends with one error
  event instead of ``[DONE]``) but not replace what was already sent.
- ``reads_stream_text``: class attribute, True by default. A plugin whose ``on_response`` needs only a
  stream's usage (tenancy, to bill) sets it False: such a stream still passes through as bytes when no
  other plugin reads it, and its ``on_response`` gets a response whose JSON is ``{"usage": ...}`` (the
  worker's usage event, which the core asks for and hides from a client that did not), called before
  ``[DONE]`` goes out; ``ctx.delivered`` then counts the tokens sent.
- ``replaces_answers`` and ``keeps_answers``: class attributes, False by default. A plugin whose
  ``on_response`` may give the request another answer than the one it was handed (guided_json: a cut
  answer retried) or mark it ``Cache-Control: no-store`` sets ``replaces_answers``; one whose
  ``on_response`` keeps the answer it is handed, to give it to later requests (the cache), sets
  ``keeps_answers``. ``on_response`` runs in reverse order, so a config that lists a plugin that
  replaces answers before one that keeps them is refused when it loads: the keeper would keep each
  answer before it was replaced, and give it to later requests where there is no worker to replace it
  with. A plugin that only refuses answers or changes them in place need not set it: listed before the
  keeper, its ``on_request`` runs on every request the keeper answers, so its ``on_response`` checks
  each answer the keeper gives back (safety's output rules).
- ``identifies_callers``: class attribute, False by default. A plugin whose ``on_request`` decides who is
  calling (sets ``ctx.tenant``, refuses a request without a valid key: tenancy) sets it. A plugin that
  keeps answers (``keeps_answers``) listed before it would answer a request from what it kept before the
  caller was known (no key check, no limits, every caller sharing one scope of answers): such a config is
  refused when it loads.
- ``ctx.record_stream(self, max_bytes)``: an ``on_request`` whose plugin reads a stream's text only once
  it is complete and changes no chunk (the cache, to store it) asks for a recording instead of chunks:
  when no other plugin must read the stream chunk by chunk, it passes through as bytes, its ``on_chunk``
  is not called, and its ``on_response`` gets the assembled answer with ``response.recorded`` (the events
  as they went out, parsed once at the end; None past ``max_bytes``), before ``[DONE]`` goes out. The
  answer and ``recorded`` are parsed when first read: a plugin that keeps the events as they came reads
  ``response.recorded_events`` (their JSON payloads, one per line) and costs no parsing.
- ``async on_chunk(ctx, chunk)``: streams only, reverse order; return the chunk, a changed chunk, or
  None to hold it back. When no enabled plugin overrides ``on_chunk`` or ``on_response``, the worker's
  SSE bytes pass through untouched, with no per-chunk parsing.
- ``ctx.step_aside(self)``: an ``on_request`` that needs neither ``on_chunk`` nor ``on_response`` for
  this request (the cache bypassing it, no output rules, no constraint to check) says so; those hooks
  are then skipped for it, and a stream that no remaining plugin watches passes through as bytes.
  A chunk hook that must end the stream early (e.g. an output check that fired) returns the last chunk
  it wants sent and sets ``ctx.close_stream = True``: the core stops reading the worker
  (closing the connection makes vLLM abort the generation) and ends the stream with ``[DONE]``.
- ``ctx.add_finalizer(callback)`` runs ``callback`` once when the request is over, whatever the outcome;
  there ``ctx.delivered`` (``Delivered``, set by the core) says what the client was given: an answer
  and its status, or for a stream, however it ended (``[DONE]``, the client gone, the worker cut it),
  how many completion tokens went out and whether it completed (None: nothing was delivered, e.g. a
  refusal or an upstream failure, or a batch line's answer that was not written as the line's result
  because another run of the line wrote one first). That is the hook to bill by (tenancy). ``ctx.reached_worker`` says
  whether the request was sent to a worker, and ``ctx.client_gone`` whether the client went away before
  its answer was complete: a client that hangs up while the worker generates is not a failure.
- ``ctx.plan``: the terminal plugin's ``on_request`` (routing) sets a ``RoutePlan``
  (``gateway.pipeline.context``): which worker the core tries first, and next after a failure that is safe
  to retry. Two optional steps: ``async prepare(worker)``, awaited before each attempt (routing loads the
  request's LoRA adapter there), and ``model_missing(worker)``, called when the worker answered vLLM's 404
  for the request's model: True when the plan believed the worker held it and has forgotten that (an
  adapter another gateway replica unloaded), and the core then tries that worker once more.
- ``ctx.model_allowed`` (set by an access-control plugin) and ``ctx.allows_model(name)``: a plugin that
  moves the request to another model (canary, fallback) asks first. ``ctx.priority`` (set from tenant
  config) orders admission queues. ``ctx.clamped_max_tokens`` (set by an admission plugin that wrote
  ``max_tokens`` into a body that had none: tenancy's clamp) says that the body's ``max_tokens`` is the
  gateway's, not the client's: a plugin that keys answers on the request (the cache) leaves it out.
- ``async on_models(headers, models)``: optional; sees the model cards ``GET /v1/models`` (and
  ``/v1/models/{id}``) is about to list, in list order, with the request's lower-cased headers, and
  returns the cards this caller may see (e.g. tenancy: only the models a key may use), or raises a
  ``GatewayError`` (e.g. 401 without a key).
- ``model_moves()``: optional; a plugin that moves requests to other models (routing: canary targets,
  fallbacks) declares where, after ``prepare``: ``{model: models a request for it may be served by}``.
  The core publishes the whole graph as ``ctx.snapshot.models.reachable(name)`` (e.g. for tenancy, whose
  reservation must cover wherever a request may go).
- ``async on_side_request(call)``: optional; a route that does not run the inference pipeline is about
  to answer: ``GET /v1/models`` and ``/v1/models/{id}``, ``POST /tokenize`` and ``/detokenize``, the stored
  Responses' reads, input items, deletes and cancels, and every Files and Batch API call (``/v1/files``,
  ``/v1/batches``: the lines a batch runs later go through ``on_request``, not here); and
  ``responses.create``, a ``POST /v1/responses`` that continues a stored conversation, before the gateway
  reads that conversation and has a worker count it for truncation: a check only, since the turn then
  runs the pipeline, whose ``on_request`` counts and reserves it (tenancy: a 429 for a key or tenant
  without room for even the least the turn can cost, nothing counted); ``call.model`` is the model as for
  tokenize, after ``on_models`` saw the caller, and ``call.body`` the turn's chat request without the
  conversation (empty when the model is unknown or hidden: the turn is then refused with a 404 after the
  hook). ``call``
  (``SideCall``) names the route, the request's lower-cased headers and, for tokenize and detokenize,
  the parsed body and the model (its config name, or None when the model does not exist or this
  caller may not see it: both look the same). Runs in list order, once per request; return None to
  go on or raise a ``GatewayError`` to refuse: the same request limits as inference (tenancy: a 429,
  no token charge) and the same size and count bounds (safety: messages, prompt size).
- ``async on_admin(action, body)``: optional operator actions served at
  ``POST /admin/plugins/{name}/{action}`` (e.g. the cache's ``purge``); returns a JSON-able dict or
  raises a ``GatewayError``. Only the live snapshot's instance is called. Never loads code or files
  named in ``body``.
- ``went_live()``: optional, a plain function: the instance's config has just become the live one (called
  once, right after the swap; never for a refused config). The place to make process-wide state match
  this config (e.g. routing drops adapter pins of adapters it no longer lists): ``start`` may belong to a
  config that a later plugin's ``start`` refuses. No I/O, no waiting; an exception is logged, the config
  stays live.
- ``async aclose()``: the runtime owning the instance was retired (reload, shutdown) and its in-flight
  requests drained.
- ``default_on_error``: ``fail_closed`` (a hook failure answers 503) or ``fail_open`` (the failure is
  logged and counted, and the request goes on as if the hook returned None); config may override it
  per plugin with ``on_error``. ``default_timeout_ms``: the time budget of each hook call (config:
  ``timeout_ms``); running over it counts as a failure under the same policy.
- The hooks above marked ``async`` must be coroutine functions (``async def``): a config whose plugin
  overrides one with a plain function is refused when it loads, since such a hook would run before its
  time budget and failure policy apply. Likewise ``prepare``, ``model_moves`` and ``went_live`` must be
  plain functions: the core calls them without awaiting, so an ``async def`` one would only make a
  coroutine that never runs; a config naming such a plugin is refused when it loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.wire.errors import NotFound

if TYPE_CHECKING:
    from gateway.pipeline.config import GatewayConfig
    from gateway.pipeline.services import Services

OnError = Literal["fail_closed", "fail_open"]
SideRoute = Literal[
    "models",
    "model",
    "tokenize",
    "detokenize",
    "responses.retrieve",
    "responses.input_items",
    "responses.delete",
    "responses.cancel",
    "files.create",
    "files.list",
    "files.retrieve",
    "files.content",
    "files.delete",
    "batches.create",
    "batches.list",
    "batches.retrieve",
    "batches.cancel",
    "responses.create",
]


@dataclass(frozen=True, slots=True)
class SideCall:
    """A request to a route that runs no inference (see ``on_side_request``)."""

    route: SideRoute
    headers: dict[str, str]
    model: str | None = None  # the model's config name, when it exists and this caller may see it
    body: dict[str, Any] = field(default_factory=dict)  # tokenize / detokenize: the parsed body
    raw_body: bytes = b""  # ... and as it came


class EmptyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: The hooks of the contract that are coroutine functions.
ASYNC_HOOKS = ("start", "on_request", "on_response", "on_chunk", "on_models", "on_side_request", "on_admin", "aclose")
#: The hooks of the contract that the core calls without awaiting.
PLAIN_HOOKS = ("prepare", "model_moves", "went_live")


class Plugin:
    """Base class of every plugin; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = EmptyConfig
    default_on_error: ClassVar[OnError] = "fail_closed"
    default_timeout_ms: ClassVar[float | None] = None
    reads_stream_text: ClassVar[bool] = True
    replaces_answers: ClassVar[bool] = False
    keeps_answers: ClassVar[bool] = False
    identifies_callers: ClassVar[bool] = False

    def __init__(self, config: Any, services: Services) -> None:
        self.config = config
        self.services = services

    def prepare(self, config: GatewayConfig) -> None:
        return None

    async def start(self) -> None:
        return None

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        return None

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        return None

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        return chunk

    async def on_models(self, headers: dict[str, str], models: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return models

    def model_moves(self) -> Mapping[str, Collection[str]]:
        return {}

    async def on_side_request(self, call: SideCall) -> None:
        return None

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        raise NotFound(f"The '{self.name}' plugin has no admin action '{action}'.", param="action")

    def went_live(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    @classmethod
    def overrides(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(Plugin, hook)

    @classmethod
    def plain_hooks(cls) -> list[str]:
        """The contract's ``async`` hooks that this class overrides with a plain function (a config
        naming such a plugin is refused)."""
        return [h for h in ASYNC_HOOKS if cls.overrides(h) and not inspect.iscoroutinefunction(getattr(cls, h))]

    @classmethod
    def async_hooks(cls) -> list[str]:
        """The contract's plain hooks that this class overrides with an ``async def`` (a config naming
        such a plugin is refused: the core would never await what it returns)."""
        return [
            h
            for h in PLAIN_HOOKS
            if cls.overrides(h)
            and (inspect.iscoroutinefunction(getattr(cls, h)) or inspect.isasyncgenfunction(getattr(cls, h)))
        ]
