"""precise_prefix's pure parts: block hashes against vLLM's own functions, the cached-token prediction
rule, the scorers' ranking, the accuracy tracker's degrade and recover, and what the tokenizer refuses
to guess."""

from __future__ import annotations

import os
import random
import threading

import pytest

from plugins.routing.accuracy import AccuracyTracker, reported_cached_tokens
from plugins.routing.blockhash import BlockHasher, predicted_cached_tokens
from plugins.routing.prompt_tokens import PromptTokenizer, TokenizerBusy
from plugins.routing.scorers import Candidate, Weights, rank


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_are_vllms(algo: str) -> None:
    utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import get_hash_fn_by_name

    fn = get_hash_fn_by_name(algo)
    utils.init_none_hash(fn)
    rng = random.Random(7)
    tokens = [rng.randrange(50_000) for _ in range(16 * 5 + 3)]  # five full blocks and a partial one
    for salt in (None, "tenant-a"):
        parent = None
        theirs = []
        for i in range(5):
            extra = (("cache_salt", salt),) if salt and i == 0 else None
            parent = utils.hash_block_tokens(fn, parent, tokens[i * 16 : (i + 1) * 16], extra)
            theirs.append(utils.maybe_convert_block_hash(parent))
        ours = BlockHasher(algo, os.environ.get("PYTHONHASHSEED"), 16).hashes(tokens, salt)  # type: ignore[arg-type]
        assert ours == theirs


def test_a_different_seed_or_block_size_matches_nothing() -> None:
    tokens = list(range(64))
    base = BlockHasher("sha256", None, 16).hashes(tokens)
    assert not set(base) & set(BlockHasher("sha256", "42", 16).hashes(tokens))
    assert not set(base) & set(BlockHasher("sha256", None, 32).hashes(tokens))


def test_the_last_prompt_token_is_never_a_hit() -> None:
    assert predicted_cached_tokens(4, 512, 128) == 384  # 512 tokens: at most (511 // 128) = 3 blocks
    assert predicted_cached_tokens(4, 513, 128) == 512
    assert predicted_cached_tokens(1, 513, 128) == 128
    assert predicted_cached_tokens(0, 513, 128) == 0


def test_the_longest_prefix_wins_between_equally_loaded_workers() -> None:
    ranked = rank([Candidate("a", 1, 0), Candidate("b", 4, 0), Candidate("c", 0, 0)], 4, Weights())
    assert [c.key for _, c in ranked] == ["b", "a", "c"]


def test_load_and_a_full_cache_weigh_against_a_short_prefix() -> None:
    # b holds one block of eight more, but runs 12 requests (seen in its own metrics, e.g. another replica's)
    ranked = rank([Candidate("a", 0, 0, running=0), Candidate("b", 1, 0, running=12)], 8, Weights())
    assert ranked[0][1].key == "a"
    even = rank([Candidate("a", 0, 1, kv_usage=0.95), Candidate("b", 0, 1, kv_usage=0.1)], 8, Weights())
    assert even[0][1].key == "b"


def test_one_request_more_does_not_outweigh_most_of_the_prompt_held() -> None:
    # a retrieval prompt of 6 blocks: a holds the shared head and the document (5), b the head only (1)
    for a_load, b_load in [(1, 0), (2, 1), (4, 3)]:
        ranked = rank([Candidate("b", 1, b_load), Candidate("a", 5, a_load)], 6, Weights())
        assert ranked[0][1].key == "a", (a_load, b_load)
    # with equal prefixes the load still decides
    ranked = rank([Candidate("a", 1, 3), Candidate("b", 1, 2)], 6, Weights())
    assert ranked[0][1].key == "b"


def test_a_worker_over_the_bounded_load_ranks_last_whatever_it_holds() -> None:
    hot = Candidate("hot", 8, 20)
    ranked = rank([hot, Candidate("idle", 0, 0)], 8, Weights(prefix=100.0), load_factor=1.25, load_slack=4)
    assert ranked[-1][1] is hot


def test_the_tracker_degrades_below_the_threshold_and_recovers_above_it_with_a_margin() -> None:
    tracker = AccuracyTracker("m", window=10, min_samples=5, threshold=0.8)
    for _ in range(4):
        tracker.observe(0, 512, 128)  # far off, but too few samples to judge
    assert not tracker.degraded and tracker.share() is None
    tracker.observe(0, 512, 128)
    assert tracker.degraded
    for _ in range(8):
        tracker.observe(256, 300, 128)  # within one block
    assert tracker.share() == 0.8 and tracker.degraded  # at the threshold: not yet above it plus the margin
    tracker.observe(128, 128, 128)
    assert not tracker.degraded


def test_the_reported_cached_tokens_are_read_only_when_present() -> None:
    assert reported_cached_tokens({"prompt_tokens": 5}) is None
    assert reported_cached_tokens({"prompt_tokens_details": None}) is None
    assert reported_cached_tokens({"prompt_tokens_details": {"cached_tokens": 256}}) == 256
    assert reported_cached_tokens({"prompt_tokens_details": {"cached_tokens": -1}}) is None


class _Tok:
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [len(text), int(add_special_tokens)]

    def apply_chat_template(self, conversation: list[dict], **kwargs: object) -> list[int]:
        return [len(m["content"] or "") for m in conversation]


def test_what_the_prompt_tokenizer_will_not_guess() -> None:
    tok = PromptTokenizer(_Tok(), None)
    text_parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]
    }
    assert tok.tokens("chat/completions", text_parts) == [4]  # parts joined by a newline, as vLLM does
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert tok.tokens("chat/completions", image) is None
    tool = {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}
    assert tok.tokens("chat/completions", tool) is None
    developer = {"messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]}
    assert tok.tokens("chat/completions", developer) is None  # vLLM may turn it into a system turn first
    assert tok.tokens("completions", {"prompt": "hello"}) == [5, 1]
    assert tok.tokens("completions", {"prompt": [3, 4, 5]}) == [3, 4, 5]
    assert tok.tokens("completions", {"prompt": ["a", "b"]}) is None  # several prompts: several placements
    assert tok.tokens("embeddings", {"input": "x"}) is None


def test_the_event_loop_never_waits_for_a_tokenizer_another_thread_holds() -> None:
    tok = PromptTokenizer(_Tok(), None)
    held = threading.Event()
    release = threading.Event()

    def long_prompt() -> None:
        with tok._lock:  # as a thread tokenizing a long prompt does
            held.set()
            release.wait(10)

    worker = threading.Thread(target=long_prompt)
    worker.start()
    try:
        assert held.wait(10)
        with pytest.raises(TokenizerBusy):
            tok.tokens("completions", {"prompt": "short"}, wait=False)
    finally:
        release.set()
        worker.join(10)
    assert tok.tokens("completions", {"prompt": "short"}, wait=False) == [5, 1]
