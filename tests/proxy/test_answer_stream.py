"""AnswerStream, the one source both relays read, on canned answers from the in-process fake transport
(no sockets): pulled or pushed, the bytes are the worker's; a stream cut without a way to continue ends
in one AnswerFailed carrying the client-facing error; a resumable one only ever lets whole events out."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.proxy.answer import AnswerFailed, AnswerStream
from gateway.upstream.client import UpstreamClient, UpstreamConfig, UpstreamResponse
from tests.support.transport import FakeTransport, Scripted, chat_events


async def open_script(script: Scripted) -> UpstreamResponse:
    client = UpstreamClient(UpstreamConfig(), FakeTransport(lambda url, body: script))
    return await client.open("http://w1", "/v1/chat/completions", b"{}")


async def pulled(answer: AnswerStream) -> bytes:
    return b"".join([piece async for piece in answer.pieces()])


async def pushed(answer: AnswerStream) -> bytes:
    out: list[bytes] = []
    await answer.relay(lambda piece: out.append(piece) is None, asyncio.sleep)
    return b"".join(out)


@pytest.mark.parametrize("read", [pulled, pushed])
async def test_a_whole_stream_is_the_workers_bytes(read: object) -> None:
    events = chat_events("one two three")
    answer = AnswerStream(await open_script(Scripted(pieces=events)), None)
    assert await read(answer) == b"".join(events)  # type: ignore[operator]
    assert answer.ok


@pytest.mark.parametrize("read", [pulled, pushed])
@pytest.mark.parametrize("after", ["reset", "idle", None])
async def test_a_cut_stream_ends_in_one_failure_after_what_came(read: object, after: str | None) -> None:
    events = chat_events("one two three")[:3]  # no finish, no [DONE]
    answer = AnswerStream(await open_script(Scripted(pieces=events, after=after)), None)  # type: ignore[arg-type]
    got: list[bytes] = []

    async def collect() -> None:
        if read is pulled:
            async for piece in answer.pieces():
                got.append(piece)
        else:
            await answer.relay(lambda piece: got.append(piece) is None, asyncio.sleep)

    with pytest.raises(AnswerFailed) as failed:
        await collect()
    assert b"".join(got) == b"".join(events)
    expected = {"reset": "upstream_error", "idle": "upstream_timeout", None: "stream_incomplete"}[after]
    assert failed.value.error.code == expected
    assert not answer.ok


async def test_the_done_mark_split_across_reads_is_seen() -> None:
    events = b"".join(chat_events("one two"))
    torn = [events[:-8], events[-8:]]  # "data: [DONE]" arrives in two reads
    answer = AnswerStream(await open_script(Scripted(pieces=torn)), None)
    assert await pulled(answer) == events
    assert answer.ok


def _said(text: str) -> bytes:
    """A content event whose text is ``text`` (one delta can carry several tokens: speculative decoding,
    a stream interval)."""
    chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": "m1"}
    chunk["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


@pytest.mark.parametrize("read", [pulled, pushed])
async def test_a_stream_cut_after_its_text_says_done_is_still_cut(read: object) -> None:
    """An answer that explains SSE ends its last event with the words "data: [DONE]": the worker that
    went away there did not finish it."""
    events = [*chat_events("one")[:2], _said("The stream ends with data: [DONE]")]
    answer = AnswerStream(await open_script(Scripted(pieces=events)), None)
    with pytest.raises(AnswerFailed) as failed:
        await read(answer)  # type: ignore[operator]
    assert failed.value.error.code == "stream_incomplete" and not answer.ok


async def test_a_stream_that_is_only_the_done_event_ended_well() -> None:
    answer = AnswerStream(await open_script(Scripted(pieces=[b"data: [DONE]\n\n"])), None)
    assert await pulled(answer) == b"data: [DONE]\n\n"
    assert answer.ok
