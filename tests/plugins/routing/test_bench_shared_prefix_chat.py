"""bench/bench_routing.py's ``shared_prefix_chat`` workload builds inference-perf's shared-prefix chat as
its generator does: the group's system prompt starts every session's every round, a round carries the
session's whole context (the last prompt and its answer), and one group's sessions share prefix
affinity's key, so the workload tests what it claims to (affinity gives a group one home worker)."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

from plugins.routing.policies import prompt_prefix
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[3]
MODEL_DIR = REPO / "models" / "smollm2"

pytestmark = pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="the default model is not prepared (models/smollm2)")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(REPO / "bench" / "bench_routing.py")


def args(**overrides: int | bool) -> argparse.Namespace:
    values = {"system_blocks": 2, "sessions": 6, "rounds": 3, "question_tokens": 24, "max_tokens": 4}
    values["cache_key"] = False
    return argparse.Namespace(**{**values, **overrides})


def test_each_group_prompt_is_exactly_its_blocks_and_starts_every_session(bench: ModuleType) -> None:
    hf = bench.hf_tokenizer(MODEL_DIR)
    sessions = bench.shared_prefix_chat(MODEL_DIR, 2, 7, args())
    assert len(sessions) == 6
    contexts = Counter(s.context for s in sessions)
    assert sorted(contexts.values()) == [3, 3]  # the sessions split evenly over the two groups
    for context in contexts:
        assert len(hf.encode(context, add_special_tokens=False)) == 2 * bench.BLOCK_TOKENS
    for session in sessions:
        first = session.next_body()
        # context, a space, then the session's prompt: the group prompt again and the question
        assert first["prompt"].startswith(session.context + " " + session.context[:40])
        assert first["max_tokens"] == 4 and first["stream"] is True


def test_a_round_carries_the_last_prompt_and_its_answer(bench: ModuleType) -> None:
    session = bench.shared_prefix_chat(MODEL_DIR, 1, 3, args(sessions=1))[0]
    question = session.turns[0]["prompt"]
    first = session.next_body()
    session.answered(first, "the answer")
    second = session.next_body()
    assert second["prompt"] == f"{first['prompt']} the answer {question}"
    session.answered(second, "another")
    third = session.next_body()
    assert third["prompt"].startswith(second["prompt"] + " another ")
    session.answered(third, "last")
    assert session.done


def test_one_groups_sessions_share_affinitys_key_and_groups_differ(bench: ModuleType) -> None:
    sessions = bench.shared_prefix_chat(MODEL_DIR, 2, 11, args())
    keys = Counter(prompt_prefix("completions", s.next_body(), 1024) for s in sessions)
    assert sorted(keys.values()) == [3, 3]


def test_the_same_seed_gives_the_same_prompts(bench: ModuleType) -> None:
    one = [s.next_body()["prompt"] for s in bench.shared_prefix_chat(MODEL_DIR, 2, 5, args())]
    two = [s.next_body()["prompt"] for s in bench.shared_prefix_chat(MODEL_DIR, 2, 5, args())]
    other = [s.next_body()["prompt"] for s in bench.shared_prefix_chat(MODEL_DIR, 2, 6, args())]
    assert one == two != other


def test_with_cache_keys_each_session_sends_its_own_key_every_round(bench: ModuleType) -> None:
    assert all("prompt_cache_key" not in s.next_body() for s in bench.shared_prefix_chat(MODEL_DIR, 1, 5, args()))
    sessions = bench.shared_prefix_chat(MODEL_DIR, 1, 5, args(cache_key=True))
    keys = []
    for session in sessions:
        body = session.next_body()
        session.answered(body, "an answer")
        assert session.next_body()["prompt_cache_key"] == body["prompt_cache_key"]
        keys.append(body["prompt_cache_key"])
    assert len(set(keys)) == len(sessions) == 6
