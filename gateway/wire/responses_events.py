"""OpenAI's Responses event sequence from a chat SSE stream, chunk by chunk (``EventStream``), with
``sequence_number``: the streamed form of ``gateway.wire.responses_output``'s Response object, whose items
it builds with the same helpers. Pure: no I/O.

A worker's chunk that does not have the shape the translation reads is the worker's failure
(``BadGateway``, sent as the stream's ``error`` event), as for a whole answer
(``gateway.wire.responses_output``).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire.chat_answer import first_choice_deltas, malformed, reasoning_of
from gateway.wire.responses_items import message_item, text_part
from gateway.wire.responses_output import INCOMPLETE_REASONS, finish, function_call_item, logprobs_of, reasoning_item


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
            item = function_call_item(call.get("id"), function.get("name") or "", "", status="in_progress")
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
        if INCOMPLETE_REASONS.get(self._finish_reason or ""):
            self._item_status = "incomplete"
        out = self._close_reasoning() + self._close_call() + self._close_message()
        finish(self.response, self._finish_reason, self._usage)
        return out

    def completed(self) -> bytes:
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=self.response)
