"""prompt_cache_key as a placement signal: the lineage (tenant-scoped), the bounded table of homes, and
what the scorers make of a new and of a known lineage.

The two shapes a placement cannot tell apart without the key, on two workers with worker ``a`` holding
the prompt's 4 full blocks: eight conversations' first turns after one shared system prompt, and
repeats of one prompt. Without a key both follow the held blocks (right for the repeats); a new key
goes by the working sets (right for the conversations); a known key goes home."""

from __future__ import annotations

import tracemalloc

from plugins.routing.cache_keys import KeyHomes, affinity_text, lineage, prompt_cache_key
from plugins.routing.scorers import Candidate, Weights, rank


def test_the_key_is_read_only_when_it_is_a_non_empty_string() -> None:
    assert prompt_cache_key({"prompt_cache_key": "user-42"}) == "user-42"
    for body in ({}, {"prompt_cache_key": ""}, {"prompt_cache_key": 42}, {"prompt_cache_key": ["a"]}):
        assert prompt_cache_key(body) is None
        assert lineage("t", body) is None


def test_affinity_hashes_the_prefix_and_the_key_together() -> None:
    assert affinity_text("system prompt", {}) == "system prompt"
    keyed = {affinity_text("system prompt", {"prompt_cache_key": k}) for k in ("a", "b")}
    assert len(keyed) == 2 and "system prompt" not in keyed


def test_a_lineage_is_scoped_by_tenant() -> None:
    body = {"prompt_cache_key": "conversation-1"}
    assert lineage("acme", body) == lineage("acme", dict(body))
    assert lineage("acme", body) != lineage("globex", body)
    assert lineage(None, body) == lineage("", body)


def test_homes_keep_the_most_recently_used_within_their_bound() -> None:
    homes = KeyHomes(max_entries=3)
    for key, url in ((1, "a"), (2, "b"), (3, "a")):
        homes.remember(key, url)
    homes.remember(1, "b")  # used again: now the most recent, and moved
    homes.remember(4, "a")  # over the bound: 2 is the least recently used
    assert len(homes) == 3
    assert [homes.home(k) for k in (1, 2, 3, 4)] == ["b", None, "a", "a"]
    homes.max_entries = 1  # a reload shrank it: applied at the next remember
    homes.remember(5, "b")
    assert len(homes) == 1 and homes.home(5) == "b"


def test_homes_cost_under_128_bytes_a_lineage() -> None:
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    tracemalloc.start()
    try:
        homes = KeyHomes(max_entries=20_000)
        for i in range(30_000):  # past the bound: the table stays at it
            homes.remember(lineage("tenant", {"prompt_cache_key": f"conversation-{i}"}) or 0, urls[i % 2])
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(homes) == 20_000
    assert used / len(homes) < 128  # 116 measured at 65,536: the dict's table keeps slack as keys churn


def _pair(*, a_home: bool = False, b_home: bool = False, a_load: int = 1, b_load: int = 0) -> list[Candidate]:
    """Worker a holds all 4 full blocks of the prompt (the shared head) and has them in its working set."""
    return [
        Candidate("a", prefix_blocks=4, in_flight=a_load, working_set=4, home=a_home),
        Candidate("b", prefix_blocks=0, in_flight=b_load, working_set=0, home=b_home),
    ]


def _best(candidates: list[Candidate], **kwargs: bool) -> str:
    return rank(candidates, 4, Weights(), **kwargs)[0][1].key


def test_without_a_key_a_prompt_follows_its_held_blocks() -> None:
    assert _best(_pair()) == "a"  # a repeat of one prompt: the held head wins over one request of load


def test_a_new_lineage_goes_by_the_working_sets_whatever_one_worker_holds() -> None:
    assert _best(_pair(), fresh=True) == "b"  # a new conversation after the shared head: the emptier cache
    equal = [Candidate("a", 4, 0, working_set=4), Candidate("b", 4, 0, working_set=4)]
    assert _best(equal, fresh=True) == "a"  # equal working sets: the score, then the given order


def test_a_known_lineage_goes_home_where_the_held_blocks_do_not_decide() -> None:
    # both hold the shared head; the conversation's history is in partial blocks at home (b), one request busier
    both = [Candidate("a", 4, 0, working_set=4), Candidate("b", 4, 1, working_set=40, home=True)]
    assert _best(both) == "b"  # not cold (it has a home): not sent to a for its smaller working set
    assert _best([Candidate("a", 4, 0, working_set=4), Candidate("b", 4, 1, working_set=40)]) == "a"  # no home
    assert _best(_pair(a_home=True)) == "a"


def test_the_held_blocks_outweigh_a_home_that_lost_them() -> None:
    # home (b) evicted the prompt; a holds all of it: the hits are on a (b first in the given order)
    lost = [Candidate("b", 0, 0, working_set=0, home=True), Candidate("a", 4, 0, working_set=4)]
    assert _best(lost) == "a"
    # where the held blocks tie, home outweighs the queue scorer up to the load cap (8 of a cap of 9 here)
    tie = [Candidate("a", 4, 0, working_set=4), Candidate("b", 4, 8, working_set=4, home=True)]
    assert _best(tie) == "b"
    tie[1] = Candidate("b", 4, 9, working_set=4, home=True)
    assert _best(tie) == "a"  # at the cap: spilled, as any request would be


def test_home_never_outranks_the_load_cap() -> None:
    # home is over the bounded-load cap (mean + slack): the request goes elsewhere, as any other would
    crowded = [Candidate("a", 4, 9, working_set=4, home=True), Candidate("b", 4, 0, working_set=4)]
    assert _best(crowded) == "b"


def test_a_zero_home_weight_leaves_placement_as_without_keys() -> None:
    weights = Weights(home=0.0)
    tied = [Candidate("a", 4, 0, working_set=4), Candidate("b", 4, 0, working_set=4, home=True)]
    assert rank(tied, 4, weights)[0][1].key == "a"  # the given order decides, as without a key
    assert rank(tied, 4, Weights())[0][1].key == "b"
