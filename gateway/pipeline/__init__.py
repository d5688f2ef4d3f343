"""The plugin machinery. A plugin author reads ``plugin`` first: the contract, in its docstring.

- ``plugin``: the ``Plugin`` base class and the hook contract.
- ``context``: ``RequestContext`` (what a hook sees of a request) and ``ModelResponse``.
- ``chain``: the loop that runs hooks in order, with time budgets and ``on_error`` policies.
- ``registry`` and ``validate``: plugins found through entry points, their config sections checked.
- ``config`` and ``models``: the reloadable ``config.yaml`` models and the model table of one config.
- ``services``: process-wide clients (upstream pool, Redis, worker table, metrics) shared by snapshots.
- ``runtime`` and ``reload``: the immutable config snapshot, prepare-then-swap, and its triggers.
- ``schema``: the JSON Schema of ``config.yaml`` with every installed plugin's section, for editors.

May import upstream, wire, ops, infra and engine; never server or proxy (the context sees the running
snapshot only through the ``PinnedSnapshot`` protocol, so the types a plugin sees sit below the runtime).

What a plugin needs is exported here, so a third-party plugin imports only from ``gateway.pipeline``:
``Plugin``, ``RequestContext``, ``ModelResponse``, ``SideCall`` and the errors it may raise
(``GatewayError`` and its OpenAI-shaped subclasses live in ``gateway.wire.errors``).
"""

from gateway.pipeline.context import Delivered, ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin, SideCall

__all__ = ["Delivered", "ModelResponse", "Plugin", "RequestContext", "SideCall"]
