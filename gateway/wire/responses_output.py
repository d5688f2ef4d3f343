"""A chat completions answer as a Responses API answer: a Response object from a whole chat completion
(``response_from_chat``), or OpenAI's Responses event sequence from a chat SSE stream, chunk by chunk
(``EventStream``), with ``sequence_number``. Pure: no I/O.

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

import orjson

from gateway.wire.chat_answer import (
    count,
    first_choice,
    first_choice_deltas,
    json_type,
    malformed,
    member,
    reasoning_of,
)
from gateway.wire.responses_items import message_item, new_id, text_part
from gateway.wire.responses_request import ResponsesRequest

#: A chat finish_reason that makes a Response incomplete, and the reason it then gives.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


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
    reason = _INCOMPLETE.get(finish_reason or "")
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
        "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning or 0},
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
        output.append(_function_call(call.get("id"), function.get("name") or "", function.get("arguments") or ""))
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


def _function_call(call_id: object, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id if isinstance(call_id, str) and call_id else new_id("call"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# -- the stream --------------------------------------------------------------------------------------


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class EventStream:
    """Chat completion chunks in, the Responses event sequence out.

    ``start()`` gives response.created and response.in_progress; ``feed(chunk)`` the events of one chunk
    (output_item.added, content_part.added, reasoning_text.delta, output_text.delta,
    function_call_arguments.delta, and the ``.done`` events of the item the next one ends); ``close()``
    the ``.done`` events of the open item; ``completed()`` the final response.completed (or
    response.incomplete). ``response`` is the Response object being built, ready to store once closed.

    One item is open at a time, as OpenAI streams them: each is done before the next is added. A function
    call is done when the next call (another chat tool call index) or reasoning begins, or the answer
    ends; the chat API streams calls one after another, so a call's arguments after its item was done are
    the worker's failure (``BadGateway``): the client was already given the call whole.

    Text that arrives while a function call is open is held, with its logprobs, and becomes a message
    item of its own once the call's item is done (as the next call starts, or the answer ends), as
    vLLM's entrypoint does: a worker that sends several tokens per chunk (speculative decoding,
    ``--stream-interval``) can put the text after a call (the newline after ``</tool_call>``) in the same
    delta as the call's last arguments, and closing the call there would cut it in two items, the second
    without its call id and name.
    """

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self._seq = 0
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item
        self._message: dict[str, Any] | None = None  # the open message item
        self._call: dict[str, Any] | None = None  # the open function_call item
        self._call_index: int | None = None  # and its chat tool call index
        self._calls_done: set[int] = set()  # the chat tool call indexes whose items are done
        self._held_text: list[str] = []  # text that came while a function call was open
        self._held_logprobs: list[dict[str, Any]] = []  # and its logprobs
        self._finish_reason: str | None = None
        self._usage: object = None
        self._item_status = "completed"  # what an item closed now is ("incomplete" when cut by max tokens)

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(event)

    def _snapshot(self) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(self.response))

    def start(self) -> list[bytes]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def error(self, error: dict[str, Any]) -> bytes:
        """An ``error`` event: the SDK raises it as an APIError (the OpenAI error is under ``error``)."""
        return self._event(
            "error", code=error.get("code"), message=error.get("message"), param=error.get("param"), error=error
        )

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk (``BadGateway`` when the chunk is not one the translation reads)."""
        out: list[bytes] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice, delta, calls in first_choice_deltas(chunk):
            logprobs = logprobs_of(choice, "the stream chunk's choice 0's ")
            reasoning = reasoning_of(delta)
            if reasoning:
                out += self._reasoning_delta(reasoning)
            text = delta.get("content")
            if text:
                out += self._text(text, logprobs)
            for call, function in calls:
                out += self._tool_delta(call, function)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def _reasoning_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._reasoning is None:
            out += self._close_call() + self._close_message()  # the call's held text is a message, closed too
            item = reasoning_item("", status="in_progress")
            self._reasoning = item
            index = len(self.response["output"])
            self.response["output"].append(item)
            out.append(self._event("response.output_item.added", output_index=index, item=dict(item, content=[])))
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(item["content"][0]),
                )
            )
        item = self._reasoning
        item["content"][0]["text"] += text
        out.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=item["id"],
                output_index=self.response["output"].index(item),
                content_index=0,
                delta=text,
            )
        )
        return out

    def _close_reasoning(self) -> list[bytes]:
        item, self._reasoning = self._reasoning, None
        return [] if item is None else self._close_part(item, "response.reasoning_text.done")

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        if self._call is not None:  # the call may not be whole yet: the text waits for its item to be done
            self._held_text.append(text)
            self._held_logprobs += logprobs
            return []
        out: list[bytes] = []
        if self._message is None:
            out += self._close_reasoning()
            item = message_item("assistant", [])
            item["status"] = "in_progress"
            self._message = item
            index = len(self.response["output"])
            self.response["output"].append(item)
            out.append(self._event("response.output_item.added", output_index=index, item=dict(item, content=[])))
            part = {**text_part("output_text", ""), "logprobs": []}
            item["content"].append(part)
            out.append(
                self._event(
                    "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        item = self._message
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        index = self.response["output"].index(item)
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return out

    def _tool_delta(self, call: dict[str, Any], function: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        index = call.get("index", 0)
        item = self._call if index == self._call_index else None
        if item is None:
            if index in self._calls_done:
                if function.get("name") or function.get("arguments"):
                    raise malformed(f"tool call {index} went on after the next output item began")
                return out  # an empty delta of a call that is done changes nothing
            # the open call's item (and the message of the text held while it was open) is done first
            out += self._close_reasoning() + self._close_call() + self._close_message()
            item = _function_call(call.get("id"), function.get("name") or "", "", status="in_progress")
            self._call, self._call_index = item, index
            self.response["output"].append(item)
            out.append(
                self._event(
                    "response.output_item.added", output_index=len(self.response["output"]) - 1, item=dict(item)
                )
            )
        elif function.get("name"):
            item["name"] += function["name"]
        arguments = function.get("arguments")
        if arguments:
            item["arguments"] += arguments
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.response["output"].index(item),
                    delta=arguments,
                )
            )
        return out

    def _close_message(self) -> list[bytes]:
        item, self._message = self._message, None
        if item is None:
            return []
        return self._close_part(item, "response.output_text.done", logprobs=item["content"][0]["logprobs"])

    def _close_part(self, item: dict[str, Any], done: str, **fields: Any) -> list[bytes]:
        """The events that end an output item of one content part (reasoning text, a message's text): the
        part's ``done`` event with its whole text (and ``fields``), the part's, then the item's."""
        index = self.response["output"].index(item)
        part = item["content"][0]
        item["status"] = self._item_status
        return [
            self._event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **fields),
            self._event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _close_call(self) -> list[bytes]:
        """The events that end the open function call item, then open the message of the text held while
        it was open (left open: text that follows goes on in it)."""
        item, self._call = self._call, None
        if item is None:
            return []
        assert self._call_index is not None
        self._calls_done.add(self._call_index)
        index = self.response["output"].index(item)
        item["status"] = self._item_status
        out = [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        if self._held_text:
            text, logprobs = "".join(self._held_text), self._held_logprobs
            self._held_text, self._held_logprobs = [], []
            out += self._text(text, logprobs)
        return out

    def close(self) -> list[bytes]:
        """The ``.done`` events of the open items; the Response then holds its final status and usage."""
        if _INCOMPLETE.get(self._finish_reason or ""):
            self._item_status = "incomplete"
        out = self._close_reasoning() + self._close_call() + self._close_message()
        finish(self.response, self._finish_reason, self._usage)
        return out

    def completed(self) -> bytes:
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=self.response)
