"""The request's own completion limit, kept by the gateway whatever the worker does.

A worker that ignores ``max_tokens`` (a bug, a misconfigured engine, a hostile one) must not make a
tenant receive, or pay for, more than it asked: a stream is ended at the limit with ``finish_reason:
"length"`` (the parsed relay always; the byte pass-through whenever a plugin bills the stream, which is
when its bytes are tapped anyway: an unbilled pass-through stays untouched, at no cost per read), and
tenancy never charges more completion tokens than the request allowed. A worker that honours the limit
never meets this code: it ends the answer itself at exactly the limit.

The limit is ``max_completion_tokens`` (else ``max_tokens``) times ``n`` times the prompts a completions
request batches (a chat request is one prompt, whatever else it carries), over all choices together: one
choice may then run past its own share while another stops short, which costs the tenant nothing more.
"""

from __future__ import annotations

from typing import Any

from gateway.pipeline.context import RequestContext
from gateway.wire.chat_answer import count
from gateway.wire.completion_bound import most_completion_tokens
from gateway.wire.protocol import requested_completion_tokens

_GENERATING = frozenset({"chat/completions", "completions"})


def completion_limit(ctx: RequestContext) -> int | None:
    """The most completion tokens the client may be sent for ``ctx`` (None: the request sets no limit)."""
    return requested_completion_tokens(ctx.endpoint, ctx.body) if ctx.endpoint in _GENERATING else None


def length_end(first: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    """The chunk that ends choices ``indices`` at the limit, in the shape of the stream's chunk ``first``."""
    chat = str(first.get("object", "chat.completion.chunk")).startswith("chat")
    choices = []
    for index in indices:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": "length"}
        if chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choices.append(choice)
    meta: dict[str, Any] = {key: first[key] for key in ("id", "object", "created", "model") if key in first}
    return {**meta, "choices": choices}


def cap_answer(answer: dict[str, Any], limit: int) -> bool:
    """An answer whose usage says the worker ran past ``limit``: cut each choice's text to its share of
    the limit, end it with ``finish_reason: "length"`` and report ``limit`` completion tokens. Without a
    tokenizer on the request path the cut is by the text's share of the tokens (within a token or two of
    the true boundary). A count the answer's output cannot hold (``most_completion_tokens``: 10^9 tokens in
    20 characters) is no count: it cuts nothing (by it the answer would be cut to nothing, and billed the
    whole limit), and billing counts the text instead. Returns whether it changed anything."""
    usage = answer.get("usage")
    completion = count(usage.get("completion_tokens")) if isinstance(usage, dict) else None
    # the bound is read only for a count past the limit: most answers stop within it
    if completion is None or completion <= limit or completion > most_completion_tokens(answer):
        return False
    share = limit / completion
    for choice in answer.get("choices") or ():
        message = choice.get("message")
        holder, key = (message, "content") if isinstance(message, dict) else (choice, "text")
        text = holder.get(key)
        if isinstance(text, str):
            holder[key] = text[: int(len(text) * share)]
        choice["finish_reason"] = "length"
    assert isinstance(usage, dict)
    usage["completion_tokens"] = limit
    if isinstance(usage.get("prompt_tokens"), int):
        usage["total_tokens"] = usage["prompt_tokens"] + limit
    return True
