"""Every text the model reads for a request, and every text the client reads from an answer, as
writable slots.

Rules read each slot's text and a redaction writes the slot back, so the body sent upstream (or the
answer sent to the client) carries the placeholders. ``prompt_slots`` is the one place that knows
where a request's text lives, for every endpoint that reaches a worker through the pipeline:

- chat completions: every message field vLLM hands the chat template (``content`` as a string or as
  parts of every text-bearing type: ``text``/``input_text``/``output_text``, ``refusal``,
  ``thinking``, ``tool_reference`` names, bare string parts, and any other string a part carries
  besides its media payload; ``name``, ``reasoning``/``reasoning_content``, ``refusal``, earlier
  ``tool_calls`` and ``function_call`` (names and arguments), ``tool_call_id``, a developer message's
  ``tools``, ``task``), ``tools``/``functions`` (names, descriptions, every string and property name
  of their JSON schemas), ``documents``, ``chat_template_kwargs`` values, ``prediction``;
- completions: ``prompt`` (string or strings) and ``suffix``;
- embeddings: ``input`` (strings, or one or a batch of chat conversations, which vLLM renders with the
  chat template) and ``messages`` (one conversation or a batch), plus ``chat_template_kwargs``.

Fields that carry strings the model never reads are listed in ``UNSCANNED`` with the reason; a test
(``tests/plugins/safety/test_text_fields.py``) walks vLLM's own request models and fails on a text
field that is in neither list. ``answer_slots`` is the same for what the client reads: content,
tool-call arguments (and names), reasoning, refusals, legacy completion text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_CONTENT_PARAM = {
    "chat/completions": "messages", "completions": "prompt", "embeddings": "input", "classify": "input",
    "pooling": "input", "rerank": "documents", "v2/rerank": "documents", "score": "documents",
    "audio/transcriptions": "prompt", "audio/translations": "prompt",
}  # fmt: skip
#: Where the texts of vLLM's scoring routes (rerank, score) are: strings, or ``{"content": [parts]}``.
_SCORING_FIELDS = ("query", "documents", "text_1", "text_2", "queries", "items", "data_1", "data_2")

#: Content-part keys whose values are media (URLs, base64 payloads, tensors) or bookkeeping, not text
#: the model reads as words. Media URLs are checked by ``gateway.wire.media_urls`` instead.
MEDIA_PART_KEYS = frozenset(
    {
        "type", "uuid", "detail", "closed", "image_url", "audio_url", "video_url", "input_image", "input_audio",
        "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "image_pil", "data", "file",
    }
)  # fmt: skip

#: Message keys not scanned, and why (every other string in a message is scanned).
UNSCANNED_MESSAGE_FIELDS: dict[str, str] = {
    "role": "one of a fixed set of roles (gateway.wire.protocol refuses any other)",
    "audio": "an id referring to an earlier audio answer; no text",
}

#: Top-level request fields that carry strings and are deliberately not scanned, with the reason.
UNSCANNED: dict[str, str] = {
    "model": "names the model; checked against the config, never rendered",
    "user": "an end-user id for abuse tracking; not given to the model",
    "metadata": "stored with the request, not given to the model",
    "safety_identifier": "an end-user id; not given to the model",
    "prompt_cache_key": "a cache key; not given to the model",
    "prompt_cache_options": "cache options; not given to the model",
    "prompt_cache_retention": "cache retention; not given to the model",
    "cache_salt": "narrows prefix-cache sharing; not given to the model",
    "service_tier": "an enum; not given to the model",
    "reasoning_effort": "an enum the template may read (low|medium|high); vLLM validates it",
    "verbosity": "an enum; not given to the model",
    "modalities": "enum list; not given to the model",
    "truncation_side": "an enum (left|right)",
    "encoding_format": "an enum (float|base64)",
    "embed_dtype": "an enum",
    "endianness": "an enum",
    "stop": "compared with the generated text, never rendered into the prompt",
    "bad_words": "compared with the generated tokens, never rendered into the prompt",
    "logit_bias": "token ids to numbers",
    "response_format": "constrains decoding; vLLM does not render it into the prompt (output rules see the result)",
    "structured_outputs": "constrains decoding; not rendered into the prompt (output rules see the result)",
    "guided_json": "constrains decoding (translated by guided_json); not rendered into the prompt",
    "guided_regex": "constrains decoding; not rendered into the prompt",
    "guided_choice": "constrains decoding; not rendered into the prompt",
    "guided_grammar": "constrains decoding; not rendered into the prompt",
    "guided_decoding_backend": "an enum",
    "guided_whitespace_pattern": "constrains decoding; not rendered into the prompt",
    "tool_choice": "names one of 'tools' (which are scanned) or an enum; not rendered as text",
    "function_call": "names one of 'functions' (scanned) or an enum; not rendered as text",
    "web_search_options": "not supported by vLLM; not rendered",
    "audio": "output audio options; not rendered",
    "stream_options": "booleans",
    "repetition_detection": "decoding options, no text",
    "watermarking": "decoding options, no text",
    # Refused by gateway.wire.allowlist before any plugin runs: never reach a worker.
    "chat_template": "refused by the allow-list (a client-written template)",
    "media_io_kwargs": "refused by the allow-list",
    "mm_processor_kwargs": "refused by the allow-list",
    "kv_transfer_params": "refused by the allow-list",
    "ec_transfer_params": "refused by the allow-list",
    "vllm_xargs": "refused by the allow-list",
    "prompt_embeds": "refused by the allow-list (tensors, not text)",
    "request_id": "refused by the allow-list",
    "session_id": "refused by the allow-list",
    "mm_payload": "refused by the allow-list (render endpoints only)",
    "priority": "refused by the allow-list",
}

#: Top-level request fields whose text is scanned, per endpoint (``prompt_slots`` reads exactly these).
SCANNED: dict[str, frozenset[str]] = {
    "chat/completions": frozenset(
        {"messages", "tools", "functions", "documents", "chat_template_kwargs", "prediction"}
    ),
    "completions": frozenset({"prompt", "suffix"}),
    "embeddings": frozenset({"input", "messages", "chat_template_kwargs"}),
}


@dataclass(slots=True)
class TextSlot:
    container: Any  # the dict or list holding the text
    key: Any  # its key or index there
    text: str
    is_key: bool = False  # the text is a dict key (a JSON-schema property name), not a value
    group: int = 0  # texts the model reads together share a group (a batch's prompts do not)

    def write(self, text: str) -> None:
        if text == self.text:
            return
        if self.is_key:
            # Rename the key in place, keeping the order of the others.
            items = list(self.container.items())
            self.container.clear()
            for k, v in items:
                self.container[text if k == self.text else k] = v
            self.key = text
        else:
            self.container[self.key] = text
        self.text = text


def content_param(endpoint: str) -> str:
    """The request field that carries the prompt (named in refusals and limit errors)."""
    return _CONTENT_PARAM.get(endpoint, "messages")


def prompt_slots(endpoint: str, body: dict[str, Any]) -> list[TextSlot]:
    """Every text the model will read for this request, in prompt order."""
    slots: list[TextSlot] = []
    if endpoint == "chat/completions":
        _messages(body.get("messages"), slots)
        for name in ("tools", "functions", "documents"):
            if name in body:
                _walk(body, name, slots, keys=True)
        if "chat_template_kwargs" in body:
            _walk(body, "chat_template_kwargs", slots, keys=True)
        prediction = body.get("prediction")
        if isinstance(prediction, dict) and "content" in prediction:
            _content(prediction, slots)
        return slots
    if endpoint == "completions":
        _strings_of(body, "prompt", slots)
        if isinstance(body.get("suffix"), str):
            # The suffix goes with every prompt of a batch; scanned on its own when there are several.
            group = 0 if isinstance(body.get("prompt"), str) else -1
            slots.append(TextSlot(body, "suffix", body["suffix"], group=group))
        return slots
    if endpoint.startswith("audio/"):  # the text prompt that guides a transcription (the audio is not text)
        _strings_of(body, "prompt", slots)
        return slots
    if endpoint in ("rerank", "v2/rerank", "score"):
        for name in _SCORING_FIELDS:
            value = body.get(name)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, dict):
                    _content(item, slots)
            _strings_of(body, name, slots)
        return slots
    if endpoint in ("embeddings", "classify", "pooling"):  # text, token ids or conversations, as vLLM reads them
        for name in ("input", "messages"):
            value = body.get(name)
            if _is_conversation(value):
                _messages(value, slots, group=len(slots))
            elif isinstance(value, list) and value and all(_is_conversation(v) for v in value):
                for conversation in value:
                    _messages(conversation, slots, group=len(slots))
            else:
                _strings_of(body, name, slots)
        if "chat_template_kwargs" in body:
            _walk(body, "chat_template_kwargs", slots, keys=True)
    return slots


#: The endpoints that take a prompt as token ids, and the field that carries them (vLLM reads a list of
#: ints as one prompt's ids and a list of such lists as a batch of prompts).
_TOKEN_ID_FIELDS = {"completions": "prompt", "embeddings": "input", "classify": "input", "pooling": "input"}
#: The endpoints ``prompt_token_ids`` can find ids on (a caller skips the call for the others: chat).
TOKEN_ID_ENDPOINTS = frozenset(_TOKEN_ID_FIELDS)


def prompt_token_ids(endpoint: str, body: dict[str, Any]) -> int:
    """How many token ids the request gives its prompt as (0: none, every prompt is text).

    ``prompt_slots`` has no text for them (the gateway has no tokenizer to decode ids with): the caller
    counts them against the token limit, and refuses them where a rule would have to read their text.
    Any int in the list, or in a list inside it, counts, wherever it stands: vLLM's request models read
    ``["5", 6]`` as the ids 5 and 6 (a digit string is coerced to an int), so a list is not taken for
    text by its first element alone."""
    name = _TOKEN_ID_FIELDS.get(endpoint)
    value = body.get(name) if name is not None else None
    if type(value) is not list or not value:
        return 0
    if type(value[0]) is int:  # one prompt's ids: the usual form, counted without a loop
        return len(value)
    count = 0
    for item in value:
        if type(item) is int:
            count += 1
        elif type(item) is list and any(type(t) is int for t in item):
            count += len(item)
    return count


def _is_conversation(value: object) -> bool:
    """A list of chat messages (dicts with a string role), as vLLM tells chat embeddings apart."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    )


def _strings_of(body: dict[str, Any], name: str, slots: list[TextSlot]) -> None:
    """A string, or a batch of strings (each read on its own: a group each)."""
    value = body.get(name)
    if isinstance(value, str):
        slots.append(TextSlot(body, name, value, group=len(slots)))
    elif isinstance(value, list):
        base = len(slots)
        slots.extend(
            TextSlot(value, i, item, group=base + i + 1) for i, item in enumerate(value) if isinstance(item, str)
        )


def _messages(messages: object, slots: list[TextSlot], group: int = 0) -> None:
    if not isinstance(messages, list):
        return
    first = len(slots)
    for message in messages:
        if not isinstance(message, dict):
            continue
        for key, value in message.items():
            if key in UNSCANNED_MESSAGE_FIELDS:
                continue
            if key == "content":
                _content(message, slots)
            elif isinstance(value, str):
                slots.append(TextSlot(message, key, value))
            elif isinstance(value, dict | list):
                # tool_calls, function_call, a developer message's tools: names, arguments, schemas.
                _walk(message, key, slots, keys=key == "tools")
    for slot in slots[first:]:
        slot.group = group


def _content(holder: dict[str, Any], slots: list[TextSlot]) -> None:
    content = holder.get("content")
    if isinstance(content, str):
        slots.append(TextSlot(holder, "content", content))
        return
    if not isinstance(content, list):
        return
    for i, part in enumerate(content):
        if isinstance(part, str):
            slots.append(TextSlot(content, i, part))
        elif isinstance(part, dict):
            for key, value in part.items():
                if key in MEDIA_PART_KEYS:
                    continue
                if isinstance(value, str):
                    slots.append(TextSlot(part, key, value))
                elif isinstance(value, dict | list):
                    _walk(part, key, slots, keys=False)


#: JSON-schema and tool-definition keywords: fixed words, not text a client chose (keys only).
_SCHEMA_WORDS = frozenset(
    {
        "type", "function", "name", "description", "parameters", "strict", "properties", "required", "items",
        "enum", "const", "title", "default", "examples", "format", "pattern", "anyOf", "oneOf", "allOf", "not",
        "$ref", "$defs", "definitions", "additionalProperties", "minimum", "maximum", "minLength", "maxLength",
        "minItems", "maxItems", "uniqueItems", "nullable", "text", "content", "arguments", "id",
    }
)  # fmt: skip
#: JSON-schema type names (values of "type"): fixed words, not scanned.
_TYPE_NAMES = frozenset({"string", "object", "array", "number", "integer", "boolean", "null", "function"})


def _walk(container: Any, key: Any, slots: list[TextSlot], *, keys: bool) -> None:
    """Every string under ``container[key]`` (and, with ``keys``, every dict key below it that is not
    a JSON-schema keyword: property names are rendered into the prompt with the schema). Recursive:
    bodies nest at most ``gateway.wire.protocol.MAX_DEPTH`` levels."""
    _walk_into(container, key, container[key], slots, keys)


def _walk_into(holder: Any, key: Any, value: Any, slots: list[TextSlot], keys: bool) -> None:
    kind = type(value)
    if kind is str:
        if not (key == "type" and value in _TYPE_NAMES):
            slots.append(TextSlot(holder, key, value))
    elif kind is dict:
        if keys:
            slots.extend(
                TextSlot(value, name, name, is_key=True)
                for name in value
                if type(name) is str and name not in _SCHEMA_WORDS
            )
        for name, item in value.items():
            if type(item) in _CONTAINERS:
                _walk_into(value, name, item, slots, keys)
    elif kind is list:
        for i, item in enumerate(value):
            if type(item) in _CONTAINERS:
                _walk_into(value, i, item, slots, keys)


_CONTAINERS = (str, dict, list)


# -- the way back --------------------------------------------------------------------------------------

#: The fields of a chat message (or a stream delta) whose text the client reads.
ANSWER_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


def completion_slots(response: dict[str, Any]) -> list[tuple[dict[str, Any], TextSlot]]:
    """(choice, slot) for every text the client reads in a complete chat or legacy completion: each
    choice's content, reasoning, refusal and tool calls' arguments, or its legacy ``text``."""
    out: list[tuple[dict[str, Any], TextSlot]] = []
    for choice in response.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            for name in ANSWER_TEXT_FIELDS:
                if isinstance(message.get(name), str):
                    out.append((choice, TextSlot(message, name, message[name])))
            out.extend((choice, slot) for slot in tool_call_slots(message.get("tool_calls")))
            function_call = message.get("function_call")
            if isinstance(function_call, dict) and isinstance(function_call.get("arguments"), str):
                out.append((choice, TextSlot(function_call, "arguments", function_call["arguments"])))
        elif isinstance(choice.get("text"), str):
            out.append((choice, TextSlot(choice, "text", choice["text"])))
    return out


def answer_texts(response: dict[str, Any]) -> Iterator[str]:
    """The texts of ``completion_slots`` (what output rules scan in a complete answer)."""
    return (slot.text for _, slot in completion_slots(response))


def tool_call_slots(calls: object) -> list[TextSlot]:
    """The ``function.arguments`` strings of a message's (or a stream delta's) tool calls."""
    slots: list[TextSlot] = []
    if not isinstance(calls, list):
        return slots
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            slots.append(TextSlot(function, "arguments", function["arguments"]))
    return slots
