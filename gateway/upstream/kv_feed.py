"""Following each worker's KV cache events into the block index (``kv_index``): the state of each
worker's stream and how each batch changes the index.

Contract: ``KvFeed`` follows exactly the workers routing names (``follow``, ``retarget``), each by a
background task of its ``KvSubscriber`` (``kv_subscriber``: the ZMQ transport, which hands it each batch
through ``receive`` and replays what it asks through ``catch_up``), and answers routing (``trusted``,
``expect``, ``record_hit``, ``drop``) from what was applied. What real streams do, and the answer:

- A gap in sequence numbers (the subscriber fell behind its high-water mark, a reconnect, a message it
  could not take in): the missing batches are asked from the worker's replay socket; when it no longer has
  them the worker is resynchronised (its entries dropped, then rebuilt from what comes).
- A sequence number at or below the last one: the worker restarted (numbers start again at 0 per
  process) and its cache is empty: its entries are dropped. A failed health check drops them too
  (a restart says nothing until the new process publishes).
- ``AllBlocksCleared`` (or a batch the subscriber did not decode, handed on as one): its entries are
  dropped.
- A worker that stops publishing: routing says when it sent a worker a request that must store new
  blocks (``expect``); when no event follows within ``expire_s`` the worker's entries expire and
  ``trusted`` says no until events come again (routing then falls back to approximate affinity).
- A subscriber that fails: the worker is untrusted and its entries dropped until it is following again.
- What a batch stores or evicts is applied in chunks, the event loop free between them (a batch may hold
  up to ``FeedSettings.max_batch_elements`` hashes).

State lives in the worker table (``WorkerTable.kv``) so it survives config reloads; routing says which
workers to follow and how (``retarget``) once its config is live, never for a config still being built.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gateway.ops.tasks import cancel_and_wait
from gateway.upstream.kv_index import BlockIndex
from gateway.upstream.kv_source import FeedSettings, KvSource
from gateway.upstream.kv_subscriber import Fetch, KvSubscriber
from gateway.upstream.kv_wire import Batch, Cleared, Removed, Stored

log = logging.getLogger("gateway.kv_events")

_DUPLICATE_WINDOW_S = 5.0  # batches re-read from the live socket right after a replay are duplicates
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
        """``clock`` dates events, silences and connections; ``sleep`` is how its subscriber waits
        between connections (both given by tests)."""
        self.settings = settings or FeedSettings()
        self.index = BlockIndex(self.settings.max_entries)
        self.workers: dict[str, WorkerKv] = {}
        self._clock = clock
        self._subscriber = KvSubscriber(self, clock, sleep)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled by ``retarget``, maybe still unwinding

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
        self._subscriber.fetch = fetch
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
            self._tasks[url] = asyncio.create_task(self._subscriber.run(url, given), name=f"kv-events {url}")
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
        self._subscriber.close()

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
            await self.catch_up(url, state.last_seq + 1, batch.seq)
            if batch.seq <= state.last_seq:
                return
        await self.apply(url, batch)

    async def catch_up(self, url: str, start: int, upto: int | None) -> None:
        """Apply the buffered batches from ``start`` (up to ``upto``, exclusive, when given) as they
        arrive, from the subscriber's replay; resync when the worker no longer holds ``start``, or the
        replay failed. From 0 without ``upto``: what the worker buffered before it was followed."""
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

        answered = await self._subscriber.replay(state, start, take)
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
