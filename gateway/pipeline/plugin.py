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
  the config that asked for it; the running config stays live.
- ``async on_request(ctx)``: runs in list order before the upstream call. Return None to go on, return
  a ``ModelResponse`` to answer early (later hooks and the upstream are skipped), or raise a
  ``GatewayError`` to refuse (a refusal is a decision, rendered as an OpenAI error; no upstream call).
- ``async on_response(ctx, response)``: runs in reverse order, only for plugins whose ``on_request``
  ran and did not itself answer early. Return None to keep the response or a replacement
  ``ModelResponse``; raise a ``GatewayError`` to turn it into an error. For a stream it runs once,
  after the last chunk, with the assembled response: it may raise (the stream then ends with one error
  event instead of ``[DONE]``) but not replace what was already sent.
- ``async on_chunk(ctx, chunk)``: streams only, reverse order; return the chunk, a changed chunk, or
  None to hold it back. When no enabled plugin overrides ``on_chunk`` or ``on_response``, the worker's
  SSE bytes pass through untouched, with no per-chunk parsing.
- ``ctx.step_aside(self)``: an ``on_request`` that needs neither ``on_chunk`` nor ``on_response`` for
  this request (the cache bypassing it, no output rules, no constraint to check) says so; those hooks
  are then skipped for it, and a stream that no remaining plugin watches passes through as bytes.
  A chunk hook that must end the stream early (e.g. an output check that fired) returns the last chunk
  it wants sent and sets ``ctx.state["close_stream"] = True``: the core stops reading the worker
  (closing the connection makes vLLM abort the generation) and ends the stream with ``[DONE]``.
- ``ctx.add_finalizer(callback)`` runs ``callback`` once when the request is over, whatever the outcome;
  there ``ctx.delivered`` (``Delivered``, set by the core) says what the client was given: an answer
  and its status, or for a stream, however it ended (``[DONE]``, the client gone, the worker cut it),
  how many completion tokens went out and whether it completed (None: nothing was delivered, e.g. a
  refusal or an upstream failure). That is the hook to bill by (tenancy).
- ``ctx.model_allowed`` (set by an access-control plugin) and ``ctx.allows_model(name)``: a plugin that
  moves the request to another model (canary, fallback) asks first. ``ctx.priority`` (set from tenant
  config) orders admission queues.
- ``async on_models(headers, models)``: optional; sees the model cards ``GET /v1/models`` (and
  ``/v1/models/{id}``) is about to list, in list order, with the request's lower-cased headers, and
  returns the cards this caller may see (e.g. tenancy: only the models a key may use), or raises a
  ``GatewayError`` (e.g. 401 without a key).
- Routes that reach no worker through the pipeline (stored Responses reads, ...) call no hook; the plugin
  that knows the caller registers callables in ``services.shared`` instead (``gateway.pipeline.services``):
  ``TENANT_OF`` (who is calling, for what the core keeps per tenant) and ``METER_SIDE_ROUTE``
  (``async (headers, route) -> tenant``: the same, after counting one request against the caller's request
  limits; raises 401/429). Registered in ``start()``, removed in ``aclose()``.
- ``async on_admin(action, body)``: optional operator actions served at
  ``POST /admin/plugins/{name}/{action}`` (e.g. the cache's ``purge``); returns a JSON-able dict or
  raises a ``GatewayError``. Only the live snapshot's instance is called. Never loads code or files
  named in ``body``.
- ``async aclose()``: the runtime owning the instance was retired (reload, shutdown) and its in-flight
  requests drained.
- ``default_on_error``: ``fail_closed`` (a hook failure answers 503) or ``fail_open`` (the failure is
  logged and counted, and the request goes on as if the hook returned None); config may override it
  per plugin with ``on_error``. ``default_timeout_ms``: the time budget of each hook call (config:
  ``timeout_ms``); running over it counts as a failure under the same policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.wire.errors import NotFound

if TYPE_CHECKING:
    from gateway.pipeline.config import GatewayConfig
    from gateway.pipeline.services import Services

OnError = Literal["fail_closed", "fail_open"]


class EmptyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Plugin:
    """Base class of every plugin; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = EmptyConfig
    default_on_error: ClassVar[OnError] = "fail_closed"
    default_timeout_ms: ClassVar[float | None] = None

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

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        raise NotFound(f"The '{self.name}' plugin has no admin action '{action}'.", param="action")

    async def aclose(self) -> None:
        return None

    @classmethod
    def overrides(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(Plugin, hook)
