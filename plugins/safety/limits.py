"""Request-shape limits: body bytes, messages, prompt characters and tokens, max_tokens, n, tools and
JSON nesting depth. Each failure is a 400 whose ``param`` names the field to change.

Prompt tokens are counted with the model's own tokenizer (``tokenizers``, off the event loop), and
only when the prompt could be over the limit: a byte-level tokenizer never makes more tokens than the
text has UTF-8 bytes (+1 for a leading marker), so a prompt of at most ``max_prompt_tokens - 1`` bytes
is never counted. The count covers the prompt text, not the chat template's own tokens. A prompt given
as token ids counts one token per id, without the tokenizer.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tokenizers import Tokenizer

from gateway.wire.errors import InvalidRequest, ServiceUnavailable
from plugins.safety.config import LimitsConfig


def limit_error(message: str, param: str, *, code: str = "limit_exceeded") -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def check_shape(limits: LimitsConfig, body: dict[str, Any], raw_body: bytes, content_param: str) -> None:
    """The limits that need no text: raise ``InvalidRequest`` naming the field."""
    if limits.max_body_bytes is not None and len(raw_body) > limits.max_body_bytes:
        raise limit_error(
            f"The request body is {len(raw_body)} bytes; this model accepts at most {limits.max_body_bytes}.",
            content_param,
            code="request_too_large",
        )
    messages = body.get("messages")
    if limits.max_messages is not None and isinstance(messages, list) and len(messages) > limits.max_messages:
        raise limit_error(
            f"The request has {len(messages)} messages; this model accepts at most {limits.max_messages}.", "messages"
        )
    if limits.max_tokens is not None:
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and value > limits.max_tokens:
                raise limit_error(f"'{name}' is {value}; this model allows at most {limits.max_tokens}.", name)
    n = body.get("n")
    if limits.max_n is not None and isinstance(n, int) and n > limits.max_n:
        raise limit_error(f"'n' is {n}; this model allows at most {limits.max_n}.", "n")
    tools = body.get("tools")
    if limits.max_tools is not None and isinstance(tools, list) and len(tools) > limits.max_tools:
        raise limit_error(f"The request has {len(tools)} tools; this model allows at most {limits.max_tools}.", "tools")
    if limits.max_json_depth is not None:
        _check_depth(body, raw_body, limits.max_json_depth)


def _check_depth(body: dict[str, Any], raw: bytes, limit: int) -> None:
    # Every nesting level opens a bracket: fewer brackets than the limit cannot nest deeper (C-speed count).
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    for key, value in body.items():
        if _deeper_than(value, limit, start=2):
            raise limit_error(f"'{key}' is nested deeper than {limit} levels of JSON.", key, code="too_deeply_nested")


def _deeper_than(value: Any, limit: int, *, start: int) -> bool:
    stack = [(value, start)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def check_chars(limits: LimitsConfig, chars: int, param: str) -> None:
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise limit_error(
            f"The prompt has {chars} characters; this model accepts at most {limits.max_prompt_chars}.", param
        )


def may_exceed_tokens(limits: LimitsConfig, utf8_bytes: int) -> bool:
    return limits.max_prompt_tokens is not None and utf8_bytes + 1 > limits.max_prompt_tokens


class TokenCounter:
    """Tokenizers by file path, loaded once (off the event loop) and kept for the plugin's lifetime."""

    def __init__(self) -> None:
        self._loaded: dict[str, Tokenizer] = {}
        self._lock = asyncio.Lock()

    async def preload(self, path: str) -> None:
        """Load now if the file exists (a broken file refuses the config); a missing one is loaded on
        first use, so a config may go live before the model has been prepared."""
        if await asyncio.to_thread(os.path.exists, path):
            await self._get(path)

    async def _get(self, path: str) -> Tokenizer:
        tokenizer = self._loaded.get(path)
        if tokenizer is not None:
            return tokenizer
        async with self._lock:
            tokenizer = self._loaded.get(path)
            if tokenizer is None:
                tokenizer = await asyncio.to_thread(Tokenizer.from_file, path)
                self._loaded[path] = tokenizer
            return tokenizer

    async def count(self, path: str, texts: list[str]) -> int:
        try:
            tokenizer = await self._get(path)
        except Exception as exc:  # the file is missing or unreadable: this check cannot run
            raise ServiceUnavailable(
                f"The prompt token limit cannot be checked: the tokenizer at '{path}' is unavailable "
                f"({type(exc).__name__}).",
                code="tokenizer_unavailable",
            ) from None
        encodings = await asyncio.to_thread(tokenizer.encode_batch, texts, add_special_tokens=False)
        return sum(len(e.ids) for e in encodings)


async def check_tokens(
    limits: LimitsConfig, counter: TokenCounter, path: str, texts: list[str], param: str, *, ids: int = 0
) -> None:
    """Raise when ``texts`` (counted with the tokenizer at ``path``) and ``ids`` token ids given as such
    (one token each) are together over ``max_prompt_tokens``. Ids alone over it need no tokenizer."""
    assert limits.max_prompt_tokens is not None
    tokens = ids
    if tokens <= limits.max_prompt_tokens and texts:
        tokens += await counter.count(path, texts)
    if tokens > limits.max_prompt_tokens:
        raise limit_error(
            f"The prompt has {tokens} tokens; this model accepts at most {limits.max_prompt_tokens}.",
            param,
            code="context_length_exceeded",
        )
