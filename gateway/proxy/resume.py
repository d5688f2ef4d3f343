"""Mid-stream failover: when the worker serving a stream fails after bytes reached the client, the same
answer is continued on another healthy worker of the model, and the client sees one stream.

- ``resumable(ctx, limit, has_alternative)``: whether this request's stream could be continued at all
  (decided once, when the stream starts; the relays then keep what they need to continue it, and nothing
  otherwise).
- ``Progress``: what the client was sent (text, token count, tool-call deltas, the first chunk's
  ``id``/``created``/``model``, whether a ``finish_reason`` went out).
- ``continuation_body(ctx, progress)``: the request that asks a worker to go on from there. Chat: the
  conversation plus the partial assistant message as the last message with vLLM's
  ``continue_final_message: true`` and ``add_generation_prompt: false``; legacy completions: the prompt
  plus the text so far; both with the remaining ``max_tokens``/``max_completion_tokens``.
- ``Continuation``: rewrites the new worker's chunks so that they continue the first stream: the first
  stream's ``id``/``created``/``model``, no second role delta, and a usage chunk that counts every
  completion token the client received and the request's prompt once. The continuing worker's prompt
  holds the text already sent, retokenized, which need not be as many tokens as were generated; so the
  request's own prompt is counted by that worker's ``/tokenize`` while the continuation streams, and the
  usage chunk waits for it (the count takes at most ``COUNT_WAIT_S``; without it, the continuation's
  prompt minus the tokens sent, which can be off by the retokenization's difference).

What is not continued (the stream ends as before, with one error event and ``[DONE]``): ``n > 1``,
``best_of``, beam search, ``echo``/``suffix``, legacy-completion ``logprobs`` (their text offsets),
``prompt_logprobs``, prompts given as token ids or several prompts, guided decoding (including
``tool_choice`` ``"required"`` or a named function, which vLLM enforces that way; the engine applies a
grammar to generated tokens only, so a continuation would start the grammar over), a stream that was
already sending tool-call deltas, and one that was already sending a reasoning model's thinking (the
partial assistant message cannot carry it back: the chat template renders it without the thinking, or
drops it, and vLLM's reasoning parser would take the continuation's text for thinking again). Errors are
passed around as data (reason strings and ``GatewayError`` values that are not raised from a frame),
never as exception objects kept in long-lived structures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.ops.metrics import Metrics
from gateway.pipeline.context import RequestContext
from gateway.upstream.client import UpstreamClient, UpstreamResponse
from gateway.wire.errors import GatewayError
from gateway.wire.streaming import REASONING_FIELDS, SSEParser, wants_usage

log = logging.getLogger("gateway.proxy")

_GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")

#: Opens the continuation on another worker: (reason, error, body) -> the new worker's response, or None
#: when no other healthy worker may take it (the stream then ends with ``error``).
Reopen = Callable[[str, GatewayError, bytes], Awaitable[UpstreamResponse | None]]
#: How long counting a resumed stream's prompt may take (then its usage chunk uses the estimate).
COUNT_WAIT_S = 2.0
#: The fields of a request that vLLM's ``/tokenize`` renders the same way as the request itself.
_TOKENIZE_FIELDS = {
    "chat/completions": (
        "model",
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "media_io_kwargs",
    ),
    "completions": ("model", "prompt", "add_special_tokens"),
}


def resumable(ctx: RequestContext, limit: int, has_alternative: bool) -> bool:
    """Whether a cut stream of this request can be continued elsewhere: a chat or legacy-completions
    stream with one choice, nothing that a continuation would change, resumptions allowed, and another
    healthy worker of the model to continue on (``has_alternative``, the route plan's view)."""
    if limit <= 0 or not ctx.stream or not has_alternative:
        return False
    body = ctx.body
    if ctx.endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return False
        if body.get("continue_final_message") and not isinstance(messages[-1].get("content"), str):
            return False
        tool_choice = body.get("tool_choice")
        if tool_choice == "required" or isinstance(tool_choice, dict):  # enforced by guided decoding
            return False
    elif ctx.endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                return False
        elif not isinstance(prompt, str):
            return False
        if body.get("echo") or body.get("suffix") or body.get("logprobs") is not None:
            return False
    else:
        return False
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1 or body.get("use_beam_search"):
        return False
    if body.get("prompt_logprobs") is not None:
        return False
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return False
    return not any(body.get(key) is not None for key in _GUIDED_KEYS)


class Progress:
    """What the client has been sent so far of one stream (one choice)."""

    __slots__ = ("chat", "created", "finished", "id", "model", "pieces", "thinking", "tokens", "tool_calls")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.pieces: list[str] = []
        # chunks that carried generated text: vLLM sends one per decoding step (a stream that sent tool
        # calls or thinking is not continued, so only its text needs counting)
        self.tokens = 0
        self.tool_calls = False
        self.thinking = False  # a reasoning model's thinking went out
        self.finished = False
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None

    @property
    def started(self) -> bool:
        return self.id is not None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, chunk: dict[str, Any]) -> None:
        if self.id is None and "id" in chunk:
            self.id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        for choice in chunk.get("choices") or ():
            if self.chat:
                delta = choice.get("delta") or {}
                piece = delta.get("content")
                if delta.get("tool_calls"):
                    self.tool_calls = True
                for name in REASONING_FIELDS:
                    if delta.get(name):
                        self.thinking = True
            else:
                piece = choice.get("text")
            if piece:
                self.pieces.append(piece)
                self.tokens += 1
            if choice.get("finish_reason") is not None:
                self.finished = True

    def add_events(self, data: bytes) -> None:
        """Complete SSE events as the client received them (the pass-through path keeps the bytes and
        parses them only when a stream is cut)."""
        parser = SSEParser()
        for payload in parser.feed(data):
            if payload == b"[DONE]":
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(chunk, dict):
                self.add(chunk)


def continuation_body(ctx: RequestContext, progress: Progress) -> dict[str, Any] | None:
    """The request that continues the answer after ``progress`` (None: the token limit is already
    reached, so the answer ends with ``finish_reason: length``)."""
    body = dict(ctx.body)
    for key in _TOKEN_LIMITS:
        limit = body.get(key)
        if isinstance(limit, int):
            if limit - progress.tokens <= 0:
                return None
            body[key] = limit - progress.tokens
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        body["min_tokens"] = max(0, min_tokens - progress.tokens)
    if not progress.started:
        return body
    text = progress.text
    if ctx.endpoint == "chat/completions":
        messages = list(body["messages"])
        last = messages[-1] if messages else {}
        if body.get("continue_final_message") and last.get("role") == "assistant":
            messages[-1] = {**last, "content": last.get("content", "") + text}
        else:
            messages.append({"role": "assistant", "content": text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        body["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
    return body


def tokenize_body(ctx: RequestContext) -> bytes:
    """The ``/tokenize`` request that counts this request's own prompt as its worker would."""
    body = ctx.body
    out = {key: body[key] for key in _TOKENIZE_FIELDS[ctx.endpoint] if body.get(key) is not None}
    prompt = out.get("prompt")
    if isinstance(prompt, list):  # resumable only with one string prompt
        out["prompt"] = prompt[0]
    return orjson.dumps(out)


class Continuation:
    """Rewrites a continuing worker's chunks into the first stream's (and keeps ``progress`` current)."""

    __slots__ = ("_first_tokens", "_prompt_count", "_prompt_tokens", "progress")

    def __init__(self, progress: Progress, prompt_count: asyncio.Task[int | None] | None = None) -> None:
        self.progress = progress
        self._first_tokens = progress.tokens  # what the client had received before this continuation
        # The request's own prompt, counted by the continuing worker: a task bounded by COUNT_WAIT_S that
        # never raises, so one left behind by a continuation that failed too ends by itself.
        self._prompt_count = prompt_count
        self._prompt_tokens: int | None = None

    async def rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk as the client should see it, or None to drop it (the continuation's role delta)."""
        progress = self.progress
        if self._prompt_count is not None and isinstance(chunk.get("usage"), dict):
            self._prompt_tokens = await self._prompt_count
            self._prompt_count = None
        if progress.started:
            chunk["id"], chunk["created"], chunk["model"] = progress.id, progress.created, progress.model
            if progress.chat and not _without_role(chunk):
                return None
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            chunk["usage"] = self._usage(usage)
        progress.add(chunk)
        return chunk

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Prompt tokens counted once (the request's own prompt, as the continuing worker counted it; else
        the continuation's prompt less the tokens already sent), completion tokens = what was sent before +
        what the continuation generated."""
        before = self._first_tokens
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        out = dict(usage)
        if self._prompt_tokens is not None:
            out["prompt_tokens"] = self._prompt_tokens
        elif isinstance(prompt, int):
            out["prompt_tokens"] = max(0, prompt - before)
        if isinstance(completion, int):
            out["completion_tokens"] = completion + before
        if isinstance(out.get("prompt_tokens"), int) and isinstance(out.get("completion_tokens"), int):
            out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        out.pop("prompt_tokens_details", None)  # cached-prefix counts of the continuation, not the request
        return out

    def length_end(self) -> dict[str, Any]:
        """The last chunk when the token limit was reached exactly at the cut: ``finish_reason: length``."""
        progress = self.progress
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if progress.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        obj = "chat.completion.chunk" if progress.chat else "text_completion"
        progress.finished = True
        chunk = {"id": progress.id, "object": obj, "created": progress.created, "model": progress.model}
        return {**chunk, "choices": [choice]}


class Resumer:
    """One request's resumptions: the progress so far, the count, and the way to the next worker."""

    __slots__ = ("_ctx", "_limit", "_metrics", "_reopen", "_upstream", "progress")

    def __init__(
        self, ctx: RequestContext, limit: int, reopen: Reopen, upstream: UpstreamClient, metrics: Metrics
    ) -> None:
        self._ctx = ctx
        self._limit = limit
        self._reopen = reopen
        self._upstream = upstream  # counts the prompt on the continuing worker
        self._metrics = metrics
        self.progress = Progress(chat=ctx.endpoint == "chat/completions")

    async def resume(self, reason: str, error: GatewayError) -> tuple[UpstreamResponse | None, Continuation | None]:
        """After a failure (``reason``: reset | idle | eof): the continuing worker's response and the
        rewriter for its chunks; (None, continuation) when the answer ends here without another worker
        (the token limit was reached: ``continuation.length_end()``); (None, None) when it cannot be
        continued (the caller ends the stream with ``error`` as before)."""
        ctx, progress = self._ctx, self.progress
        if ctx.resumed >= self._limit or progress.finished or progress.tool_calls or progress.thinking:
            return None, None
        body = continuation_body(ctx, progress)
        if body is None:
            return None, Continuation(progress)
        failed = ctx.worker.url if ctx.worker is not None else "?"
        upstream = await self._reopen(reason, error, orjson.dumps(body))
        if upstream is None:
            return None, None
        ctx.resumed += 1
        previous = ctx.log.get("resumed_from")
        ctx.log["resumed_from"] = failed if previous is None else f"{previous},{failed}"
        self._metrics.stream_resumptions.labels(ctx.model.name, reason).inc()
        worker = ctx.worker.url if ctx.worker is not None else "?"
        log.warning(
            "request %s: stream from %s failed (%s) after %d tokens; continuing on %s",
            ctx.request_id,
            failed,
            reason,
            progress.tokens,
            worker,
        )
        counting = None
        if ctx.worker is not None and wants_usage(ctx.body):
            count = self._upstream.count_tokens(ctx.worker.url, tokenize_body(ctx), COUNT_WAIT_S)
            counting = asyncio.create_task(count)
        return upstream, Continuation(progress, counting)


def _without_role(chunk: dict[str, Any]) -> bool:
    """Drop the continuation's role from its deltas (the client had one already); False when that leaves
    the chunk with nothing to say (then it is not sent)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" not in delta:
            continue
        del delta["role"]
        empty = not delta.get("content") and len(delta) <= 1 and choice.get("finish_reason") is None
        if empty and not choice.get("logprobs") and not chunk.get("usage"):
            return False
    return True


def reason_of(kind: str | None) -> str:
    """A metric label for how a stream failed: an ``UpstreamFailure.kind`` or None (ended without
    ``[DONE]``)."""
    if kind is None:
        return "eof"
    return "idle" if kind == "timeout" else "reset"
