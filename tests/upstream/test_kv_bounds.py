"""What one worker's KV event stream can cost the gateway, whatever it sends: a batch is bounded in the
elements it decodes to (not only in bytes: msgpack takes a small int in one byte), a batch within the bounds
is applied with the event loop free between chunks, and a replay is applied as it arrives, never held whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest

from gateway.upstream import kv_wire
from gateway.upstream.kv_feed import KvFeed, WorkerKv
from gateway.upstream.kv_index import BlockIndex
from gateway.upstream.kv_source import FeedSettings
from gateway.upstream.kv_wire import Batch, Stored, decode_payload, encode_batch
from tests.support.kv_publisher import FakePublisher, stored
from tests.upstream.test_kv_feed import URL, _payloads_decoded, followed, until


@pytest.fixture
async def publisher() -> AsyncIterator[FakePublisher]:
    pub = FakePublisher()
    yield pub
    await pub.aclose()


BOUND = 64 << 10  # max_message_bytes of these feeds: 8,192 elements


def one_byte_hashes(n: int) -> dict:
    """A BlockStored of ``n`` block hashes of one byte each: far more elements than bytes would suggest."""
    return stored([i % 128 for i in range(n)])


async def test_a_batch_over_the_element_bound_is_not_decoded_and_clears_in_its_place(
    publisher: FakePublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    many = one_byte_hashes(20_000)
    assert len(encode_batch([many])) < BOUND  # within the byte bound
    feed = await followed(publisher, max_message_bytes=BOUND)
    try:
        await publisher.publish([stored([150])])
        await until(lambda: feed.index.copies(URL, 150) == 1, "stored")
        decoded = _payloads_decoded(monkeypatch)
        await publisher.publish([many])
        await publisher.publish([stored([151])])
        await until(lambda: feed.index.copies(URL, 151) == 1, "the batch after it applied")
        state = feed.workers[URL]
        assert state.unread == 1 and (state.gaps, state.resyncs) == (0, 0)
        assert feed.index.copies(URL, 150) == 0 and feed.index.blocks(URL) == 1  # cleared in its place
        assert len(decoded) == 1  # only the batch after it was decoded
        assert feed.trusted(URL)
    finally:
        await feed.aclose()


async def test_a_batch_of_many_tiny_events_is_over_the_element_bound_too(publisher: FakePublisher) -> None:
    tiny = [{} for _ in range(1000)]  # one byte each; 32 elements each
    assert len(encode_batch(tiny)) < BOUND
    feed = await followed(publisher, max_message_bytes=BOUND)
    try:
        await publisher.publish(tiny)
        await publisher.publish([stored([160])])
        await until(lambda: feed.index.copies(URL, 160) == 1, "the batch after it applied")
        assert feed.workers[URL].unread == 1
    finally:
        await feed.aclose()


def test_the_element_bound_is_checked_before_any_list_is_built() -> None:
    payload = encode_batch([one_byte_hashes(10_000), stored([1], tokens=list(range(10_000)))])
    assert len(decode_payload(0, payload).events) == 2  # no bound: decoded
    assert len(decode_payload(0, payload, 20_100).events) == 2
    with pytest.raises(kv_wire.TooManyElements):
        decode_payload(0, payload, 19_000)
    # extra fields no one reads are skipped, never built: they do not count
    unread = {**stored([1]), "junk": list(range(100_000))}
    assert decode_payload(0, encode_batch([unread]), 64).events[0].hashes == [1]  # type: ignore[union-attr]


def test_the_element_bound_goes_with_the_byte_bound() -> None:
    assert FeedSettings(max_message_bytes=BOUND).max_batch_elements == 8192
    assert FeedSettings().max_batch_elements == 2 << 20


async def test_a_large_batch_is_applied_with_the_event_loop_free_between_chunks() -> None:
    turns = 0
    seen: list[int] = []  # the other task's turns, at each store into the index

    class NotingIndex(BlockIndex):
        def store(self, worker: str, hashes: Iterable[int]) -> None:
            seen.append(turns)
            super().store(worker, hashes)

    feed = KvFeed()
    feed.index = NotingIndex(1_000_000)
    feed.workers[URL] = WorkerKv(URL)

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    try:
        await feed.apply(URL, Batch(0, 0.0, [Stored(list(range(100_000)), None, [], 16, None, None)]))
    finally:
        other.cancel()
    assert feed.index.blocks(URL) == 100_000
    assert len(seen) > 5 and len(set(seen)) == len(seen)  # in chunks, with the other task's turn between


async def test_a_batch_stops_applying_when_the_worker_is_dropped_meanwhile() -> None:
    feed = KvFeed()
    feed.workers[URL] = WorkerKv(URL)
    applying = asyncio.create_task(
        feed.apply(URL, Batch(0, 0.0, [Stored(list(range(100_000)), None, [], 16, None, None)]))
    )
    await asyncio.sleep(0)  # the first chunk stored
    feed.drop(URL, "a failed health check")
    await applying
    assert feed.index.blocks(URL) == 0  # nothing of the old process after its entries went


async def test_a_replay_is_applied_as_it_arrives(publisher: FakePublisher) -> None:
    """Each replayed batch is applied before the replay ends: none is held in memory until the end marker."""
    feed = await followed(publisher, replay_timeout_s=30)
    try:
        await publisher.publish([stored([170])])
        await until(lambda: feed.index.copies(URL, 170) == 1, "stored")
        held = publisher.hold_replay_end = asyncio.Event()
        for block in range(171, 181):
            await publisher.publish([stored([block])], drop=True)  # a gap: only in the replay buffer
        await publisher.publish([stored([181])])
        # the replay (171 to 181, the live batch that found the gap is buffered too) applied, its end held
        await until(lambda: feed.index.copies(URL, 181) == 1, "the replayed batches, before the end marker")
        state = feed.workers[URL]
        assert not held.is_set() and (state.gaps, state.resyncs, state.last_seq) == (1, 0, publisher.seq - 1)
        held.set()
        await publisher.publish([stored([182])])
        await until(lambda: feed.index.copies(URL, 182) == 1, "a live batch after the replay")
        assert (state.gaps, state.resyncs) == (1, 0)
        assert all(feed.index.copies(URL, block) == 1 for block in range(170, 183))
    finally:
        await feed.aclose()


async def test_only_the_first_blocks_of_the_first_chain_are_kept() -> None:
    feed = KvFeed()
    feed.workers[URL] = WorkerKv(URL)
    tokens = list(range(16 * 100))
    await feed.apply(URL, Batch(0, 0.0, [Stored(list(range(100)), None, tokens, 16, None, None)]))
    first = feed.workers[URL].first_stored
    kept = 4  # FIRST_STORED_BLOCKS
    assert first is not None and first.hashes == list(range(kept))
    assert first.token_ids == tokens[: 16 * kept]


async def test_an_event_that_stores_no_block_teaches_no_block_size() -> None:
    feed = KvFeed()
    feed.workers[URL] = WorkerKv(URL)
    state = feed.workers[URL]
    await feed.apply(URL, Batch(0, 0.0, [Stored([], None, [0] * 100_000, 1, None, None)]))
    assert state.block_size is None and state.first_stored is None
    await feed.apply(URL, Batch(1, 0.0, [Stored([5], None, [0] * 64, 1, None, None)]))  # tokens beyond its blocks
    assert state.block_size is None and state.first_stored is None
    await feed.apply(URL, Batch(2, 0.0, [Stored([6], None, [0] * 16, 16, None, None)]))
    assert state.block_size == 16 and state.first_stored is not None
