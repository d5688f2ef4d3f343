"""A chat completions answer as an Anthropic Messages API answer: a Message object from a whole chat
completion (``message_from_chat``), or Anthropic's event sequence from a chat SSE stream, chunk by chunk
(``MessageStream``). Pure: no I/O.

The stream is the one Anthropic sends: ``message_start``, ``ping``, then per content block
``content_block_start``, ``content_block_delta`` (``thinking_delta`` for thinking, ``text_delta`` for
text, ``input_json_delta`` for a tool call's arguments) and ``content_block_stop``, then ``message_delta``
with ``stop_reason`` and usage, and ``message_stop``. Each SSE event carries its type in both the
``event:`` line and the data.

A reasoning model's thinking (the chat answer's ``reasoning``/``reasoning_content``) is a ``thinking``
block before the text and tool calls, as vLLM's own Messages endpoint gives it. Its ``signature`` (sent
last, as a ``signature_delta``, when streamed) is a random token: the SDKs require one, but nothing checks
it, since thinking blocks a client sends back are dropped (``gateway.wire.anthropic_turns``).

A worker's answer that does not have the shape the translation reads (no ``choices`` list, a choice
without its ``message``, a ``finish_reason`` or ``content`` that is not a string, a tool call that is not
an object, ...) is the worker's failure, not the gateway's: it raises ``BadGateway`` (a 502, or the
stream's ``error`` event), never a half-read Message (``gateway.wire.chat_answer`` reads it, as for the
Responses API). Only ``usage`` is read leniently (a count that is not a number counts 0), as the proxy
reads it.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gateway.wire.chat_answer import count, first_choice, first_choice_deltas, malformed, reasoning_of
from gateway.wire.errors import anthropic_sse


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def stop_reason(
    finish_reason: object, matched: object, used_tools: bool, calls_whole: bool = True
) -> tuple[str | None, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat ``finish_reason``; ``matched`` is vLLM's
    ``stop_reason`` (the stop string that ended the answer, when one did); ``calls_whole``: every tool
    call's arguments are a JSON object. A stop string that cut a call short is ``stop_sequence``, not
    ``tool_use``, as vLLM's entrypoint answers: a client runs the tools of a ``tool_use`` answer, and a
    call cut short must not run (its ``input`` is ``{}``)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    tools = finish_reason == "tool_calls" or used_tools
    if tools and calls_whole:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if tools:
        return "tool_use", None
    return ("end_turn", None) if finish_reason is not None else (None, None)


def usage_of(usage: object) -> dict[str, Any]:
    """Anthropic counts cached prompt tokens apart: ``input_tokens`` are the ones that were not."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = count(usage.get("prompt_tokens")) or 0
    details = usage.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    if cached is not None:
        cached = min(cached, prompt)  # a part of the prompt: a worker's count over it is not passed on
    out = {"input_tokens": prompt - (cached or 0), "output_tokens": count(usage.get("completion_tokens")) or 0}
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out


def _signature() -> str:
    return uuid.uuid4().hex


def _arguments_object(arguments: object) -> dict[str, Any] | None:
    """A tool call's arguments as the JSON object they should be, or None when they are none (no
    arguments, invalid JSON, JSON cut short, an array or a string)."""
    if not isinstance(arguments, str) or not arguments:
        return None
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _tool_input(arguments: object) -> dict[str, Any]:
    """A tool call's arguments as the ``input`` object. Anthropic's ``input`` is always a JSON object, and
    clients rely on it (the SDK's stream helper raises on a delta it cannot parse), so arguments that are not
    one (none, invalid JSON, JSON cut short by max_tokens, an array or a string) give ``{}``: the answer
    stays whole, and the client's check of the tool's input answers the model."""
    return _arguments_object(arguments) or {}


def message_object(message_id: str, model: str) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def message_from_chat(message_id: str, model: str, chat: object) -> dict[str, Any]:
    """A non-streamed chat completion as a Message (``BadGateway`` when it is not one)."""
    choice, answer, calls, usage = first_choice(chat)
    out = message_object(message_id, model)
    thinking = reasoning_of(answer)
    if thinking:
        out["content"].append({"type": "thinking", "thinking": thinking, "signature": _signature()})
    content = answer.get("content")
    if content:
        out["content"].append({"type": "text", "text": content})
    for call, function in calls:
        out["content"].append(
            {
                "type": "tool_use",
                "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                "name": function.get("name") or "",
                "input": _tool_input(function.get("arguments")),
            }
        )
    whole = all(_arguments_object(function.get("arguments")) is not None for _, function in calls)
    out["stop_reason"], out["stop_sequence"] = stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(calls), whole
    )
    out["usage"] = usage_of(usage)
    return out


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class MessageStream:
    """Chat completion chunks in, Anthropic's event sequence out.

    ``start()`` gives message_start and a ping; ``feed(chunk)`` the events of one chunk; ``close()`` the
    open block's content_block_stop and the message_delta (stop reason, usage); ``end()`` message_stop.

    A tool call's arguments are held until its block ends and then sent as one ``input_json_delta``, the
    object ``message_from_chat`` would give, or none when they are no JSON object (``input`` stays ``{}``):
    the chat stream's pieces cannot be sent as they come, since which ones make an object is only known at
    the end, and a client cannot take back pieces it parsed.

    One block is open at a time, as Anthropic streams them: a tool call's block ends when the next call
    (another chat tool call index), thinking or the answer's end comes. The chat API streams calls one after
    another, so arguments (or a name) for a call whose block ended are the worker's failure (``BadGateway``,
    the stream's ``error`` event): the client was already given that call whole, and a second ``tool_use``
    block for it would have no id and no name. An empty delta of such a call changes nothing.

    Text that arrives while a tool call's block is open is held too, and becomes a text block of its own
    once that block ends, as vLLM's entrypoint does: a worker that sends several tokens per chunk
    (speculative decoding, ``--stream-interval``) can put the text after a call (the newline after
    ``</tool_call>``) in the same delta as the call's last arguments, and ending the call there would cut
    it in two blocks, the second without its id and name.
    """

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self._index = -1  # the open content block (-1: none yet)
        self._open: str | None = None  # "thinking", "text" or "tool:<chat tool call index>"
        self._arguments: list[str] = []  # the open tool call's arguments so far
        self._held_text: list[str] = []  # text that came while a tool call's block was open
        self._tools_done: set[str] = set()  # the keys of the tool calls whose blocks ended
        self._used_tools = False
        self._calls_whole = True  # every closed tool call's arguments were a JSON object
        self._finish_reason: object = None
        self._matched: object = None
        self._usage: object = None

    def start(self) -> list[bytes]:
        return [
            sse({"type": "message_start", "message": message_object(self.message_id, self.model)}),
            sse({"type": "ping"}),
        ]

    def error(self, error: dict[str, Any]) -> bytes:
        return anthropic_sse(error)

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk (``BadGateway`` when the chunk is not one the translation reads)."""
        out: list[bytes] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice, delta, calls in first_choice_deltas(chunk):
            thinking = reasoning_of(delta)
            if thinking:
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": thinking}))
            text = delta.get("content")
            if text and self._open is not None and self._open.startswith("tool:"):
                self._held_text.append(text)
            elif text:
                out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call, function in calls:
                out += self._tool_delta(call, function)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
                self._matched = choice.get("stop_reason")
        return out

    def _block(self, key: str, block: dict[str, Any]) -> list[bytes]:
        """Open the block ``key`` unless it is the open one (closing the open one first, and the text block
        a closed tool call's held text opens unless that is ``key``)."""
        out: list[bytes] = []
        while self._open is not None and self._open != key:
            out += self._close_block()
        if self._open == key:
            return out
        self._index += 1
        self._open = key
        out.append(sse({"type": "content_block_start", "index": self._index, "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _tool_delta(self, call: dict[str, Any], function: dict[str, Any]) -> list[bytes]:
        key = f"tool:{call.get('index', 0)}"
        out: list[bytes] = []
        if key in self._tools_done:
            if function.get("name") or function.get("arguments"):
                raise malformed(f"tool call {call.get('index', 0)} went on after the next content block began")
            return []  # an empty delta of a call whose block ended changes nothing
        if self._open != key:
            self._used_tools = True
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                "name": function.get("name") or "",
                "input": {},
            }
            out += self._block(key, block)
        arguments = function.get("arguments")
        if arguments:
            self._arguments.append(arguments)
        return out

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        out: list[bytes] = []
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": _signature()}))
        if self._open.startswith("tool:"):
            self._tools_done.add(self._open)
            arguments = _arguments_object("".join(self._arguments))
            self._arguments = []
            if arguments is None:
                self._calls_whole = False
            elif arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": orjson.dumps(arguments).decode()}))
        closed, self._open = self._open, None
        out.append(sse({"type": "content_block_stop", "index": self._index}))
        if closed.startswith("tool:") and self._held_text:  # the text that came during the call, now open
            text, self._held_text = "".join(self._held_text), []
            out += self._block("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def close(self) -> list[bytes]:
        out: list[bytes] = []
        while self._open is not None:
            out += self._close_block()
        reason, sequence = stop_reason(self._finish_reason, self._matched, self._used_tools, self._calls_whole)
        delta = {"stop_reason": reason or "end_turn", "stop_sequence": sequence}
        out.append(sse({"type": "message_delta", "delta": delta, "usage": usage_of(self._usage)}))
        return out

    def end(self) -> bytes:
        return sse({"type": "message_stop"})
