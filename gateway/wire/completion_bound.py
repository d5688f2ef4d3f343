"""The most completion tokens an answer's output (or a stream's events) can hold: what a worker's count
is checked against.

Every token a worker generates decodes to at least one byte of its output (byte-level BPE, or a
sentencepiece byte fallback), except special ones (the end of text, a reasoning model's thinking tags,
the markup of a tool call, which its parser strips): so an answer holds at most the UTF-8 bytes of its
output (text, reasoning, tool call names and arguments) plus a few tokens per choice and per tool call.
A ``usage.completion_tokens`` beyond that is not a count but a faulty or hostile worker's claim: it is
read as no count at all, as ``chat_answer.count`` reads a negative one (the token limit cuts nothing by
it, billing counts the output instead). The bound is generous on purpose: believing a count too high is
bounded by the output's bytes, disbelieving a true one would bill less than was generated.

A stream relayed as bytes is not parsed to find its output: its events' bytes bound it instead (each
token's bytes are in an event that carries it, and each event, or tool call in one, brings more bytes of
JSON around its output than the special tokens and markup it may stand for), a looser bound found at
the cost of one addition per read. A stream parsed event by event is an answer once assembled, and is
held to an answer's bound.
"""

from __future__ import annotations

from typing import Any

from gateway.wire.chat_answer import count
from gateway.wire.streaming import REASONING_FIELDS

#: Tokens a choice may hold beyond its output's bytes: the end of text, thinking tags, a stop string's
#: last token (the stop string is cut from the text).
SPECIAL_PER_CHOICE = 8
#: Tokens a tool call may hold beyond its name's and arguments' bytes: the markup around it that the
#: worker's tool parser strips (``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` and the like).
MARKUP_PER_CALL = 32


def _bytes(value: object) -> int:
    return len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else 0


def _choice_tokens(choice: object) -> int:
    """The most tokens one choice (a chat ``message`` or a completions ``text``) can hold."""
    if not isinstance(choice, dict):
        return 0
    message = choice.get("message")
    if not isinstance(message, dict):
        return _bytes(choice.get("text")) + SPECIAL_PER_CHOICE
    most = _bytes(message.get("content")) + _bytes(message.get("refusal")) + SPECIAL_PER_CHOICE
    most += sum(_bytes(message.get(name)) for name in REASONING_FIELDS)
    calls = message.get("tool_calls")
    legacy = message.get("function_call")
    functions = [c.get("function") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    for function in [*functions, legacy]:
        if isinstance(function, dict):
            most += _bytes(function.get("name")) + _bytes(function.get("arguments")) + MARKUP_PER_CALL
    return most


def most_completion_tokens(answer: dict[str, Any]) -> int:
    """The most completion tokens a whole answer's choices can hold (0 without choices)."""
    choices = answer.get("choices")
    return sum(_choice_tokens(choice) for choice in choices) if isinstance(choices, list) else 0


def can_hold(answer: dict[str, Any], completion: int) -> bool:
    """Whether a whole answer's choices can hold ``completion`` tokens (``most_completion_tokens``).
    Checked on every answer billed or stored, so the usual one is settled by its first choice's text
    alone: its characters are no more than its bytes."""
    choices = answer.get("choices")
    first = choices[0] if type(choices) is list and choices else None
    if type(first) is dict:
        message = first.get("message")
        text = message.get("content") if type(message) is dict else first.get("text")
        if type(text) is str and completion <= len(text) + SPECIAL_PER_CHOICE:
            return True
    return completion <= most_completion_tokens(answer)


def holds_its_count(answer: dict[str, Any]) -> bool:
    """Whether a whole answer's choices can hold its ``usage.completion_tokens``: True without a count
    (``count``: nothing to disbelieve), False past ``most_completion_tokens``."""
    usage = answer.get("usage")
    completion = count(usage.get("completion_tokens")) if isinstance(usage, dict) else None
    return completion is None or can_hold(answer, completion)


def most_streamed_tokens(event_bytes: int, choices: int) -> int:
    """The most completion tokens a stream of ``choices`` choices can hold in ``event_bytes`` bytes of
    events (see the module's docstring)."""
    return event_bytes + SPECIAL_PER_CHOICE * choices
