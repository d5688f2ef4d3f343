"""Token counts for limits: estimated from the request on admission, taken from usage afterwards.

The admission estimate is characters / 4 (OpenAI's rule of thumb) over the text the model will read,
plus a few tokens per chat message for the template. A chat request's tool definitions and an assistant
turn's tool calls are part of that text (chat templates render them as JSON), counted by their JSON's
length. A message's media parts (images, audio, video: every part type vLLM reads) count a fixed number
of tokens each (``MediaTokens``): their tokens depend on the model's processor and the media's size,
which the gateway does not decode. Prompt embeddings count by their size. It runs on the event loop, so
it only walks the parsed body: no tokenizer, and nothing more than before for string content. The
estimate is corrected when the worker reports ``usage``.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.wire.chat_answer import count
from gateway.wire.completion_bound import can_hold
from gateway.wire.protocol import requested_completion_tokens
from plugins.tenancy.config import MediaTokens

_PER_MESSAGE = 4  # role markers and separators of a chat template
_SCORING = frozenset({"rerank", "v2/rerank", "score"})
_PROMPTED = frozenset({"completions", "audio/transcriptions", "audio/translations"})  # their text is "prompt"
_SCORING_FIELDS = ("query", "documents", "text_1", "text_2", "queries", "items", "data_1", "data_2")
MEDIA_TOKENS = MediaTokens()
#: The text parts vLLM reads (its TEXT_PART_TYPES, and tool_reference) by the field holding their text.
_TEXT_FIELDS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking",
    "tool_reference": "name",
}  # fmt: skip
#: Media part types by what they count as; another type counts as an image (a ``file`` part, or a type
#: added to vLLM later): vLLM refuses a type it does not read, and the reservation is then released.
_AUDIO = frozenset({"input_audio", "audio_url", "audio_embeds"})
_VIDEO = frozenset({"video_url", "video_embeds"})
#: The keys vLLM recognises a part without ``type`` by, in its order.
_UNTYPED = (
    "image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "audio_url",
    "input_audio", "video_url", "tool_reference",
)  # fmt: skip
#: Bytes of a prompt embeddings tensor per token: a row of 512 16-bit numbers. Served models' rows are
#: wider (hidden sizes of 896 and up), so the estimate is at or above the tensor's rows.
_EMBEDDING_BYTES_PER_TOKEN = 1024


def _text_chars(value: Any, media: MediaTokens = MEDIA_TOKENS) -> int:
    """Characters of a prompt: a string, token ids (4 characters each), or a list of strings, content
    parts, messages, multimodal scoring items (``{"content": [parts]}``) or conversations (lists of
    messages). A media part counts as 4 characters per token of its estimate."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return _item_chars(value, media)
    if not isinstance(value, list):
        return 0
    total = 0
    for item in value:
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += _item_chars(item, media)
        elif isinstance(item, list):
            if item and isinstance(item[0], dict):  # a conversation (the pooling routes' batch form)
                total += sum(_item_chars(message, media) for message in item if isinstance(message, dict))
            else:
                total += 4 * len(item)  # token ids: 1 token ~ 4 chars
        elif isinstance(item, int):
            total += 4
    return total


def _item_chars(item: dict[str, Any], media: MediaTokens) -> int:
    """A content part, or a message or scoring item holding ``content`` (a string or content parts)."""
    text = item.get("text")
    if isinstance(text, str):
        return len(text)
    content = item.get("content")
    if content is not None and "type" not in item:
        return _content_chars(content, media)
    return _part_chars(item, media)


def _content_chars(content: Any, media: MediaTokens) -> int:
    """Characters of a message's ``content``: a string, or a list of content parts."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    total = 0
    for part in content:
        if isinstance(part, dict):
            text = part.get("text")
            total += len(text) if isinstance(text, str) else _part_chars(part, media)
        elif isinstance(part, str):
            total += len(part)
    return total


def _part_chars(part: dict[str, Any], media: MediaTokens) -> int:
    """Characters (4 per token) of a content part other than plain ``text``, read as vLLM reads it:
    by its ``type``, or without one by the key it carries."""
    kind = part.get("type")
    if kind is None:
        kind = next((key for key in _UNTYPED if key in part), None)
        if kind is None:
            return 0  # vLLM refuses it
    elif not isinstance(kind, str):
        return 0
    field = _TEXT_FIELDS.get(kind)
    if field is not None:
        text = part.get(field)
        return len(text) if isinstance(text, str) else 0
    if kind == "prompt_embeds":
        return 4 * embeddings_tokens(part.get("data"))
    if kind in _AUDIO:
        return 4 * media.audio
    if kind in _VIDEO:
        return 4 * media.video
    return 4 * media.image


def embeddings_tokens(data: Any) -> int:
    """Tokens of base64 prompt embeddings (a string, or a list of them): a bound from their size."""
    if isinstance(data, str):
        return -(-(len(data) * 3 // 4) // _EMBEDDING_BYTES_PER_TOKEN) or 1
    if isinstance(data, list):
        return sum(embeddings_tokens(item) for item in data if isinstance(item, str))
    return 0


def _json_chars(value: Any) -> int:
    """The length of ``value`` as JSON: how a chat template renders tool definitions and tool calls."""
    if not value:
        return 0
    try:
        return len(orjson.dumps(value))
    except TypeError:  # not JSON (a plugin's object): nothing to count
        return 0


def _messages_tokens(messages: Any, chars: int, media: MediaTokens) -> int:
    """The estimate of chat ``messages`` rendered by a template, with ``chars`` more characters."""
    overhead = 0
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict):
            content = message.get("content")
            chars += len(content) if isinstance(content, str) else _content_chars(content, media)
            if "tool_calls" in message:
                chars += _json_chars(message["tool_calls"])
            overhead += _PER_MESSAGE
    return -(-chars // 4) + overhead


def prompt_tokens(endpoint: str, body: dict[str, Any], media: MediaTokens = MEDIA_TOKENS) -> int:
    """An estimate of the prompt's tokens (at least 1); ``media``: the tokens of one media part."""
    if endpoint == "chat/completions":
        # Tools and documents count: without them, a request whose prompt is mostly tool definitions or
        # documents (vLLM renders both into the template) would reserve almost nothing, and concurrent
        # ones could spend far past a limit before their usage is charged.
        extra = _json_chars(body.get("tools")) + _json_chars(body.get("documents"))
        return max(1, _messages_tokens(body.get("messages"), extra, media))
    if endpoint in _SCORING:  # a query and its documents, or pairs of texts (or multimodal items)
        return max(1, -(-sum(_text_chars(body.get(name), media) for name in _SCORING_FIELDS) // 4))
    field = "prompt" if endpoint in _PROMPTED else "input"
    tokens = -(-_text_chars(body.get(field), media) // 4)
    if field == "input" and "messages" in body:  # the pooling routes' chat form (vLLM's messages)
        tokens += _messages_tokens(body["messages"], 0, media)
    if endpoint == "completions" and "prompt_embeds" in body:  # vLLM's prompts given as embeddings
        tokens += embeddings_tokens(body["prompt_embeds"])
    return max(1, tokens)


def reserved_completion(endpoint: str, body: dict[str, Any]) -> int:
    """The most completion tokens the request allows (``max_completion_tokens`` / ``max_tokens``) x n x
    the prompts a completions request batches; 0 when it sets no limit."""
    return requested_completion_tokens(endpoint, body) or 0


def reported_usage(response: dict[str, Any]) -> tuple[int | None, int] | None:
    """(prompt, completion) tokens from the response's ``usage``; without usage (a stream that did not
    ask for it), or with counts that are not non-negative integers up to ``MAX_COUNT`` (a faulty or
    hostile worker's negative count would be billed as a credit, a huge one spend a budget for good),
    or with a completion count a whole answer's output cannot hold (``completion_bound.can_hold``), the
    prompt is unknown (None) and the completion is estimated from its text."""
    usage = response.get("usage")
    if isinstance(usage, dict):
        prompt = count(usage.get("prompt_tokens"))
        completion = count(usage.get("completion_tokens") or 0)
        held = "choices" not in response or completion is None or can_hold(response, completion)
        if prompt is not None and completion is not None and held:
            return prompt, completion
    choices = response.get("choices")
    text = response.get("text")
    if choices is None and isinstance(text, str):  # speech to text: its usage is the audio's seconds
        return None, -(-len(text) // 4)
    if not isinstance(choices, list):
        return None
    chars = 0
    for choice in choices:
        if isinstance(choice, dict):
            message = choice.get("message")
            chars += _text_chars(message.get("content") if isinstance(message, dict) else choice.get("text"))
    return None if not choices else (None, -(-chars // 4))
