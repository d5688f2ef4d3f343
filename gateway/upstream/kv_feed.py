"""Following each worker's KV cache events into the block index (``kv_index``), in the background.

One task per followed worker: find its publisher (given in config, or the worker's own
``GET /kv_event_sources``), subscribe (ZMQ SUB, ``zmq.asyncio``: nothing blocks the event loop), first
replay what the worker still buffers, then apply each batch. What real streams do, and the answer:

- A gap in sequence numbers (the subscriber fell behind its high-water mark, a reconnect): the missing
  batches are asked from the worker's replay socket; when it no longer has them the worker is
  resynchronised (its entries dropped, then rebuilt from what comes).
- A sequence number at or below the last one: the worker restarted (numbers start again at 0 per
  process) and its cache is empty: its entries are dropped. A failed health check drops them too
  (a restart says nothing until the new process publishes).
- ``AllBlocksCleared``: its entries are dropped.
- A worker that stops publishing: routing says when it sent a worker a request that must store new
  blocks (``expect``); when no event follows within ``expire_s`` the worker's entries expire and
  ``trusted`` says no until events come again (routing then falls back to approximate affinity).
- A message that is not a well-formed batch is skipped (the gap it leaves is a gap like any other); a
  subscriber that fails anyway is logged and started again, the worker untrusted and its entries
  dropped meanwhile.
- A batch whose payload is larger than ``max_message_bytes`` is never decoded (that would hold the
  event loop for seconds): it is taken as a clear of the worker's entries in its place in the sequence
  (what it stored or evicted is unknown), and the worker is followed on from the next batch, on the same
  connection.
- A batch that would decode to more elements than ``FeedSettings.max_batch_elements`` (block hashes and
  token ids; msgpack takes a small int in one byte, so a batch under ``max_message_bytes`` may still hold
  16M of them) is taken the same way, counted from the lists' headers before any is built. What a batch
  within the bounds stores or evicts is applied in chunks, the event loop free between them.
- A message with a frame over ``FeedSettings.max_frame_bytes`` (four times ``max_message_bytes``) is never
  taken in: ZMQ itself (``zmq.MAXMSGSIZE`` on both sockets) drops the connection on reading the frame's
  size, so a publisher cannot make the gateway allocate what it likes. ZMQ takes that for a protocol
  error and never connects again by itself (libzmq 4.3), so the feed watches its connection and makes a
  new one when it is dropped, after a wait that doubles (0.1 s to 5 s) while drops repeat. The batch is
  then a gap: its replay is refused the same way, so the worker is resynchronised (its entries dropped, as
  for a batch not decoded) and followed on from the next batch.

State lives in the worker table (``WorkerTable.kv``) so it survives config reloads; routing says which
workers to follow and how (``retarget``) once its config is live, never for a config still being built.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import orjson
import zmq
import zmq.asyncio

from gateway.ops.tasks import cancel_and_wait, stop_if_cancelled
from gateway.upstream.kv_index import BlockIndex
from gateway.upstream.kv_source import FeedSettings, KvSource, source_from_discovery
from gateway.upstream.kv_wire import (
    Batch,
    Cleared,
    Removed,
    Stored,
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
_DUPLICATE_WINDOW_S = 5.0  # batches re-read from the live socket right after a replay are duplicates
_RECONNECT_S = 0.1  # the first wait after a drop, as ZMQ's own reconnect interval: few batches lost to a gap
# The longest wait, doubled up to from _RECONNECT_S while connections keep being dropped: a publisher (or
# anything on its port) that drops each one costs a socket and a log line every 5 s, not ten a second, and
# a worker back from a restart is followed again within 5 s. A connection that held this long resets it.
_RECONNECT_CAP_S = 5.0
# Hashes stored or removed (an event counts one) between two yields to the event loop while a batch is
# applied: a few ms of work, so that the largest batch allowed (``FeedSettings.max_batch_elements``) lets
# requests through while it is applied instead of holding them for a second.
_APPLY_CHUNK = 8192
_HIT_ALPHA = 0.1  # the hit rate's moving average weighs about the last 20 responses
#: The blocks of a worker's first stored chain kept (``WorkerKv.first_stored``) for routing's check of its
#: own hashes: a few agree or disagree as surely as all, and their tokens are all that is kept.
FIRST_STORED_BLOCKS = 4


@dataclass(slots=True)
class WorkerKv:
    """What the feed knows of one worker's event stream (read by routing and the admin views)."""

    url: str
    source: KvSource | None = None
    last_seq: int = -1
    last_event_at: float = 0.0
    block_size: int | None = None  # from BlockStored events (with blocks): what routing must hash with
    expect_since: float | None = None  # the oldest routed request that should have stored blocks since
    silent: bool = False
    restarts: int = 0
    gaps: int = 0
    resyncs: int = 0
    batches: int = 0  # applied, live or replayed
    removals: int = 0  # blocks the worker evicted
    received: int = 0  # read from the live socket
    unread: int = 0  # batches over max_message_bytes or max_batch_elements, taken as clears without being decoded
    reconnects: int = 0  # live connections dropped (a frame over max_frame_bytes, the worker gone) and made again
    # The first BlockStored of a chain, cut to FIRST_STORED_BLOCKS blocks and their tokens: for routing's
    # check of its own hashes against the worker's.
    first_stored: Stored | None = None
    hit_rate: float | None = None  # recent share of prompt tokens the worker reported cached (moving average)
    _dup_window: tuple[int, int, float] | None = field(default=None, repr=False)


class KvFeed:
    """Every followed worker's event stream, applied to one bounded ``BlockIndex``."""

    def __init__(
        self,
        settings: FeedSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``clock`` dates events, silences and connections; ``sleep`` is how the feed waits between
        connections (both given by tests)."""
        self.settings = settings or FeedSettings()
        self.index = BlockIndex(self.settings.max_entries)
        self.workers: dict[str, WorkerKv] = {}
        self._clock = clock
        self._sleep = sleep
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled by ``retarget``, maybe still unwinding
        self._ctx: zmq.asyncio.Context | None = None
        self._fetch: Fetch | None = None

    # -- what routing asks ------------------------------------------------------------------------

    def trusted(self, url: str) -> bool:
        """Whether ``url``'s entries may be used: its stream is followed, and it has not gone silent
        after requests that must have stored blocks (expiring its entries when that just happened)."""
        state = self.workers.get(url)
        if state is None or state.source is None:
            return False
        since = state.expect_since
        if since is not None and not state.silent and self._clock() - since > self.settings.expire_s:
            dropped = self.index.clear(url)
            state.silent = True
            log.warning("worker %s published no KV events for %.0fs after requests: %d entries expired",
                        url, self.settings.expire_s, dropped)  # fmt: skip
        return not state.silent

    def expect(self, url: str) -> None:
        """Routing sent ``url`` a request that stores new blocks: an event should follow."""
        state = self.workers.get(url)
        if state is not None and state.expect_since is None:
            state.expect_since = self._clock()

    def record_hit(self, url: str, cached_tokens: int, prompt_tokens: int) -> None:
        """A response from ``url`` reported ``cached_tokens`` of ``prompt_tokens`` from its prefix cache."""
        state = self.workers.get(url)
        if state is None or prompt_tokens <= 0:
            return
        share = min(cached_tokens / prompt_tokens, 1.0)
        state.hit_rate = share if state.hit_rate is None else state.hit_rate + _HIT_ALPHA * (share - state.hit_rate)

    def drop(self, url: str, why: str) -> None:
        """Forget ``url``'s entries and sequence (a failed health check: it may come back as a new process)."""
        state = self.workers.get(url)
        dropped = self.index.clear(url)
        if state is not None:  # a new process starts with nothing owed: no silence held against it
            state.last_seq = -1
            state._dup_window = None
            state.expect_since = None
            state.silent = False
        if dropped:
            log.info("worker %s: %d KV index entries dropped (%s)", url, dropped, why)

    # -- following --------------------------------------------------------------------------------

    async def follow(
        self, urls: Iterable[str], sources: Mapping[str, KvSource], fetch: Fetch, settings: FeedSettings
    ) -> None:
        """Follow exactly ``urls`` (a source from ``sources`` or discovered); stop following others, and
        wait until their subscribers are gone."""
        stopped = self.retarget(urls, sources, fetch, settings)
        for task in stopped:
            await cancel_and_wait(task)

    def retarget(
        self, urls: Iterable[str], sources: Mapping[str, KvSource], fetch: Fetch, settings: FeedSettings
    ) -> list[asyncio.Task[None]]:
        """``follow`` without waiting (for a config that has just gone live: no waiting there): the
        followed set is ``urls`` when this returns. Returns the subscribers it cancelled; ``aclose`` waits
        for any still unwinding."""
        self._fetch = fetch
        if settings.max_entries != self.settings.max_entries:
            self.index.max_entries = settings.max_entries
        self.settings = settings
        wanted = dict.fromkeys(urls)
        stopped: list[asyncio.Task[None]] = []
        for url in [u for u in self._tasks if u not in wanted]:
            stopped.append(self._stop(url))
            self.workers.pop(url, None)
        for url in wanted:
            given = sources.get(url)
            state = self.workers.get(url)
            if state is not None and url in self._tasks and (given is None or given == state.source):
                continue
            if url in self._tasks:
                stopped.append(self._stop(url))
            self.workers[url] = WorkerKv(url, source=None)
            self._tasks[url] = asyncio.create_task(self._run(url, given), name=f"kv-events {url}")
        return stopped

    def _stop(self, url: str) -> asyncio.Task[None]:
        """Cancel ``url``'s subscriber and drop its entries (a cancelled subscriber applies nothing more)."""
        task = self._tasks.pop(url)
        task.cancel()
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        self.index.clear(url)
        return task

    async def aclose(self) -> None:
        for task in [*self._tasks.values(), *self._stopping]:
            await cancel_and_wait(task)
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _run(self, url: str, given: KvSource | None) -> None:
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
            self.workers[url].source = None
            self.drop(url, "its KV event subscriber failed")
            await asyncio.sleep(self.settings.discover_interval_s)

    async def _subscribe(self, url: str, given: KvSource | None) -> None:
        source = given or await self._discover(url)
        state = self.workers[url]
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
                    source.endpoint, self.settings.max_frame_bytes, state.reconnects, wait)  # fmt: skip
            await self._sleep(wait)
            wait = min(wait * 2, _RECONNECT_CAP_S)

    async def _listen(self, url: str, source: KvSource, first: bool) -> None:
        """Apply the live batches of one connection to ``source`` until it is dropped (then return). On
        the ``first``, what the worker buffered from before comes first; after a drop, the batches lost
        meanwhile are a gap like any other, found by the next batch."""
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
                await self._catch_up(url, 0, None)  # what the worker still buffers from before we came
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
                await self.receive(url, batch)
        finally:
            if dropped is not None:
                sub.disable_monitor()
                dropped.close(linger=0)
            sub.close(linger=0)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        """A socket of the feed's context that takes in no frame over ``max_frame_bytes``."""
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_frame_bytes)
        return sock

    async def _discover(self, url: str) -> KvSource:
        """Ask the worker where it publishes until it says (it may still be starting)."""
        assert self._fetch is not None
        while True:
            try:
                status, body = await self._fetch(url + "/kv_event_sources", 2.0)
                if status == 200:
                    found = source_from_discovery(url, orjson.loads(body))
                    if found is not None:
                        return found
                    log.warning("worker %s publishes no KV events the gateway can follow", url)
            except Exception as exc:  # not up yet, or not a vLLM worker: ask again later
                log.debug("kv_event_sources of %s: %s", url, exc)
                stop_if_cancelled()  # a fetch cancelled mid-request may raise its own error instead
            await asyncio.sleep(self.settings.discover_interval_s)

    def _unread(self, url: str, frames: list[zmq.Frame]) -> Batch | None:
        """A live message (``[topic, seq, payload]``) or replay answer (``["", topic, seq, payload]``)
        whose payload is over ``max_message_bytes``, or would decode to more than ``max_batch_elements``,
        as a batch that clears the worker's entries (what it stored or evicted is unknown), without
        copying the payload or building its lists; None for any other."""
        if len(frames) < 3:
            return None
        settings, payload = self.settings, frames[-1]
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
        self.workers[url].unread += 1
        log.warning("worker %s sent a KV event batch %s, not decoded: its entries are dropped and rebuilt "
                    "from the batches after it", url, why)  # fmt: skip
        return Batch(seq, 0.0, [Cleared()])

    # -- applying ---------------------------------------------------------------------------------

    async def receive(self, url: str, batch: Batch) -> None:
        """One live batch, in the order the socket gave it: restarts, duplicates and gaps first."""
        state = self.workers[url]
        state.received += 1
        window = state._dup_window
        if window is not None:
            lo, hi, until = window
            if self._clock() > until or batch.seq > hi:
                state._dup_window = None
            elif lo <= batch.seq <= hi:
                return  # already applied from the replay
        if state.last_seq >= 0 and batch.seq <= state.last_seq:
            state.restarts += 1
            self.index.clear(url)
            log.info("worker %s restarted (KV event sequence %d after %d): its entries dropped",
                     url, batch.seq, state.last_seq)  # fmt: skip
        elif state.last_seq >= 0 and batch.seq > state.last_seq + 1:
            state.gaps += 1
            await self._catch_up(url, state.last_seq + 1, batch.seq)
            if batch.seq <= state.last_seq:
                return
        await self.apply(url, batch)

    async def _catch_up(self, url: str, start: int, upto: int | None) -> None:
        """Apply the buffered batches from ``start`` (up to ``upto``, exclusive, when given) as they
        arrive; resync when the worker no longer holds ``start``, or the replay failed."""
        state = self.workers[url]
        first: int | None = None
        last: int | None = None

        async def take(batch: Batch) -> None:
            nonlocal first, last
            if first is None:
                first = batch.seq
                if upto is not None and batch.seq != start:
                    self._resync(url, "the gap is older than the worker's replay buffer")
            last = batch.seq
            if batch.seq > state.last_seq or state.last_seq < 0:
                await self.apply(url, batch)

        answered = await self._replay(state, start, take)
        if upto is not None and not answered:
            self._resync(url, "no replay socket answered, or its answer failed")
        elif upto is not None and first is None:
            self._resync(url, "the gap is older than the worker's replay buffer")
        if last is not None:
            state._dup_window = (start, last, self._clock() + _DUPLICATE_WINDOW_S)

    def _resync(self, url: str, why: str) -> None:
        self.workers[url].resyncs += 1
        dropped = self.index.clear(url)
        log.warning("worker %s: KV events lost (%s); resynchronising (%d entries dropped)", url, why, dropped)

    async def _replay(self, state: WorkerKv, start: int, take: Callable[[Batch], Awaitable[None]]) -> bool:
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
        deadline = loop.time() + self.settings.replay_timeout_s
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

    async def apply(self, url: str, batch: Batch) -> None:
        """Apply one batch in sequence (no ordering checks: ``receive`` made them), yielding to the event
        loop every ``_APPLY_CHUNK`` hashes. When the worker's entries are dropped meanwhile (``drop``), the
        rest of the batch is not applied: it belongs to the process whose entries went."""
        state = self.workers[url]
        state.last_seq = batch.seq
        state.last_event_at = self._clock()
        state.batches += 1
        state.expect_since = None
        if state.silent:
            state.silent = False
            log.info("worker %s publishes KV events again", url)
        index = self.index
        done = 0  # hashes (an event counts one more) applied since the last yield
        for event in batch.events:
            if isinstance(event, Cleared):
                index.clear(url)
                done += 1
                continue
            # adapters' blocks never serve a base-model prompt: not stored
            hashes = event.hashes if isinstance(event, Removed) or event.lora_name is None else []
            step = index.remove if isinstance(event, Removed) else index.store
            for lo in range(0, max(len(hashes), 1), _APPLY_CHUNK):
                if done >= _APPLY_CHUNK:
                    await asyncio.sleep(0)
                    done = 0
                    if self.workers.get(url) is not state or state.last_seq != batch.seq:
                        return  # dropped meanwhile (``drop``, ``follow``): the rest is the old process's
                chunk = hashes if len(hashes) <= _APPLY_CHUNK else hashes[lo : lo + _APPLY_CHUNK]
                step(url, chunk)
                done += len(chunk) + 1
            if isinstance(event, Removed):
                state.removals += len(event.hashes)
                continue
            # An event that stores no block, or carries more tokens than its blocks hold, is not vLLM's:
            # its block size (1, say) would set routing hashing by a size no worker uses.
            if not event.hashes or not event.block_size or len(event.token_ids) > len(event.hashes) * event.block_size:
                continue
            if state.first_stored is None and event.parent is None:
                kept = FIRST_STORED_BLOCKS
                state.first_stored = replace(
                    event, hashes=event.hashes[:kept], token_ids=event.token_ids[: kept * event.block_size]
                )
            state.block_size = event.block_size
