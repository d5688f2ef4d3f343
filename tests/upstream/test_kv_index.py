"""The KV block index against a plain model of it: random store / remove / clear / restart sequences
(hypothesis), the multiset rule for duplicate copies, the LRU bound and its cost in bytes."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.upstream.kv_index import BYTES_PER_ENTRY, BlockIndex

WORKERS = ["http://a:1", "http://b:2", "http://c:3"]
HASHES = st.integers(min_value=0, max_value=12)  # a small space, so stores and removes collide often


class ModelIndex:
    """The obvious implementation: counts per (worker, hash) and a list in store order."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.counts: dict[tuple[str, int], int] = {}
        self.order: list[tuple[str, int]] = []

    def store(self, worker: str, hashes: list[int]) -> None:
        for h in hashes:
            key = (worker, h)
            self.counts[key] = self.counts.get(key, 0) + 1
            if key in self.order:
                self.order.remove(key)
            self.order.append(key)
        while len(self.order) > self.cap:
            del self.counts[self.order.pop(0)]

    def remove(self, worker: str, hashes: list[int]) -> None:
        for h in hashes:
            key = (worker, h)
            if key not in self.counts:
                continue
            self.counts[key] -= 1
            if self.counts[key] == 0:
                del self.counts[key]
                self.order.remove(key)

    def clear(self, worker: str) -> None:
        for key in [k for k in self.order if k[0] == worker]:
            del self.counts[key]
            self.order.remove(key)

    def prefix(self, worker: str, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if (worker, h) not in self.counts:
                break
            n += 1
        return n


OPS = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.lists(HASHES, max_size=6)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), st.lists(HASHES, max_size=6)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.just([])),  # AllBlocksCleared
    st.tuples(st.just("restart"), st.sampled_from(WORKERS), st.lists(HASHES, max_size=6)),  # clear, then new stores
)


@settings(max_examples=300, deadline=None)
@given(cap=st.integers(min_value=1, max_value=20), ops=st.lists(OPS, max_size=40), probe=st.lists(HASHES, max_size=8))
def test_index_agrees_with_a_plain_model(cap: int, ops: list[tuple[str, str, list[int]]], probe: list[int]) -> None:
    index = BlockIndex(cap)
    model = ModelIndex(cap)
    for op, worker, hashes in ops:
        if op == "store":
            index.store(worker, hashes)
            model.store(worker, hashes)
        elif op == "remove":
            index.remove(worker, hashes)
            model.remove(worker, hashes)
        else:
            index.clear(worker)
            model.clear(worker)
            if op == "restart":
                index.store(worker, hashes)
                model.store(worker, hashes)
        assert len(index) <= cap
        assert len(index) == len(model.order)
        for w in WORKERS:
            assert index.prefix_blocks(w, probe) == model.prefix(w, probe)
            assert index.blocks(w) == sum(1 for k in model.counts if k[0] == w)
            for h in set(probe):
                assert index.copies(w, h) == model.counts.get((w, h), 0)


def test_a_duplicate_copy_keeps_the_block_held_until_both_are_removed() -> None:
    index = BlockIndex(100)
    index.store("w", [7, 8])
    index.store("w", [7])  # a second physical copy of block 7
    index.remove("w", [7])
    assert index.prefix_blocks("w", [7, 8]) == 2
    index.remove("w", [7])
    assert index.prefix_blocks("w", [7, 8]) == 0
    assert index.prefix_blocks("w", [8]) == 1


def test_one_worker_holding_a_block_says_nothing_of_another() -> None:
    index = BlockIndex(100)
    index.store("a", [1, 2, 3])
    index.store("b", [1])
    assert index.prefix_blocks("a", [1, 2, 3, 4]) == 3
    assert index.prefix_blocks("b", [1, 2, 3, 4]) == 1
    assert index.clear("a") == 3
    assert index.prefix_blocks("a", [1]) == 0
    assert index.prefix_blocks("b", [1]) == 1


def test_the_bound_forgets_the_oldest_stores_and_counts_them() -> None:
    index = BlockIndex(3)
    index.store("a", [1, 2])
    index.store("b", [1])
    index.store("a", [1])  # refreshed: now the newest
    index.store("b", [9])  # over the bound: ("a", 2) is the oldest
    assert index.copies("a", 2) == 0
    assert index.copies("a", 1) == 2
    assert index.evicted == 1
    assert len(index) == 3


def test_stated_bytes_per_entry_cover_the_measured_cost() -> None:
    n = 20_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = BlockIndex(n)
        for w in range(4):
            index.store(
                f"http://10.0.0.{w}:8000", [(w << 40) + (i * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(n // 4)]
            )
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == n
    assert used / n <= BYTES_PER_ENTRY, f"{used / n:.0f} bytes per entry"
