"""bench/bench_routing.py's ``vllm_multi_turn`` workload builds vLLM's synthetic multi-turn conversations
as vLLM's generator does (``benchmarks/multi_turn``): one common prefix starts every conversation's
first message, then a prefix of the conversation's own, and later messages of 120-160 tokens; and the
common start is longer than prefix affinity's key, so the workload tests what it claims to."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from plugins.routing.policies import prompt_prefix
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[3]
MODEL_DIR = REPO / "models" / "smollm2"

pytestmark = pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="the default model is not prepared (models/smollm2)")

ASK = "Please rewrite the following text and add more content: "


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(REPO / "bench" / "bench_routing.py")


def args(**overrides: int) -> argparse.Namespace:
    values = {"conversations": 6, "user_turns": 3, "common_prefix_tokens": 500}
    values |= {"conversation_prefix_tokens": 400, "max_tokens": 4}
    return argparse.Namespace(**{**values, **overrides})


def test_every_conversation_starts_with_the_common_prefix_then_one_of_its_own(bench: ModuleType) -> None:
    hf = bench.hf_tokenizer(MODEL_DIR)
    conversations = bench.vllm_multi_turn(MODEL_DIR, 11, args())
    assert len(conversations) == 6 and all(len(c.turns) == 3 for c in conversations)
    firsts = [c.turns[0]["messages"][0]["content"] for c in conversations]
    common = firsts[0].split("0 is a nice number... ", 1)[0]
    assert common.endswith(".") and 480 <= len(hf.encode(common, add_special_tokens=False)) <= 560  # a decode apart
    owns = set()
    for c, first in enumerate(firsts):
        assert first.startswith(f"{common}{c} is a nice number... {c}, ")
        own = first.removeprefix(f"{common}{c} is a nice number... {c}, ")
        assert own.endswith(ASK)  # the first request's own text is its prefix, no question after it
        owns.add(own)
    assert len(owns) == 6
    # one key for every conversation: the common start is longer than affinity's 1,024 characters
    assert len(common) > 1024
    assert len({prompt_prefix("chat/completions", c.turns[0], 1024) for c in conversations}) == 1


def test_later_messages_are_a_short_request_of_the_conversations_own_and_carry_the_history(
    bench: ModuleType,
) -> None:
    hf = bench.hf_tokenizer(MODEL_DIR)
    conversation = bench.vllm_multi_turn(MODEL_DIR, 5, args(conversations=2))[1]
    for turn in conversation.turns[1:]:
        content = turn["messages"][0]["content"]
        assert content.startswith(f"1 is a nice number... {ASK}")
        assert 110 <= len(hf.encode(content, add_special_tokens=False)) <= 170  # 120-160 asked, a decode apart
        assert turn["max_tokens"] == 4 and turn["stream"] is True and "prompt_cache_key" not in turn
    first = conversation.next_body()
    conversation.answered(first, "a reply")
    second = conversation.next_body()
    assert second["messages"][:2] == [first["messages"][0], {"role": "assistant", "content": "a reply"}]
    assert second["messages"][2] == conversation.turns[1]["messages"][0]


def test_conversation_prefixes_are_lognormal_around_the_average_and_capped(bench: ModuleType) -> None:
    lengths = bench.lognormal_lengths(np.random.default_rng(3), 1000, 200, 2000)
    assert max(lengths) <= 2000 and min(lengths) > 0
    assert 900 < sum(lengths) / len(lengths) <= 1000  # scaled to the average, then capped
    assert sorted(lengths)[100] < 1000  # the median under the mean, as vLLM's median ratio (0.85) makes it
