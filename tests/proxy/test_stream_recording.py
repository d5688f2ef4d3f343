"""A pass-through stream recorded for a plugin (``ctx.record_stream``: the cache): ``StreamTap`` keeps its
whole events within a byte budget and hands them over at the end, as they came and, when read, parsed
once into the answer they add up to."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.pipeline.recordings import GRANT, RecordingPool
from gateway.proxy.stream_tap import StreamTap, output_events
from gateway.wire.streaming import SSEParser, payload_lines, whole_payloads

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m1", "choices": [choice]}


def worker_stream(words: list[str]) -> list[dict[str, Any]]:
    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": w}) for w in words]
    chunks.append(chunk({}, "stop"))
    chunks.append(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m1",
            "choices": [],
            "usage": USAGE,
        }
    )
    return chunks


def feed_torn(tap: StreamTap, raw: bytes, size: int) -> tuple[bytes, bytes]:
    """Feed ``raw`` in reads of ``size`` bytes (events torn across reads); (what went out, the held [DONE])."""
    out, done = b"", b""
    for at in range(0, len(raw), size):
        sent, held = tap.feed(raw[at : at + size])
        out += sent
        done = done or held
    return out + tap.flush(), done


@pytest.mark.parametrize("read_size", [7, 64, 100_000])
def test_the_recording_is_the_events_as_sent_and_adds_up_to_the_answer(read_size: int) -> None:
    chunks = worker_stream(["Hel", "lo", " there"])
    raw = b"".join(event(c) for c in chunks) + b"data: [DONE]\n\n"
    tap = StreamTap(strip=True, record=1 << 20)
    out, done = feed_torn(tap, raw, read_size)
    assert done == b"data: [DONE]\n\n"
    assert b'"usage"' not in out  # the client did not ask for it
    answer = tap.settlement(completed=True)
    assert answer.recorded == chunks  # the usage event kept for the recorder
    assert answer.json["choices"][0]["message"] == {"role": "assistant", "content": "Hello there"}
    assert answer.json["choices"][0]["finish_reason"] == "stop"
    assert answer.json["usage"] == USAGE and answer.json["object"] == "chat.completion"


def test_the_recording_is_parsed_only_when_a_plugin_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin that stores the events as they came (``recorded_events``) costs no parsing; reading the
    answer or ``recorded`` parses them once; an answer a plugin replaced has no events to keep."""
    import gateway.proxy.stream_tap as stream_tap

    parsed: list[bytes] = []
    add_up = stream_tap._add_up

    def counted(assembler: Any, events: bytes, chunks: Any) -> bool:
        parsed.append(events)
        return add_up(assembler, events, chunks)

    monkeypatch.setattr(stream_tap, "_add_up", counted)
    chunks = worker_stream(["Hel", "lo"])
    raw = b"".join(event(c) for c in chunks) + b"data: [DONE]\n\n"
    tap = StreamTap(strip=True, record=1 << 20)
    feed_torn(tap, raw, 64)
    answer = tap.settlement(completed=True)
    assert answer.recorded_events == b"\n".join(orjson.dumps(c) for c in chunks)
    assert answer.usage == USAGE  # the usage event read alone (billing)
    assert parsed == []
    assert answer.json["choices"][0]["message"]["content"] == "Hello"
    assert answer.recorded == chunks and answer.body == orjson.dumps(answer.json)
    assert len(parsed) == 1  # once, for all of them
    answer.replace_json({"usage": USAGE})
    assert answer.recorded_events is None and answer.json == {"usage": USAGE}


def test_past_its_budget_the_answer_is_still_assembled_without_its_events() -> None:
    words = [f"w{i} " for i in range(200)]
    raw = b"".join(event(c) for c in worker_stream(words)) + b"data: [DONE]\n\n"
    tap = StreamTap(strip=True, record=2_000)  # a tenth of the stream
    feed_torn(tap, raw, 512)
    answer = tap.settlement(completed=True)
    assert answer.recorded is None
    assert answer.json["choices"][0]["message"]["content"] == "".join(words)
    assert answer.json["usage"] == USAGE


def test_a_stream_that_did_not_complete_settles_with_its_usage_only() -> None:
    raw = b"".join(event(c) for c in worker_stream(["a", "b"]))  # no [DONE]: cut
    tap = StreamTap(strip=True, record=1 << 20)
    feed_torn(tap, raw, 64)
    answer = tap.settlement(completed=False)
    assert answer.recorded is None and answer.json == {"usage": USAGE}


def test_an_error_event_leaves_nothing_to_keep() -> None:
    chunks = worker_stream(["a"])[:2]
    raw = b"".join(event(c) for c in chunks) + event({"error": {"message": "boom", "code": 500}})
    tap = StreamTap(strip=False, record=1 << 20)
    feed_torn(tap, raw + b"data: [DONE]\n\n", 64)
    answer = tap.settlement(completed=True)
    assert answer.recorded_events is None  # not kept to be stored as they came
    assert answer.recorded is None and answer.json == {}


def test_an_event_that_is_not_json_is_found_when_the_answer_is_read() -> None:
    raw = event(worker_stream(["a"])[0]) + b"data: {not json\n\n" + b"data: [DONE]\n\n"
    tap = StreamTap(strip=False, record=1 << 20)
    feed_torn(tap, raw, 64)
    answer = tap.settlement(completed=True)
    assert answer.recorded is None and answer.json == {}


def test_an_error_event_past_the_budget_leaves_nothing_to_keep_either() -> None:
    chunks = worker_stream([f"w{i}" for i in range(50)])[:-2]
    raw = b"".join(event(c) for c in chunks) + event({"error": {"message": "boom", "code": 500}})
    tap = StreamTap(strip=False, record=300)
    feed_torn(tap, raw + b"data: [DONE]\n\n", 64)
    assert tap.settlement(completed=True).json == {}


def test_a_worker_that_ran_past_the_limit_is_not_recorded() -> None:
    """The client got a stream the gateway ended at max_tokens: not the worker's answer to keep."""
    raw = b"".join(event(c) for c in worker_stream(["a", "b", "c", "d"])) + b"data: [DONE]\n\n"
    tap = StreamTap(strip=True, limit=2, record=1 << 20)
    out, _ = feed_torn(tap, raw, 100_000)
    assert tap.limited and b'"finish_reason":"length"' in out
    assert tap.settlement(completed=True).recorded is None


def test_a_tap_without_a_recording_keeps_nothing() -> None:
    raw = b"".join(event(c) for c in worker_stream(["a"])) + b"data: [DONE]\n\n"
    tap = StreamTap(strip=False)
    out, _ = feed_torn(tap, raw, 64)
    assert b'"usage"' in out  # the client asked for it
    assert tap.settlement(completed=True).json == {"usage": USAGE}


def test_a_settlement_is_taken_once() -> None:
    raw = b"".join(event(c) for c in worker_stream(["a"])) + b"data: [DONE]\n\n"
    tap = StreamTap(strip=True, record=1 << 20)
    feed_torn(tap, raw, 64)
    assert tap.settlement(completed=True).recorded is not None
    assert tap.settlement(completed=True).recorded is None  # the events were handed over and let go


_MEMBERS = ("content", "reasoning", "reasoning_content", "tool_calls")


@settings(max_examples=300, deadline=None)
@given(
    deltas=st.lists(
        st.dictionaries(
            st.sampled_from(_MEMBERS),
            st.one_of(
                st.text(max_size=6), st.lists(st.just({"index": 0, "function": {"arguments": "{}"}}), max_size=2)
            ),
            max_size=2,
        ),
        max_size=5,
    ),
    legacy=st.lists(st.text(max_size=6), max_size=3),
)
def test_output_events_counts_the_members_that_carry_output(deltas: list[dict[str, Any]], legacy: list[str]) -> None:
    """Whatever the text holds (quotes, escapes, member names), a piece's count is the number of
    content, text, reasoning and tool-call members with something in them."""
    chat = [chunk({k: v if (k == "tool_calls") == isinstance(v, list) else [] for k, v in d.items()}) for d in deltas]
    completions = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in legacy]
    piece = b"".join(event(c) for c in chat + completions)
    expected = sum(1 for c in chat for v in c["choices"][0]["delta"].values() if v) + sum(1 for t in legacy if t)
    assert output_events(piece) == expected


_EVENTS = st.one_of(
    st.builds(lambda text: b"data: " + orjson.dumps({"t": text}), st.text(max_size=5)),
    st.builds(lambda text: b"data:" + orjson.dumps({"t": text}), st.text(max_size=5)),
    st.just(b": keep-alive"),
    st.just(b'event: x\ndata: {"a":1}'),
    st.just(b'data: {"a":\ndata: 1}'),
    st.just(b"data: [DONE]"),
)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(_EVENTS, max_size=6), end=st.sampled_from([b"\n\n", b"\r\n\n", b"\r\n\r\n"]))
def test_the_recordings_payloads_are_what_the_sse_parser_finds(events: list[bytes], end: bytes) -> None:
    """The recording splits whole events itself when each is one ``data: `` line, as workers write them,
    and hands anything else (CRLF line ends too) to ``SSEParser``: the payloads are the parser's either way."""
    whole = b"".join(e + end for e in events)
    assert whole_payloads(whole) == SSEParser().feed(whole)
    # joined one per line at once only when each is one "data: " line, as the parser would find them
    lines = payload_lines(whole)
    assert lines is None or lines == b"\n".join(SSEParser().feed(whole))
    worker_form = all(e.startswith(b"data: ") and b"\n" not in e for e in events) and end == b"\n\n"
    assert (lines is not None) == (worker_form and bool(events))


def reasoning_stream(thoughts: list[str], words: list[str]) -> list[dict[str, Any]]:
    """A reasoning model's stream as vLLM (0.32, installed here) writes it: the reasoning in deltas of
    their own under ``reasoning``, then the answer's content."""
    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"reasoning": t}) for t in thoughts]
    chunks += [chunk({"content": w}) for w in words]
    return [*chunks, chunk({}, "stop")]


@pytest.mark.parametrize("read_size", [9, 100_000])
def test_a_reasoning_stream_is_counted_kept_to_its_limit_and_recorded_with_its_reasoning(read_size: int) -> None:
    """Each reasoning delta is a generated token: counted against the limit and for the bill, and kept
    in the recorded answer under the name the worker used."""
    raw = b"".join(event(c) for c in reasoning_stream(["Let", " me", " see"], ["4", "2"])) + b"data: [DONE]\n\n"
    tap = StreamTap(strip=True, limit=5, record=1 << 20)
    feed_torn(tap, raw, read_size)
    assert not tap.limited and tap.completion_tokens() == 5
    message = tap.settlement(completed=True).json["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "42", "reasoning": "Let me see"}

    cut = StreamTap(strip=True, limit=2, record=1 << 20)
    out, _ = feed_torn(cut, raw, read_size)
    assert cut.limited and cut.completion_tokens() == 2
    assert b'"content":"4"' not in out and b'"finish_reason":"length"' in out


@pytest.mark.parametrize("read_size", [5, 64, 100_000])
def test_text_that_says_done_goes_out_as_the_worker_wrote_it(read_size: int) -> None:
    """The words "data: [DONE]" inside an event's text are not the end of the stream: the event goes out
    whole and in place, and only the worker's own [DONE] event is held for the settlement."""
    chunks = worker_stream(["SSE ends with data: [DONE]", " then", " data: [DONE]"])
    events = b"".join(event(c) for c in chunks)
    tap = StreamTap(strip=False, record=1 << 20)
    out, done = feed_torn(tap, events + b"data: [DONE]\n\n", read_size)
    assert out == events and done == b"data: [DONE]\n\n"
    answer = tap.settlement(completed=True).json["choices"][0]["message"]
    assert answer["content"] == "SSE ends with data: [DONE] then data: [DONE]"


def test_recordings_share_the_pools_room_and_give_it_back() -> None:
    """Two streams recorded at once within a pool that holds one: the first keeps its events, the second
    is added up into its answer (stored without its chunking), and both give their room back."""
    words = [f"w{i} " for i in range(300)]
    raw = b"".join(event(c) for c in worker_stream(words)) + b"data: [DONE]\n\n"
    pool = RecordingPool(len(raw) + 100)
    first = StreamTap(strip=True, record=1 << 20, recordings=pool)
    second = StreamTap(strip=True, record=1 << 20, recordings=pool)
    for at in range(0, len(raw), 512):  # interleaved, as concurrent streams are
        first.feed(raw[at : at + 512])
        second.feed(raw[at : at + 512])
    assert pool.left < 100 + GRANT
    kept, added_up = first.settlement(completed=True), second.settlement(completed=True)
    assert kept.recorded_events is not None and added_up.recorded_events is None
    for answer in (kept, added_up):
        assert answer.json["choices"][0]["message"]["content"] == "".join(words)
        assert answer.json["usage"] == USAGE
    assert pool.left == pool.total


def test_a_stream_left_mid_way_gives_its_room_back() -> None:
    pool = RecordingPool(1 << 20)
    tap = StreamTap(strip=True, record=1 << 20, recordings=pool)
    tap.feed(b"".join(event(c) for c in worker_stream(["a", "b"])[:2]))
    assert pool.left < pool.total
    del tap  # the client left: no settlement
    assert pool.left == pool.total
