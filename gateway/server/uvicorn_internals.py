"""What the front door (``gateway.server.front_door``) uses of uvicorn beyond its public API, and the check
that an installed uvicorn still has all of it.

The front door subclasses uvicorn's httptools protocol and reaches into the request cycle. uvicorn is
pinned to a minor range in pyproject.toml for that; ``missing_internals`` (checked by
tests/server/test_front_door_internals.py, and when the protocol is made: the server refuses to start)
names any internal a new uvicorn lost, so an upgrade fails loudly instead of misbehaving.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

#: The protocol's methods and attributes, and the request cycle's attributes, that the front door uses.
PROTOCOL_INTERNALS = (
    "_unset_keepalive_if_required",
    "_should_upgrade",
    "_start_asgi_task",
    "_unsupported_upgrade_warning",
    "handle_websocket_upgrade",
    "on_body",
    "on_header",
    "on_headers_complete",
    "on_message_begin",
    "on_message_complete",
    "pause_writing",
    "resume_writing",
    "send_400_response",
)
INSTANCE_INTERNALS = ("flow", "cycle", "pipeline", "connections", "parser", "url", "headers", "logger", "loop")
CYCLE_INTERNALS = ("on_response", "response_complete", "response_started", "disconnected", "message_event", "more_body")


def missing_internals() -> list[str]:
    """The uvicorn internals the front door relies on that this uvicorn does not have (empty: all there)."""
    missing = [f"HttpToolsProtocol.{name}" for name in PROTOCOL_INTERNALS if not hasattr(HttpToolsProtocol, name)]
    # Instance attributes are set in the methods: the names every method of the class uses.
    used = {n for f in vars(HttpToolsProtocol).values() if hasattr(f, "__code__") for n in f.__code__.co_names}
    missing += [f"HttpToolsProtocol().{name}" for name in INSTANCE_INTERNALS if name not in used]
    # The front door bounds a chunked body's trailers through the list on_header appends them to.
    on_header = getattr(HttpToolsProtocol, "on_header", None)
    if on_header is not None and not {"headers", "append"} <= set(on_header.__code__.co_names):
        missing.append("HttpToolsProtocol.on_header appending to self.headers")
    cycle = RequestResponseCycle.__init__.__code__.co_names
    missing += [f"RequestResponseCycle().{name}" for name in CYCLE_INTERNALS if name not in cycle]
    return missing
