"""Following KV cache events over real ZMQ sockets into the index: stores and evictions, duplicate
copies, gaps replayed, gaps older than the buffer resynchronised, restarts, AllBlocksCleared, a worker
that goes silent, a worker that fails its health check, a feed cancelled in discovery, batches over the
decoding limit and over ZMQ's frame bound, and vLLM's own encoding of the events."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.upstream import kv_subscriber
from gateway.upstream.kv_feed import KvFeed
from gateway.upstream.kv_source import FeedSettings, KvSource, source_from_discovery
from gateway.upstream.kv_wire import (
    Batch,
    Cleared,
    Removed,
    Stored,
    WireError,
    decode_message,
    decode_payload,
    decode_replay,
    encode_batch,
)
from gateway.upstream.workers import WorkerTable
from tests.support.cancellation import CutAwait, stopped_when_cancelled
from tests.support.clock import Clock
from tests.support.kv_publisher import CLEARED, FakePublisher, removed, stored

URL = "http://127.0.0.1:9"


async def no_fetch(url: str, timeout_s: float) -> tuple[int, bytes]:
    raise AssertionError("a configured source needs no discovery")


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for the background task to get there; the bound is generous, never a timing check."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
async def publisher() -> AsyncIterator[FakePublisher]:
    pub = FakePublisher()
    yield pub
    await pub.aclose()


async def followed(
    pub: FakePublisher,
    clock: Callable[[], float] | None = None,
    context: zmq.asyncio.Context | None = None,
    **settings: float,
) -> KvFeed:
    """A feed following ``pub`` (with its sockets from ``context`` when given), with its live socket
    connected (a batch came through it)."""
    feed = KvFeed(clock=clock) if clock else KvFeed()
    feed._subscriber._ctx = context
    await feed.follow([URL], {URL: pub.source}, no_fetch, FeedSettings(**settings))  # type: ignore[arg-type]
    state = feed.workers[URL]
    while state.received == 0:
        await pub.publish([])
        await asyncio.sleep(0.02)
    return feed


async def test_stores_and_evictions_count_copies(publisher: FakePublisher) -> None:
    feed = await followed(publisher)
    try:
        await publisher.publish([stored([1, 2, 3]), stored([1])])  # block 1 twice: two physical copies
        await publisher.publish([removed([1]), removed([3])])
        await until(lambda: feed.workers[URL].last_seq == publisher.seq - 1, "both batches applied")
        assert feed.index.prefix_blocks(URL, [1, 2, 3]) == 2
        assert feed.workers[URL].block_size == 4
        assert feed.trusted(URL)
    finally:
        await feed.aclose()


async def test_what_the_worker_buffered_before_the_gateway_came_is_replayed(publisher: FakePublisher) -> None:
    await publisher.publish([stored([5, 6])], drop=True)  # published before anyone listened
    feed = await followed(publisher)
    try:
        assert feed.index.prefix_blocks(URL, [5, 6]) == 2
    finally:
        await feed.aclose()


async def test_a_gap_is_filled_from_the_replay_socket(publisher: FakePublisher) -> None:
    feed = await followed(publisher)
    try:
        await publisher.publish([stored([10, 11])], drop=True)  # lost on the live socket
        await publisher.publish([stored([12], parent=11)])
        await until(lambda: feed.workers[URL].last_seq == publisher.seq - 1, "the batch after the gap applied")
        state = feed.workers[URL]
        assert state.gaps == 1 and state.resyncs == 0
        assert feed.index.prefix_blocks(URL, [10, 11, 12]) == 3
    finally:
        await feed.aclose()


async def test_a_gap_older_than_the_replay_buffer_resynchronises(publisher: FakePublisher) -> None:
    feed = await followed(publisher)
    try:
        await publisher.publish([stored([20])])
        await until(lambda: feed.index.copies(URL, 20) == 1, "block 20 stored")
        await publisher.publish([removed([20]), stored([21])], drop=True)
        publisher.buffer.clear()  # the worker's buffer no longer has the lost batch
        await publisher.publish([stored([22])])
        await until(lambda: feed.workers[URL].resyncs == 1, "a resync")
        await until(lambda: feed.index.copies(URL, 22) == 1, "block 22 stored after the resync")
        assert feed.index.copies(URL, 20) == 0  # what may be stale was dropped, not kept
    finally:
        await feed.aclose()


async def test_a_restarted_worker_loses_its_entries(publisher: FakePublisher) -> None:
    feed = await followed(publisher)
    try:
        await publisher.publish([stored([30, 31])])
        await until(lambda: feed.index.blocks(URL) == 2, "blocks stored")
        publisher.restart()
        await publisher.publish([stored([40])])  # sequence 0 again
        await until(lambda: feed.workers[URL].restarts == 1, "the restart seen")
        assert feed.index.copies(URL, 30) == 0 and feed.index.copies(URL, 40) == 1
    finally:
        await feed.aclose()


async def test_all_blocks_cleared_drops_the_worker_entries(publisher: FakePublisher) -> None:
    feed = await followed(publisher)
    try:
        await publisher.publish([stored([50, 51])])
        await publisher.publish([CLEARED, stored([52])])
        await until(lambda: feed.workers[URL].last_seq == publisher.seq - 1, "applied")
        assert feed.index.blocks(URL) == 1 and feed.index.copies(URL, 52) == 1
    finally:
        await feed.aclose()


async def test_a_worker_that_stops_publishing_expires_and_comes_back(publisher: FakePublisher) -> None:
    clock = Clock()
    feed = await followed(publisher, clock, expire_s=30.0)
    try:
        await publisher.publish([stored([60])])
        await until(lambda: feed.index.copies(URL, 60) == 1, "stored")
        clock.now += 3600  # idle for an hour: silence without requests says nothing
        assert feed.trusted(URL)
        feed.expect(URL)  # a request that must store blocks went there
        clock.now += 31
        assert not feed.trusted(URL)
        assert feed.index.blocks(URL) == 0
        await publisher.publish([stored([61])])
        await until(lambda: feed.index.copies(URL, 61) == 1, "events again")
        assert feed.trusted(URL)
    finally:
        await feed.aclose()


async def test_a_failed_health_check_drops_the_worker_entries(publisher: FakePublisher) -> None:
    table = WorkerTable()
    worker = table.get(URL)
    await table.kv.follow([URL], {URL: publisher.source}, no_fetch, FeedSettings())
    try:
        while table.kv.workers[URL].received == 0:
            await publisher.publish([stored([70])])
            await asyncio.sleep(0.02)
        assert table.kv.index.copies(URL, 70) >= 1
        table.set_health(worker, False, "connection refused")
        assert table.kv.index.blocks(URL) == 0
        publisher.restart()  # the new process numbers from 0: not mistaken for an old one
        await publisher.publish([stored([71])])
        await until(lambda: table.kv.index.copies(URL, 71) == 1, "the new process's blocks")
        assert table.kv.workers[URL].restarts == 0
    finally:
        await table.aclose()


async def test_a_malformed_batch_is_skipped_and_the_subscriber_goes_on(publisher: FakePublisher) -> None:
    feed = await followed(publisher)
    try:
        await publisher.publish([stored([90])])
        await until(lambda: feed.index.copies(URL, 90) == 1, "stored")
        await publisher.publish([removed([90]), {"type": "BlockStored", "block_hashes": ["not a hash"]}])
        await publisher.publish([stored([91])])
        await until(lambda: feed.index.copies(URL, 91) == 1, "the batch after the malformed one applied")
        state = feed.workers[URL]
        # the skipped batch is a gap no replay can fill (it is malformed there too): resynchronised
        assert state.resyncs == 1 and feed.index.copies(URL, 90) == 0
        assert feed.trusted(URL)
    finally:
        await feed.aclose()


def _failing_once(feed: KvFeed) -> None:
    """The feed's next applied batch raises an error no one foresaw (then it applies as before)."""
    apply = feed.apply

    def failing(url: str, batch: Batch) -> None:
        feed.apply = apply  # type: ignore[method-assign]
        raise RuntimeError("a bug")

    feed.apply = failing  # type: ignore[method-assign]


async def test_a_failed_subscriber_drops_the_worker_entries_and_is_not_trusted(
    publisher: FakePublisher, caplog: pytest.LogCaptureFixture
) -> None:
    feed = await followed(publisher, discover_interval_s=3600)  # not followed again within the test
    try:
        await publisher.publish([stored([100])])
        await until(lambda: feed.index.copies(URL, 100) == 1, "stored")
        _failing_once(feed)
        await publisher.publish([stored([101])])
        await until(lambda: not feed.trusted(URL), "the worker untrusted")
        assert feed.index.blocks(URL) == 0
        assert "following the KV events of http://127.0.0.1:9 failed" in caplog.text
    finally:
        await feed.aclose()


async def test_a_failed_subscriber_is_started_again(publisher: FakePublisher) -> None:
    feed = await followed(publisher, discover_interval_s=0.01)
    try:
        await publisher.publish([stored([110])])
        await until(lambda: feed.index.copies(URL, 110) == 1, "stored")
        _failing_once(feed)
        await publisher.publish([stored([111])])
        # followed again: the worker's buffer is replayed, then live batches apply
        await until(lambda: feed.index.copies(URL, 111) == 1, "the batch that failed, replayed")
        await publisher.publish([stored([112])])
        await until(lambda: feed.index.copies(URL, 112) == 1, "live batches after the restart")
        assert feed.index.copies(URL, 110) == 1 and feed.trusted(URL)
    finally:
        await feed.aclose()


def _payloads_decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The payload sizes the feed hands its decoders (live and replay), from now on."""
    sizes: list[int] = []

    def live(frames: list[bytes]) -> Batch:
        sizes.append(len(frames[-1]))
        return decode_message(frames)

    def replayed(frames: list[bytes]) -> Batch | None:
        sizes.append(len(frames[-1]))
        return decode_replay(frames)

    monkeypatch.setattr(kv_subscriber, "decode_message", live)
    monkeypatch.setattr(kv_subscriber, "decode_replay", replayed)
    return sizes


BIG = [stored(list(range(1 << 40, (1 << 40) + 1000)))]  # ~9 kB of hashes


async def test_an_oversized_batch_is_not_decoded_and_clears_the_worker_entries_in_its_place(
    publisher: FakePublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = len(encode_batch(BIG, ts=1.0))  # the publisher's encoding: a payload of exactly the limit
    feed = await followed(publisher, max_message_bytes=limit)
    try:
        decoded = _payloads_decoded(monkeypatch)
        await publisher.publish(BIG)  # at the limit: decoded and applied
        await until(lambda: feed.index.copies(URL, 1 << 40) == 1, "the batch at the limit applied")
        await publisher.publish([stored([120])])
        await publisher.publish([stored([1, *BIG[0]["block_hashes"]])])  # one hash over the limit
        await publisher.publish([stored([121])])
        await until(lambda: feed.index.copies(URL, 121) == 1, "the batch after it applied")
        state = feed.workers[URL]
        assert max(decoded) == limit and len(decoded) == 3
        assert feed.index.copies(URL, 120) == 0 and feed.index.copies(URL, 1 << 40) == 0  # cleared in its place
        assert (state.unread, state.gaps, state.resyncs, state.last_seq) == (1, 0, 0, publisher.seq - 1)
        assert feed.trusted(URL)  # the same connection goes on
        await publisher.publish([stored([122])])
        await until(lambda: feed.index.copies(URL, 122) == 1, "later batches applied")
    finally:
        await feed.aclose()


async def test_an_oversized_batch_in_the_replay_is_not_decoded_and_clears_in_its_place(
    publisher: FakePublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    feed = await followed(publisher, max_message_bytes=4096)
    try:
        await publisher.publish([stored([140])])
        await until(lambda: feed.index.copies(URL, 140) == 1, "stored")
        decoded = _payloads_decoded(monkeypatch)
        await publisher.publish(BIG, drop=True)  # a gap: it comes only from the replay
        await publisher.publish([stored([141])])
        await until(lambda: feed.index.copies(URL, 141) == 1, "the batch after the gap applied")
        state = feed.workers[URL]
        assert all(size <= 4096 for size in decoded)
        assert publisher.replays >= 2 and state.gaps == 1 and state.unread == 1
        assert feed.index.copies(URL, 140) == 0  # the unread batch cleared the entries before it
        assert feed.trusted(URL)
    finally:
        await feed.aclose()


class NotingContext(zmq.asyncio.Context):
    """The feed's ZMQ context, keeping its sockets and the frame bound ZMQ held for each as it closed."""

    sockets: dict[int, zmq.asyncio.Socket]  # declared: pyzmq takes other attributes for socket options
    bounds: list[tuple[int, int]]

    def __init__(self) -> None:
        super().__init__()
        self.sockets = {}
        self.bounds = []

    def socket(self, socket_type: int, **kwargs: Any) -> Any:
        sock = super().socket(socket_type, **kwargs)
        self.sockets[socket_type] = sock
        close = sock.close

        def noted(linger: int | None = None) -> None:
            if not sock.closed:
                self.bounds.append((socket_type, sock.getsockopt(zmq.MAXMSGSIZE)))
            close(linger)

        sock.close = noted  # type: ignore[method-assign]
        return sock


async def test_a_message_over_the_frame_bound_is_never_taken_in_and_the_worker_resynchronises(
    publisher: FakePublisher,
) -> None:
    context = NotingContext()
    feed = await followed(publisher, context=context, max_message_bytes=4096, replay_timeout_s=0.2)
    try:
        bound = feed.settings.max_frame_bytes
        assert bound == 4 * 4096 and context.sockets[zmq.SUB].getsockopt(zmq.MAXMSGSIZE) == bound
        sizes: list[int] = []
        unread = feed._subscriber._unread

        def seen(url: str, frames: list[zmq.Frame]) -> Batch | None:
            sizes.append(max(len(frame) for frame in frames))
            return unread(url, frames)

        feed._subscriber._unread = seen  # type: ignore[method-assign]
        await publisher.publish([stored([150])])
        await until(lambda: feed.index.copies(URL, 150) == 1, "stored")
        huge = [stored(list(range(1 << 40, (1 << 40) + 4000)))]  # ~36 kB: over the bound, live and replayed
        await publisher.publish(huge)
        for _ in range(200):  # ZMQ dropped the connection: batches are lost until it is made again
            if feed.index.copies(URL, 151):
                break
            await publisher.publish([stored([151])])
            await asyncio.sleep(0.05)
        state = feed.workers[URL]
        assert state.unread == 0 and max(sizes) <= bound  # never received, on either socket
        assert state.resyncs >= 1 and feed.index.copies(URL, 150) == 0  # cleared, as a batch not decoded is
        assert feed.index.copies(URL, 151) >= 1 and feed.trusted(URL)
        assert state.reconnects >= 1 and publisher.replays >= 2  # a new connection, and the gap asked for
        closed = [(kind, size) for kind, size in context.bounds if kind != zmq.PAIR]  # the monitor's pair aside
        assert {kind for kind, _ in closed} == {zmq.SUB, zmq.DEALER}  # the dropped one, the replays
        assert all(size == bound for _, size in closed)
        await publisher.publish([stored([152])])
        await until(lambda: feed.index.copies(URL, 152) == 1, "later batches applied")
    finally:
        await feed.aclose()


class Waits:
    """The feed's waits between connections: noted, not waited (the test makes each drop itself)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)
        await asyncio.sleep(0)


async def connected(feed: KvFeed, pub: FakePublisher) -> None:
    """Until the feed's live connection is made and subscribed: a batch came through it."""
    state = feed.workers[URL]
    received = state.received
    for _ in range(500):
        if state.received > received:
            return
        await pub.publish([])
        await asyncio.sleep(0.01)
    raise AssertionError("never connected again")


async def dropped(feed: KvFeed, pub: FakePublisher) -> None:
    """A frame over the bound down the live connection: ZMQ drops it, the feed sees it dropped."""
    state = feed.workers[URL]
    reconnects = state.reconnects
    await pub.publish([stored(list(range(1 << 40, (1 << 40) + 4000)))])  # ~36 kB, over a 16 kB bound
    pub.buffer.clear()  # its replay then answers at once (the gap no longer buffered) instead of timing out
    await until(lambda: state.reconnects == reconnects + 1, "the connection dropped")


@pytest.fixture
def bounded(publisher: FakePublisher) -> Callable[..., Any]:
    """A feed following ``publisher`` with a 16 kB frame bound, its waits noted by a ``Waits``."""

    async def make(clock: Clock, waits: Waits) -> KvFeed:
        feed = KvFeed(clock=clock, sleep=waits)
        settings = FeedSettings(max_message_bytes=4096, replay_timeout_s=0.2)
        await feed.follow([URL], {URL: publisher.source}, no_fetch, settings)
        await connected(feed, publisher)
        return feed

    return make


async def test_a_connection_dropped_again_and_again_is_made_again_ever_later_and_logged_rarely(
    publisher: FakePublisher, bounded: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    waits = Waits()
    feed = await bounded(Clock(), waits)  # a clock that stands still: no connection ever holds
    try:
        caplog.set_level("DEBUG", logger="gateway.kv_events")
        for _ in range(8):
            await dropped(feed, publisher)
            await connected(feed, publisher)
        assert waits.seconds == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
        assert feed.workers[URL].reconnects == 8  # each drop counted
        drops = [r.levelname for r in caplog.records if "connection to" in r.getMessage()]
        assert drops == ["WARNING"] + ["DEBUG"] * 5 + ["WARNING"] * 2  # the first, then once per longest wait
    finally:
        await feed.aclose()


async def test_a_connection_that_held_is_made_again_at_once_when_dropped(
    publisher: FakePublisher, bounded: Callable[..., Any]
) -> None:
    clock, waits = Clock(), Waits()
    feed = await bounded(clock, waits)
    try:
        for _ in range(3):
            await dropped(feed, publisher)
            await connected(feed, publisher)
        clock.now += kv_subscriber._RECONNECT_CAP_S  # this connection has held as long as the longest wait
        await dropped(feed, publisher)
        await connected(feed, publisher)
        await dropped(feed, publisher)  # right after: one more of a new run
        assert waits.seconds == pytest.approx([0.1, 0.2, 0.4, 0.1, 0.2])
        await connected(feed, publisher)
        await publisher.publish([stored([160])])
        await until(lambda: feed.index.copies(URL, 160) == 1, "followed on after the drops")
    finally:
        await feed.aclose()


class UnwatchableContext(zmq.asyncio.Context):
    """A context out of file descriptors for monitors: every socket's ``get_monitor_socket`` fails, as
    ZMQ's does when the process is at its limit. Keeps the sockets it made."""

    made: list[zmq.asyncio.Socket]  # declared: pyzmq takes other attributes for socket options

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def socket(self, socket_type: int, **kwargs: Any) -> Any:
        sock = super().socket(socket_type, **kwargs)
        self.made.append(sock)

        def unwatchable(events: int | None = None, addr: str | None = None) -> zmq.asyncio.Socket:
            raise zmq.ZMQError(errno.EMFILE)

        sock.get_monitor_socket = unwatchable  # type: ignore[method-assign]
        return sock


async def test_a_connection_that_cannot_be_watched_leaves_no_socket_open(publisher: FakePublisher) -> None:
    """The feed fails and starts again (its worker untrusted meanwhile); each attempt's socket is closed,
    not left open for as long as the process runs, one more per attempt."""
    context = UnwatchableContext()
    feed = KvFeed()
    feed._subscriber._ctx = context
    settings = FeedSettings(discover_interval_s=0.01)
    await feed.follow([URL], {URL: publisher.source}, no_fetch, settings)  # type: ignore[arg-type]
    try:
        await until(lambda: len(context.made) >= 3, "attempts made again")
        assert all(sock.closed for sock in context.made[:2])
        assert not feed.trusted(URL)
    finally:
        await feed.aclose()


@pytest.mark.parametrize(
    "event",
    [
        {"type": "BlockStored", "block_hashes": ["x"], "block_size": 4},
        {"type": "BlockStored", "block_hashes": [1.5], "block_size": 4},
        {"type": "BlockRemoved", "block_hashes": 5},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": "p", "block_size": 4},
        {"type": "BlockStored", "block_hashes": [1], "block_size": "4"},
        {"type": "BlockStored", "block_hashes": [1], "block_size": -4},
        {"type": "BlockStored", "block_hashes": [1], "block_size": float("inf")},
        {"type": "BlockStored", "block_hashes": [1], "block_size": 4, "token_ids": 7},
        {"type": "BlockStored", "block_hashes": [1], "block_size": 4, "token_ids": ["a"] * 4},
        {"type": "BlockStored", "block_hashes": [1], "block_size": 4, "lora_name": [1]},
    ],
)
def test_a_malformed_event_is_a_wire_error(event: dict) -> None:
    with pytest.raises(WireError):
        decode_payload(0, encode_batch([event]))


def test_events_of_other_media_or_kinds_are_left_out_whatever_their_fields() -> None:
    events = [
        {"type": "BlockStored", "block_hashes": ["x"], "medium": ["GPU"]},
        {"type": "BlockRemoved", "block_hashes": 5, "medium": {"a": 1}},
        {"type": "SomethingNew", "block_hashes": "x"},
    ]
    assert decode_payload(0, encode_batch(events)).events == []


def test_a_payload_nested_deeper_than_python_allows_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        decode_payload(0, b"\x92\x00\x91" + b"\x91" * 100_000 + b"\xc0")


async def test_discovery_finds_a_worker_publisher_from_its_own_route() -> None:
    calls: list[str] = []

    async def fetch(url: str, timeout_s: float) -> tuple[int, bytes]:
        calls.append(url)
        if len(calls) == 1:
            raise ConnectionRefusedError  # still starting
        return 200, b'{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",' \
                    b' "replay_endpoint": "tcp://*:5558", "topic": "t"}}'  # fmt: skip

    feed = KvFeed()
    await feed.follow(["http://10.1.2.3:8000"], {}, fetch, FeedSettings(discover_interval_s=0.01))
    try:
        await until(lambda: feed.workers["http://10.1.2.3:8000"].source is not None, "discovered")
        assert feed.workers["http://10.1.2.3:8000"].source == KvSource(
            "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558", "t"
        )
        assert calls[0] == "http://10.1.2.3:8000/kv_event_sources"
    finally:
        await feed.aclose()


def test_discovery_answers_that_cannot_be_followed() -> None:
    url = "http://[fd00::1]:8000"
    assert source_from_discovery(url, {}) is None
    assert source_from_discovery(url, {"0": {"enable_kv_cache_events": False, "publisher": "null"}}) is None
    # a concrete address: the worker connects out to a router that binds; not this gateway's way
    concrete = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.9:5557"}}
    assert source_from_discovery(url, concrete) is None
    wildcard = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}}
    assert source_from_discovery(url, wildcard) == KvSource("tcp://[fd00::1]:5557", None, "")


def test_vllm_encoded_events_decode() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv_events.KVEventBatch(
        ts=2.5,
        events=[
            kv_events.BlockStored(
                block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                lora_id=None, medium="GPU", lora_name=None,
            ),
            kv_events.BlockRemoved(block_hashes=[7], medium="GPU"),
            kv_events.BlockRemoved(block_hashes=[8], medium="CPU"),  # another tier: not this cache
            kv_events.AllBlocksCleared(),
        ],
    )  # fmt: skip
    decoded = decode_payload(3, msgspec.msgpack.encode(batch))
    assert decoded.seq == 3 and decoded.ts == 2.5
    assert decoded.events == [
        Stored([2**64 - 1, 7], None, list(range(8)), 4, None, None),
        Removed([7]),
        Cleared(),
    ]
    digest = bytes(range(32))
    as_bytes = kv_events.BlockRemoved(block_hashes=[digest], medium=None)
    assert decode_payload(0, msgspec.msgpack.encode(kv_events.KVEventBatch(ts=0, events=[as_bytes]))).events == [
        Removed([int.from_bytes(digest[-8:], "big")])
    ]


async def test_a_feed_cancelled_while_asking_where_a_worker_publishes_stops() -> None:
    """Shut down while a worker is still starting: its feed task is in discovery, and the fetch it was in
    answers the cancellation with an error of its own (an HTTP client whose read was cut). Discovery asks
    again after any error; the task must stop instead of asking on with the cancellation swallowed."""
    fetch = CutAwait(lambda: ConnectionResetError("connection closed"))
    url = "http://10.1.2.3:8000"
    feed = KvFeed()
    await feed.follow([url], {}, fetch, FeedSettings(discover_interval_s=0.01))
    try:
        await asyncio.wait_for(fetch.entered.wait(), 5)
        done = await stopped_when_cancelled(feed._tasks[url], 2)  # what aclose does, at shutdown
        assert fetch.converted, "the fetch never saw the cancellation"
        assert done, "the feed went on asking where the worker publishes after it was cancelled"
    finally:
        await feed.aclose()
