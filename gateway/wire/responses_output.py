"""A chat completions answer as a Responses API answer: a Response object from a whole chat completion
(``response_from_chat``), and the output items it holds. The streamed form, the Responses event sequence,
is ``gateway.wire.responses_events``, which builds its items with these helpers. Pure: no I/O.

A reasoning model's thinking (the chat answer's ``reasoning``/``reasoning_content``) is a ``reasoning``
output item before the message and function calls, its text a ``reasoning_text`` content part, as vLLM's
own Responses endpoint gives it; streamed with ``response.reasoning_text.delta``/``.done``. Its
``summary`` is empty: no worker writes summaries.

The worker's answer is read by ``gateway.wire.chat_answer``, as for the Messages API: one that does not have
the shape the translation reads (no ``choices`` list, a choice without its ``message``, a ``finish_reason``,
``content`` or logprob that is not of the chat API's type, a tool call that is not an object, ...) is the
worker's failure, not the gateway's: it raises ``BadGateway`` (a 502, or the stream's ``error`` event),
never a Response made of what could be read, so none is stored for a later turn to continue. Only
``usage`` is read leniently (a count that is not a number counts 0), as the proxy reads it.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.wire.chat_answer import (
    count,
    first_choice,
    json_type,
    malformed,
    member,
    reasoning_of,
)
from gateway.wire.responses_items import message_item, new_id, text_part
from gateway.wire.responses_request import ResponsesRequest

#: A chat finish_reason that makes a Response incomplete, and the reason it then gives.
INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


# -- the response ------------------------------------------------------------------------------------


def response_object(
    req: ResponsesRequest, response_id: str, model: str, created_at: int, status: str, output: list[dict[str, Any]]
) -> dict[str, Any]:
    """A Response object (``status``: in_progress, completed, incomplete, failed), echoing the request.

    Every field of the Responses schema of OpenAI's OpenAPI spec that admits null is present (null when
    it does not apply), and so are the sampling fields strict conformance suites ask for
    (``presence_penalty``, ``frequency_penalty``): tests check it against the spec itself."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "completed_at": None,
        "conversation": None,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": output,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "text": {"format": req.text_format, "verbosity": "medium"},
        "tool_choice": req.tool_choice,
        "tools": req.tools,
        "truncation": "disabled",
        "top_logprobs": 0,
        "max_tool_calls": None,
        "prompt_cache_retention": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        **req.echo,
    }


def finish(response: dict[str, Any], finish_reason: str | None, usage: object) -> None:
    """Set the final status, incomplete details and usage of a Response built from a chat answer."""
    reason = INCOMPLETE_REASONS.get(finish_reason or "")
    response["status"] = "incomplete" if reason else "completed"
    response["incomplete_details"] = {"reason": reason} if reason else None
    response["completed_at"] = int(time.time())
    counted = _usage(usage)
    if counted is not None:  # an object in the spec, not nullable: left out while unknown
        response["usage"] = counted
    if reason:
        for item in response["output"]:
            item["status"] = "incomplete"


def _usage(usage: object) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt = count(usage.get("prompt_tokens")) or 0
    completion = count(usage.get("completion_tokens")) or 0
    details = usage.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    # a worker with a reasoning parser counts the thinking among the completion tokens, and tells how many
    details = usage.get("completion_tokens_details")
    reasoning = count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
    return {
        "input_tokens": prompt,
        # parts of the totals, never more than them (a worker's counts that disagree are not passed on)
        "input_tokens_details": {"cached_tokens": min(cached or 0, prompt), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(reasoning or 0, completion)},
        "total_tokens": count(usage.get("total_tokens")) or prompt + completion,
    }


def response_from_chat(
    req: ResponsesRequest, response_id: str, model: str, created_at: int, chat: object
) -> dict[str, Any]:
    """A non-streamed chat completion as a Response object (``BadGateway`` when it is not one)."""
    choice, message, calls, usage = first_choice(chat)
    logprobs = logprobs_of(choice, "choices[0].")
    output: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if reasoning:
        output.append(reasoning_item(reasoning))
    content = message.get("content")
    if content:
        part = {**text_part("output_text", content), "logprobs": logprobs}
        output.append(message_item("assistant", [part]))
    for call, function in calls:
        output.append(function_call_item(call.get("id"), function.get("name") or "", function.get("arguments") or ""))
    response = response_object(req, response_id, model, created_at, "completed", output)
    finish(response, choice.get("finish_reason"), usage)
    return response


def logprobs_of(choice: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A chat choice's (or chunk choice's) token logprobs, as the Responses API lists them on output_text
    (``BadGateway`` when they are not the chat API's; ``where`` names the choice in that error)."""
    logprobs = member(choice, "logprobs", dict, where)
    content = member(logprobs, "content", list, f"{where}logprobs.") if logprobs else None
    return [_logprob(entry, f"{where}logprobs.content[{i}]", top=True) for i, entry in enumerate(content or ())]


def _logprob(entry: object, where: str, *, top: bool) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise malformed(f"{where} is {json_type(entry)}, not an object")
    token = member(entry, "token", str, f"{where}.") or ""
    raw_bytes = member(entry, "bytes", list, f"{where}.")
    out: dict[str, Any] = {
        "token": token,
        "logprob": float(member(entry, "logprob", (int, float), f"{where}.") or 0.0),
        "bytes": raw_bytes if raw_bytes is not None else list(token.encode()),
    }
    if top:
        alternatives = enumerate(member(entry, "top_logprobs", list, f"{where}.") or ())
        out["top_logprobs"] = [_logprob(alt, f"{where}.top_logprobs[{i}]", top=False) for i, alt in alternatives]
    return out


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` output item holding a model's thinking as one ``reasoning_text`` part."""
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def function_call_item(call_id: object, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id if isinstance(call_id, str) and call_id else new_id("call"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }
