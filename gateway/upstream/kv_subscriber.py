"""Reading each followed worker's KV cache events off the wire, for the feed (``kv_feed``).

Contract: ``KvSubscriber.run(url, given)`` is the body of one worker's background task. It finds the
worker's publisher (``given`` in config, or the worker's own ``GET /kv_event_sources``), subscribes (ZMQ
SUB, ``zmq.asyncio``: nothing blocks the event loop), asks the feed to catch up on what the worker still
buffers, then hands the feed (its ``Sink``) each live batch, decoded, in the order the socket gave it.
``replay`` reads the worker's replay socket for the feed, handing on each batch as it arrives. Sequence
numbers, gaps, restarts and the index are the feed's: the subscriber only keeps the worker's ``source``
and counts its ``reconnects`` and ``unread`` batches. What the wire does, and the answer:

- A message that is not a well-formed batch is skipped (the gap it leaves is the feed's to find); a
  subscriber that fails anyway is logged and started again, its ``source`` unset and the worker's entries
  dropped (``Sink.drop``) meanwhile.
- A batch whose payload is larger than ``max_message_bytes`` is never decoded (that would hold the event
  loop for seconds): it is handed on as a clear of the worker's entries in its place in the sequence (what
  it stored or evicted is unknown), and the worker is followed on from the next batch, on the same
  connection.
- A batch that would decode to more elements than ``FeedSettings.max_batch_elements`` (block hashes and
  token ids; msgpack takes a small int in one byte, so a batch under ``max_message_bytes`` may still hold
  16M of them) is taken the same way, counted from the lists' headers before any is built.
- A message with a frame over ``FeedSettings.max_frame_bytes`` (four times ``max_message_bytes``) is never
  taken in: ZMQ itself (``zmq.MAXMSGSIZE`` on both sockets) drops the connection on reading the frame's
  size, so a publisher cannot make the gateway allocate what it likes. ZMQ takes that for a protocol
  error and never connects again by itself (libzmq 4.3), so the subscriber watches its connection and
  makes a new one when it is dropped, after a wait that doubles (0.1 s to 5 s) while drops repeat. The
  batch is then a gap for the feed: its replay is refused the same way.

One ``KvSubscriber`` serves every worker of a feed: it holds their ZMQ context (``close`` ends it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import orjson
import zmq
import zmq.asyncio

from gateway.ops.tasks import stop_if_cancelled
from gateway.upstream.kv_source import FeedSettings, KvSource, source_from_discovery
from gateway.upstream.kv_wire import (
    Batch,
    Cleared,
    TooManyElements,
    WireError,
    count_elements,
    decode_message,
    decode_replay,
    decode_seq,
)
from gateway.upstream.kv_wire import replay_request as encode_replay_request

log = logging.getLogger("gateway.kv_events")

#: ``async (url, timeout_s) -> (status, body)``: a bounded GET (the upstream client's).
Fetch = Callable[[str, float], Awaitable[tuple[int, bytes]]]
#: ``async (batch) -> None``: what ``KvSubscriber.replay`` hands each replayed batch to.
Take = Callable[[Batch], Awaitable[None]]
_RECONNECT_S = 0.1  # the first wait after a drop, as ZMQ's own reconnect interval: few batches lost to a gap
# The longest wait, doubled up to from _RECONNECT_S while connections keep being dropped: a publisher (or
# anything on its port) that drops each one costs a socket and a log line every 5 s, not ten a second, and
# a worker back from a restart is followed again within 5 s. A connection that held this long resets it.
_RECONNECT_CAP_S = 5.0


class Stream(Protocol):
    """What the subscriber keeps of one worker's state (``kv_feed.WorkerKv``)."""

    url: str
    source: KvSource | None  # where it reads the worker's events; None while it is not subscribed
    reconnects: int  # live connections dropped and made again
    unread: int  # batches over max_message_bytes or max_batch_elements, handed on as clears


class Sink(Protocol):
    """Where the subscriber hands what it reads (``kv_feed.KvFeed``)."""

    @property
    def settings(self) -> FeedSettings: ...  # read at each use: the feed's settings change on reload

    @property
    def workers(self) -> Mapping[str, Stream]: ...

    async def receive(self, url: str, batch: Batch) -> None:
        """One live batch of ``url``'s, in the order the socket gave it."""

    async def catch_up(self, url: str, start: int, upto: int | None) -> None:
        """Apply ``url``'s buffered batches from ``start`` (through ``KvSubscriber.replay``)."""

    def drop(self, url: str, why: str) -> None:
        """Forget ``url``'s entries and sequence."""


class KvSubscriber:
    """The ZMQ side of a feed: one ``run`` task per followed worker, and the replays the feed asks for."""

    def __init__(
        self,
        sink: Sink,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        """``clock`` dates connections (did one hold?); ``sleep`` is how the subscriber waits between
        connections; ``fetch`` (set by the feed before any ``run``) asks a worker where it publishes."""
        self._sink = sink
        self._clock = clock
        self._sleep = sleep
        self._ctx: zmq.asyncio.Context | None = None
        self.fetch: Fetch | None = None

    def close(self) -> None:
        """End the ZMQ context and every socket left in it (once no ``run`` task is left)."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def run(self, url: str, given: KvSource | None) -> None:
        """Follow ``url`` for as long as it is wanted. A subscriber that fails (a bug, a message no one
        foresaw) is logged and started again, from discovery and the replay buffer; until then its
        entries are dropped and ``trusted`` says no, so routing falls back instead of going by an index
        that no longer follows the worker."""
        while True:
            try:
                await self._subscribe(url, given)
            except Exception:
                stop_if_cancelled()
                log.exception("following the KV events of %s failed; following it again", url)
            self._sink.workers[url].source = None
            self._sink.drop(url, "its KV event subscriber failed")
            await asyncio.sleep(self._sink.settings.discover_interval_s)

    async def _subscribe(self, url: str, given: KvSource | None) -> None:
        source = given or await self._discover(url)
        state = self._sink.workers[url]
        state.source = source
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        log.info("following KV events of %s at %s", url, source.endpoint)
        wait, first = _RECONNECT_S, True
        while True:  # ZMQ never makes again a connection it dropped for a frame over the bound: make it here
            opened = self._clock()
            await self._listen(url, source, first)
            first = False
            if self._clock() - opened >= _RECONNECT_CAP_S:
                wait = _RECONNECT_S  # it held: this drop is news, not one more of a run
            state.reconnects += 1
            # The first drop of a run, then one at most every _RECONNECT_CAP_S (each such wait is the cap).
            level = logging.WARNING if wait in (_RECONNECT_S, _RECONNECT_CAP_S) else logging.DEBUG
            log.log(level, "the KV event connection to %s was dropped (a frame over %d bytes, or the worker "
                    "went away; %d drops so far); connecting again in %.1fs",
                    source.endpoint, self._sink.settings.max_frame_bytes, state.reconnects, wait)  # fmt: skip
            await self._sleep(wait)
            wait = min(wait * 2, _RECONNECT_CAP_S)

    async def _listen(self, url: str, source: KvSource, first: bool) -> None:
        """Hand the feed the live batches of one connection to ``source`` until it is dropped (then
        return). On the ``first``, what the worker buffered from before comes first; after a drop, the
        batches lost meanwhile are a gap like any other, found by the next batch."""
        sub = self._socket(zmq.SUB)
        dropped: zmq.asyncio.Socket | None = None
        try:  # from here: a socket or monitor that fails to set up is closed too, not left open per attempt
            sub.setsockopt(zmq.RCVHWM, 100_000)
            dropped = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(dropped, zmq.POLLIN)
            sub.connect(source.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            if first:
                await self._sink.catch_up(url, 0, None)  # what the worker still buffers from before we came
            while True:
                ready = dict(await poller.poll())
                if sub not in ready:
                    return  # dropped, and all it queued read: what was lost with it is a gap for the next batch
                frames = await sub.recv_multipart(copy=False)
                try:
                    batch = self._unread(url, frames) or decode_message([frame.bytes for frame in frames])
                except WireError as exc:
                    log.warning("worker %s sent a KV event message that is not one (%s)", url, exc)
                    continue
                await self._sink.receive(url, batch)
        finally:
            if dropped is not None:
                sub.disable_monitor()
                dropped.close(linger=0)
            sub.close(linger=0)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        """A socket of the subscriber's context that takes in no frame over ``max_frame_bytes``."""
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._sink.settings.max_frame_bytes)
        return sock

    async def _discover(self, url: str) -> KvSource:
        """Ask the worker where it publishes until it says (it may still be starting)."""
        assert self.fetch is not None
        while True:
            try:
                status, body = await self.fetch(url + "/kv_event_sources", 2.0)
                if status == 200:
                    found = source_from_discovery(url, orjson.loads(body))
                    if found is not None:
                        return found
                    log.warning("worker %s publishes no KV events the gateway can follow", url)
            except Exception as exc:  # not up yet, or not a vLLM worker: ask again later
                log.debug("kv_event_sources of %s: %s", url, exc)
                stop_if_cancelled()  # a fetch cancelled mid-request may raise its own error instead
            await asyncio.sleep(self._sink.settings.discover_interval_s)

    def _unread(self, url: str, frames: list[zmq.Frame]) -> Batch | None:
        """A live message (``[topic, seq, payload]``) or replay answer (``["", topic, seq, payload]``)
        whose payload is over ``max_message_bytes``, or would decode to more than ``max_batch_elements``,
        as a batch that clears the worker's entries (what it stored or evicted is unknown), without
        copying the payload or building its lists; None for any other."""
        if len(frames) < 3:
            return None
        settings, payload = self._sink.settings, frames[-1]
        if len(payload) > settings.max_message_bytes:
            why = f"of {len(payload)} bytes (over {settings.max_message_bytes})"
        else:
            try:
                count_elements(payload.buffer, settings.max_batch_elements)
            except TooManyElements:
                why = f"of more than {settings.max_batch_elements} elements"
            else:
                return None
        seq = decode_seq(frames[-2].bytes)
        self._sink.workers[url].unread += 1
        log.warning("worker %s sent a KV event batch %s, not decoded: its entries are dropped and rebuilt "
                    "from the batches after it", url, why)  # fmt: skip
        return Batch(seq, 0.0, [Cleared()])

    async def replay(self, state: Stream, start: int, take: Take) -> bool:
        """Ask the worker for its buffered batches from ``start`` and hand each to ``take`` as it arrives:
        none is held until the end (a worker's buffer holds thousands, each up to ``max_message_bytes``).
        True when the end marker came; False when no replay socket answered, or the answer failed partway
        (what ``take`` was given by then stands). ``replay_timeout_s`` bounds the worker's time, not the
        time ``take`` spent applying."""
        source = state.source
        if source is None or source.replay_endpoint is None or self._ctx is None:
            return False
        dealer = self._socket(zmq.DEALER)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._sink.settings.replay_timeout_s
        try:
            dealer.connect(source.replay_endpoint)
            await dealer.send_multipart(encode_replay_request(start))
            while True:
                async with asyncio.timeout_at(deadline):
                    frames = await dealer.recv_multipart(copy=False)
                batch = self._unread(state.url, frames) or decode_replay([frame.bytes for frame in frames])
                if batch is None:
                    return True
                began = loop.time()
                await take(batch)
                deadline += loop.time() - began
        except (TimeoutError, WireError, zmq.ZMQError) as exc:
            log.warning("replay from %s failed (%s)", source.replay_endpoint, exc or type(exc).__name__)
            return False
        finally:
            dealer.close(linger=0)
