"""Where a worker publishes its KV cache events, and how much of them the feed (``kv_feed``) takes in: the
publisher's address (given in config or discovered from the worker's ``GET /kv_event_sources``) and the
feed's bounds. Plain values, read by routing's setup and by the feed."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.upstream.kv_wire import max_elements


@dataclass(frozen=True, slots=True)
class KvSource:
    """Where a worker publishes: its PUB endpoint (the gateway connects), replay endpoint and topic."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass(frozen=True, slots=True)
class FeedSettings:
    max_entries: int = 1_000_000
    expire_s: float = 60.0
    replay_timeout_s: float = 2.0
    discover_interval_s: float = 5.0
    #: The largest batch payload decoded. One engine step's batch stores the blocks of at most the tokens
    #: it scheduled, and evicts as many: about 5 bytes per token id, 9 per block hash and ~55 per one-hash
    #: ``BlockRemoved``, so ~9.5 bytes a token with 16-token blocks. 16 MiB holds a whole 1M-token prompt
    #: stored and evicted in one step; a larger payload is not decoded (25 MB took 2.3 s to decode).
    max_message_bytes: int = 16 << 20

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame ZMQ takes in at all (``zmq.MAXMSGSIZE``): four times ``max_message_bytes``
        (64 MiB by default), so a batch a few times over the limit still stands as a clear in its place on
        the same connection, while what one message can cost stays bounded (a bigger frame drops the
        connection before it is allocated)."""
        return 4 * self.max_message_bytes

    @property
    def max_batch_elements(self) -> int:
        """The most elements (block hashes, token ids; an event counts 32) a batch may decode to: one per 8
        bytes of ``max_message_bytes`` (a block hash takes 9 on the wire), 2.1M by default. msgpack takes
        a small int in one byte, so the byte bound alone would let one batch carry 16M of them, seconds of
        the event loop; a batch over it is taken as unread, as one over ``max_message_bytes`` is."""
        return max_elements(self.max_message_bytes)


def source_from_discovery(worker_url: str, body: object) -> KvSource | None:
    """The publisher of data-parallel rank 0 from a worker's ``/kv_event_sources`` answer, with a
    wildcard bind address (``tcp://*:5557``) turned into the worker's own host. None when events are
    off, or when the worker connects out to a fixed address (it then expects a router to bind)."""
    if not isinstance(body, dict):
        return None
    config = body.get("0", body.get(0))
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
        return None
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host

    def reachable(endpoint: object) -> str | None:
        if not isinstance(endpoint, str) or not endpoint:
            return None
        if endpoint.startswith(("ipc://", "inproc://")):
            return endpoint if endpoint.startswith("ipc://") else None
        scheme, _, rest = endpoint.partition("://")
        bind_host, _, port = rest.rpartition(":")
        if bind_host in ("*", "[::]", "::", "0.0.0.0"):
            return f"{scheme}://{host}:{port}"
        return endpoint if "*" in endpoint or "::" in endpoint else None

    endpoint = reachable(config.get("endpoint"))
    if endpoint is None:
        return None
    return KvSource(endpoint, reachable(config.get("replay_endpoint")), str(config.get("topic") or ""))
