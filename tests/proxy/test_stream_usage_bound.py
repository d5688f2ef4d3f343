"""A pass-through stream's usage is believed only up to what its events can hold: ``StreamTap`` checks the
usage event's completion count against the bytes of the events before it (every token is at least one
byte of an event that carried it), plus a few special tokens per choice; past that it keeps no usage
(the tokens sent are billed) and hands no recording over (a stored answer would replay the claim). The
client that asked for the usage event gets it as the worker sent it."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.proxy.stream_tap import StreamTap
from gateway.wire.completion_bound import SPECIAL_PER_CHOICE, holds_its_count
from tests.proxy.test_stream_recording import chunk, event, feed_torn, worker_stream


def _usage(completion: int) -> dict[str, Any]:
    return {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}


def _stream(completion: int) -> tuple[bytes, int]:
    """A worker's stream of "Hello there" ending with a usage of ``completion`` tokens, and the most its
    events before that usage can hold."""
    chunks = worker_stream(["Hel", "lo", " there"])
    chunks[-1]["usage"] = _usage(completion)
    before = b"".join(event(c) for c in chunks[:-1])
    return before + event(chunks[-1]) + b"data: [DONE]\n\n", len(before) + SPECIAL_PER_CHOICE


@pytest.mark.parametrize("read_size", [7, 64, 100_000])
@pytest.mark.parametrize("strip", [False, True])
def test_a_count_the_events_can_hold_is_kept_with_the_recording(read_size: int, strip: bool) -> None:
    _, most = _stream(0)
    raw, _ = _stream(most)
    tap = StreamTap(strip=strip, record=1 << 20)
    out, done = feed_torn(tap, raw, read_size)
    assert done == b"data: [DONE]\n\n" and (b'"usage"' in out) is not strip
    assert tap.usage == _usage(most) and tap.completion_tokens() == most
    answer = tap.settlement(completed=True)
    assert answer.recorded is not None and answer.usage == _usage(most)


@pytest.mark.parametrize("read_size", [7, 64, 100_000])
@pytest.mark.parametrize("strip", [False, True])
@pytest.mark.parametrize("past", [1, 10**9])
def test_a_count_past_what_the_events_hold_is_no_usage_and_no_recording(read_size: int, strip: bool, past: int) -> None:
    _, most = _stream(0)
    raw, _ = _stream(most + past)
    tap = StreamTap(strip=strip, record=1 << 20)
    out, done = feed_torn(tap, raw, read_size)
    assert done == b"data: [DONE]\n\n"
    assert (b'"usage"' in out) is not strip  # the client's event as the worker sent it, when it asked
    assert tap.usage is None and tap.completion_tokens() == 3  # the events that carried text
    answer = tap.settlement(completed=True)
    assert answer.recorded is None and answer.json == {}


def test_a_usage_on_an_event_with_output_counts_that_events_bytes_too() -> None:
    """vLLM's ``continuous_usage_stats``: each event carries the usage so far, its own tokens included."""
    head = event(chunk({"role": "assistant", "content": ""}))
    last = chunk({"content": "Hi"})
    last["usage"] = _usage(0)
    own = len(event(last))  # ~200 bytes: the counts below do not change it by 50
    for completion, believed in ((len(head) + SPECIAL_PER_CHOICE + 50, True), (len(head) + own + 50, False)):
        last["usage"] = _usage(completion)
        tap = StreamTap(strip=False)
        tap.feed(head + event(last))
        assert (tap.usage is not None) is believed


def test_an_answer_holds_a_count_up_to_its_outputs_bytes_and_special_tokens() -> None:
    choice = {"index": 0, "message": {"role": "assistant", "content": "é" * 4}, "finish_reason": "stop"}
    most = 8 + SPECIAL_PER_CHOICE
    assert holds_its_count({"choices": [choice], "usage": _usage(most)})
    assert not holds_its_count({"choices": [choice], "usage": _usage(most + 1)})
    assert holds_its_count({"choices": [choice]})  # no count: nothing to disbelieve
    assert holds_its_count({"choices": [choice], "usage": _usage(-1)})  # not a count (``count``)
