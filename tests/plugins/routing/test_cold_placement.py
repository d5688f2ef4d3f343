"""Where precise_prefix sends a prompt no worker holds: to the worker with the smallest recent working
set, never past the load cap and never against a held prefix. And a model of why: two LRU caches that
together hold every prefix of a prefix_repetition-shaped workload (vLLM's set: prefixes of four blocks,
each asked four times, shuffled), fed by a closed loop of concurrent clients."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Container

import pytest

from gateway.upstream.kv_index import BlockIndex
from plugins.routing.pending import PendingBlocks
from plugins.routing.scorers import Candidate, Weights, rank


def best(candidates: list[Candidate], total_blocks: int = 4) -> str:
    return rank(candidates, total_blocks, Weights())[0][1].key


def test_a_cold_prompt_goes_to_the_smallest_working_set_even_when_busier() -> None:
    # neither holds the prompt; a runs one request more, but b is already asked to hold 12 blocks more
    assert best([Candidate("a", 0, 2, working_set=20), Candidate("b", 0, 1, working_set=32)]) == "a"
    # the same when both hold only a common head (one block of a shared chat template, say)
    assert best([Candidate("a", 1, 2, working_set=20), Candidate("b", 1, 1, working_set=32)]) == "a"


def test_working_sets_within_one_prompt_of_each_other_are_equal_and_the_load_decides() -> None:
    assert best([Candidate("a", 0, 2, working_set=20), Candidate("b", 0, 1, working_set=23)]) == "b"
    assert best([Candidate("a", 0, 2, working_set=20), Candidate("b", 0, 1, working_set=24)]) == "a"


def test_the_working_set_never_outweighs_a_held_prefix_the_load_cap_or_a_prompt_without_blocks() -> None:
    assert best([Candidate("a", 0, 0, working_set=0), Candidate("b", 3, 0, working_set=90)]) == "b"
    assert best([Candidate("a", 0, 12, working_set=0), Candidate("b", 0, 0, working_set=90)]) == "b"  # a over cap
    assert best([Candidate("a", 0, 2, working_set=0), Candidate("b", 0, 0, working_set=90)], total_blocks=0) == "b"


def test_a_prompt_held_for_less_than_half_its_blocks_goes_where_the_cache_has_room() -> None:
    # a holds only the 4-block head every conversation starts with, of a 12-block first prompt; b holds
    # nothing and has room: the conversation's 8 new blocks go to b
    a, b = Candidate("a", 4, 1, working_set=40), Candidate("b", 0, 0, working_set=0)
    assert best([a, b], total_blocks=12) == "b"
    # held for half its blocks or more, it follows them (a prefix_repetition repeat at vLLM's default lengths)
    assert best([Candidate("a", 2, 1, working_set=40), b], total_blocks=4) == "a"
    # min_match 0: only a prompt every worker holds equally is cold
    assert rank([a, b], 12, Weights(), min_match=0)[0][1].key == "a"
    # the load cap comes first, and a prompt_cache_key's home is never placed as cold
    assert best([Candidate("a", 4, 0, working_set=40), Candidate("b", 0, 12, working_set=0)], total_blocks=12) == "a"
    assert best([Candidate("a", 4, 1, working_set=40, home=True), b], total_blocks=12) == "a"


class LruWorker:
    """A worker's prefix cache as vLLM's: full blocks, least recently used evicted first. ``published``
    is what its KV events have told the gateway so far: a request's blocks once it is answered."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.published: set[int] = set()
        self.in_flight = 0

    def prefill(self, hashes: list[int]) -> int:
        hit = held(self.blocks, hashes)
        for block in hashes:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
            while len(self.blocks) > self.capacity:
                evicted, _ = self.blocks.popitem(last=False)
                self.published.discard(evicted)
        return hit

    def answered(self, hashes: list[int]) -> None:
        self.in_flight -= 1
        self.published.update(h for h in hashes if h in self.blocks)


def held(blocks: Container[int], hashes: list[int]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in blocks:
        n += 1
    return n


def simulate(
    seed: int, use_demand: bool, use_pending: bool = True, prefixes: int = 16, blocks: int = 4, repeats: int = 4
) -> tuple[float, int]:
    """The hit rate in blocks, and the largest number of prefixes one worker was home to, of a closed loop
    of four clients placing each request as precise_prefix does, on what the workers have published."""
    rng = random.Random(seed)
    capacity = prefixes * blocks // 2 + 1  # the pool holds every prefix, one worker half of them (no more)
    workers = [LruWorker("a", capacity), LruWorker("b", capacity)]
    demand = BlockIndex(2 * capacity)
    now = 0.0
    pending = PendingBlocks(60.0, 1000, clock=lambda: now)
    requests = [p for p in range(prefixes) for _ in range(repeats)]
    rng.shuffle(requests)
    homes: dict[int, str] = {}
    running: list[tuple[float, LruWorker, list[int]]] = []
    hits = 0.0
    rotation = 0
    for prefix in requests:
        if len(running) == 4:  # wait for the first of four clients to be answered
            running.sort(key=lambda r: r[0])
            now, done, done_hashes = running.pop(0)
            done.answered(done_hashes)
        hashes = [prefix * 100 + k for k in range(blocks)]
        rotation = (rotation + 1) % 2
        candidates = []
        for w in workers[rotation:] + workers[:rotation]:
            known = held(w.published, hashes)
            if use_pending:
                known = pending.extend(w.name, hashes, known)
            candidates.append(Candidate(w.name, known, w.in_flight, working_set=demand.blocks(w.name) * use_demand))
        name = rank(candidates, blocks, Weights())[0][1].key
        worker = next(w for w in workers if w.name == name)
        homes.setdefault(prefix, name)
        hit = worker.prefill(hashes)
        hits += hit
        pending.add(name, hashes[held(worker.published, hashes) :])
        demand.store(name, hashes)
        worker.in_flight += 1
        running.append((now + rng.uniform(0.5, 1.5) * (1 if hit else 2), worker, hashes))  # a miss prefills longer
    busiest = max(list(homes.values()).count(w.name) for w in workers)
    return hits / (len(requests) * blocks), busiest


SEEDS = range(40)
CEILING = 3 / 4  # each prefix's first request misses, the other three hit


def test_cold_prefixes_are_spread_by_working_set_so_the_pool_holds_them_all() -> None:
    with_demand = [simulate(s, use_demand=True) for s in SEEDS]
    by_load = [simulate(s, use_demand=False) for s in SEEDS]
    for rate, busiest in with_demand:
        assert busiest == 8  # homes split 8/8 every time
        assert rate == pytest.approx(CEILING)
    # by load alone, one worker is sometimes home to 9, more than its cache holds, and the pool hits less
    assert max(busiest for _, busiest in by_load) >= 9
    assert sum(rate for rate, _ in by_load) / len(SEEDS) < CEILING - 0.01


def test_a_repeat_sent_before_the_first_is_answered_follows_it() -> None:
    with_pending = [simulate(s, use_demand=True) for s in SEEDS]
    without = [simulate(s, use_demand=True, use_pending=False) for s in SEEDS]
    assert all(rate == pytest.approx(CEILING) for rate, _ in with_pending)
    # without: the repeat looks cold, goes by working set to the other worker, and misses there
    assert sum(rate for rate, _ in without) / len(SEEDS) < CEILING - 0.05


def test_pending_blocks_count_only_in_order_from_what_is_held_and_only_while_fresh() -> None:
    now = 0.0
    pending = PendingBlocks(10.0, 5, clock=lambda: now)
    pending.add("a", [2, 3])
    assert pending.extend("a", [1, 2, 3, 4], held=1) == 3  # block 1 indexed, 2 and 3 on their way
    assert pending.extend("a", [1, 2, 3, 4], held=0) == 0  # 1 is neither: a prefix stops there
    assert pending.extend("b", [1, 2, 3, 4], held=1) == 1  # another worker's are not this one's
    now = 10.5
    assert pending.extend("a", [1, 2, 3, 4], held=1) == 1  # past the lifetime: as if never placed
    pending.add("a", [7, 8, 9, 10, 11, 12])
    assert len(pending) == 5  # the expired two dropped, then the oldest past the bound
    assert pending.extend("a", [7, 8], held=0) == 0 and pending.extend("a", [8, 9], held=0) == 2


def conversations_sharing_a_head(min_match: float, conversations: int = 8, turns: int = 4) -> tuple[float, list[int]]:
    """vLLM's multi-turn benchmark's shape: every conversation starts with the same 4-block head, then 8
    blocks of its own, and grows a block a turn; interleaved, one request at a time. The hit rate in
    blocks, and how many conversations each worker was home to."""
    head = [9000 + k for k in range(4)]
    capacity = 4 + conversations * (8 + turns) // 2 + 2  # the pool holds every conversation, one worker half
    workers = [LruWorker("a", capacity), LruWorker("b", capacity)]
    demand = BlockIndex(2 * capacity)
    homes: dict[int, str] = {}
    hits = total = 0
    for turn in range(turns):
        for c in range(conversations):
            hashes = head + [c * 1000 + k for k in range(8 + turn)]
            r = (turn * conversations + c) % 2  # precise_prefix rotates its candidates
            order = workers[r:] + workers[:r]
            candidates = [
                Candidate(w.name, held(w.published, hashes), w.in_flight, working_set=demand.blocks(w.name))
                for w in order
            ]
            name = rank(candidates, len(hashes), Weights(), min_match=min_match)[0][1].key
            worker = next(w for w in workers if w.name == name)
            homes.setdefault(c, name)
            worker.in_flight += 1
            hits += worker.prefill(hashes)
            total += len(hashes)
            worker.answered(hashes)
            demand.store(name, hashes)
    return hits / total, [list(homes.values()).count(w.name) for w in workers]


def test_conversations_that_share_only_a_head_are_spread_so_their_histories_stay_cached() -> None:
    spread, split = conversations_sharing_a_head(min_match=0.5)
    piled, piled_split = conversations_sharing_a_head(min_match=0)
    assert split == [4, 4]
    # every later turn finds its whole history; the first turns find the head, but on the first worker
    assert spread == pytest.approx((6 * 4 + sum(8 + t - 1 + 4 for t in range(1, 4)) * 8) / (8 * (12 + 13 + 14 + 15)))
    # held 4 of 12 blocks, each new conversation follows the head to one worker, whose cache holds half of
    # them: each history is evicted before its next turn
    assert piled_split == [8, 0]
    assert piled < spread - 0.4
