"""The parsed relay: a stream whose chunks plugins read (``on_chunk``) or whose assembled result they
check (``on_response``), event by event.

It consumes an ``AnswerStream`` (``gateway.proxy.answer``), so a failover to another worker is invisible
here: the continuation's chunks arrive already rewritten into this stream's and go through the same hooks
and assembler. What went out is kept current in ``ctx.delivered`` however the stream ends, for billing.
A completed stream is an answer: a completion count its assembled output cannot hold
(``gateway.wire.completion_bound``) is no count, as in a JSON answer, and reaches no plugin (the tokens
sent are billed); the client got the worker's usage event as it came.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import orjson

from gateway.ops.metrics import Metrics
from gateway.pipeline.context import Delivered, ModelResponse, RequestContext
from gateway.proxy.answer import (
    AnswerFailed,
    AnswerStream,
    cut_short,
    ending_event,
    error_event,
    is_error_event,
    not_json,
)
from gateway.proxy.passthrough import observe_decoding, observe_first_token
from gateway.proxy.token_limit import completion_limit, length_end
from gateway.wire.completion_bound import holds_its_count
from gateway.wire.errors import GatewayError
from gateway.wire.streaming import DONE, SSEParser, StreamAssembler, delta_tokens, encode_event

#: How a stream's events ended before the worker's bytes did: ``[DONE]``, the worker's error event, or
#: a chunk hook that closed the stream.
_DONE, _ERROR, _CLOSED = "done", "error", "closed"


class InspectedRelay:
    """One parsed stream. ``on_end(ok)`` runs once when it is over (``ok``: it completed)."""

    __slots__ = (
        "_assembler",
        "_count_usage",
        "_ctx",
        "_end",
        "_first_at",
        "_has_hooks",
        "_limit",
        "_metrics",
        "_on_end",
        "_steps",
        "_tokens",
    )

    def __init__(
        self,
        ctx: RequestContext,
        metrics: Metrics,
        count_usage: Callable[[RequestContext, Any], None],
        on_end: Callable[[bool], None],
    ) -> None:
        self._ctx = ctx
        self._metrics = metrics
        self._count_usage = count_usage
        self._on_end = on_end
        self._has_hooks = bool(ctx.snapshot.pipeline.chunk_plugins)
        self._assembler = StreamAssembler()
        self._end: str | None = None
        self._first_at = 0.0
        self._steps = 0  # events after the first: decoding steps
        self._tokens = 0  # the worker's tokens in the events that went out
        self._limit = completion_limit(ctx)  # kept here too: a worker may ignore the request's max_tokens

    async def relay(self, answer: AnswerStream) -> AsyncIterator[bytes]:
        """The client's SSE bytes: the events as the hooks left them, then ``[DONE]`` once the assembled
        answer passed ``on_response``, or one error event."""
        ctx = self._ctx
        # The billing hook: what went out so far, kept current however the stream ends.
        sent = ctx.delivered = Delivered(stream_tokens=0, complete=False)
        parser = SSEParser()
        ok = False
        try:
            async for raw in answer.pieces():
                # What one read of the worker produced goes out as one piece: a gateway that fell behind
                # catches up with fewer, larger writes.
                out = await self._events(parser.feed(raw))
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
                    sent.stream_tokens, sent.usage = self._tokens, self._assembler.usage
                if self._end is not None:
                    break
            if self._end == _ERROR:
                return
            if not (self._assembler.complete or ctx.close_stream):
                yield ending_event(ctx, cut_short())
                return
            ok = sent.complete = True
            yield await self._complete()
        except AnswerFailed as failed:
            yield ending_event(ctx, failed.error)
        except GatewayError as error:  # a hook's refusal
            yield ending_event(ctx, error)
        except orjson.JSONDecodeError:
            yield ending_event(ctx, not_json())
        finally:
            answer.close()
            self._on_end(ok)

    async def _events(self, payloads: Iterable[bytes]) -> list[bytes]:
        """The bytes to send for the events of one read; sets ``_end`` when the events ended."""
        ctx = self._ctx
        out: list[bytes] = []
        for payload in payloads:
            if payload == b"[DONE]":
                self._end = _DONE
                break
            chunk = orjson.loads(payload)
            if is_error_event(chunk):
                out.append(ending_event(ctx, error_event(payload, chunk)))
                self._end = _ERROR
                break
            tokens = delta_tokens(chunk)
            limited = self._limit is not None and self._tokens + tokens > self._limit
            if limited:  # past the request's max_tokens: the answer ends here, as a worker would end it
                chunk, tokens = self._length_end(chunk), 0
                payload = orjson.dumps(chunk)
            self._observe(chunk, tokens)
            if not self._has_hooks:
                out.append(b"data: " + payload + b"\n\n")
            else:
                changed = await ctx.snapshot.pipeline.run_chunk(ctx, chunk)
                if changed is not None:
                    out.append(encode_event(changed))
            if limited or ctx.close_stream:
                self._end = _CLOSED
                break
        return out

    def _length_end(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The chunk that ends every unfinished choice with ``finish_reason: "length"`` at the limit."""
        self._ctx.log["cut_at_max_tokens"] = self._limit
        unfinished = [i for i, c in self._assembler.choices.items() if c.get("finish_reason") is None]
        return length_end(chunk, unfinished or [c.get("index", 0) for c in chunk.get("choices") or ()])

    def _observe(self, chunk: dict[str, Any], tokens: int) -> None:
        self._assembler.add(chunk)
        if not self._first_at:
            self._first_at = time.perf_counter()
            observe_first_token(self._metrics, self._ctx, self._first_at)
        else:
            self._steps += 1
        # The worker's tokens, counted as sent with the next piece that goes out (a chunk hook may hold
        # text back and release it merged into a later chunk).
        self._tokens += tokens

    async def _complete(self) -> bytes:
        """The stream completed: the assembled answer through ``on_response``, then ``[DONE]``."""
        ctx = self._ctx
        observe_decoding(self._metrics, ctx, time.perf_counter() - self._first_at, self._steps)
        result = self._assembler.result()
        if not holds_its_count(result):  # a faulty or hostile worker's claim (its event went out as it came)
            del result["usage"]
            assert ctx.delivered is not None
            ctx.delivered.usage = None
        self._count_usage(ctx, result.get("usage"))
        await ctx.snapshot.pipeline.run_response(ctx, ModelResponse(json=result))
        return DONE
