"""precise_prefix checks its own block hashes against a worker's first published chain, on the event loop
(in ``predict``): the check hashes a few blocks whatever the event says, since a worker chooses its token ids
(one byte each on the wire) and its block size."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.upstream.kv_feed import WorkerKv
from gateway.upstream.kv_wire import Stored
from plugins.routing.blockhash import BlockHasher
from tests.plugins.routing.test_precise_bounds import setup


class Counting(BlockHasher):
    """A block hasher that notes how many tokens it was given each time."""

    def __init__(self, block_size: int) -> None:
        super().__init__("sha256", None, block_size)
        self.given: list[int] = []

    def hashes(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[int]:
        self.given.append(len(tokens))
        return super().hashes(tokens, cache_salt)


def test_an_event_without_hashes_is_not_hashed_whatever_its_tokens() -> None:
    placement, *_ = setup()
    hasher = placement._hashers[1] = Counting(1)
    event = Stored([], None, [0] * 200_000, 1, None, None)
    placement._verify([WorkerKv("http://hostile:8000", first_stored=event)])
    assert hasher.given == [] and not placement.tracker.degraded


def test_only_the_first_blocks_are_hashed_and_they_are_checked() -> None:
    placement, *_ = setup()
    hasher = placement._hashers[16] = Counting(16)
    tokens = list(range(16 * 1000))
    right = BlockHasher("sha256", None, 16).hashes(tokens)
    kept = 4  # the blocks checked (``kv_feed.FIRST_STORED_BLOCKS``)
    a = WorkerKv("http://a:8000", first_stored=Stored(right, None, tokens, 16, None, None))
    placement._verify([a])
    assert hasher.given == [16 * kept] and not placement.tracker.degraded
    wrong = [*right[:2], right[2] + 1, *right[3:]]
    b = WorkerKv("http://b:8000", first_stored=Stored(wrong, None, tokens, 16, None, None))
    placement._verify([a, b])  # both alive: each event is checked once, by its id
    assert hasher.given == [16 * kept, 16 * kept] and placement.tracker.degraded
