"""The OpenAI request shapes the gateway itself must understand, checked once and cheaply.

The gateway parses a request body once (orjson) and checks only what it needs to route and to give a
clear error early: the model, the stream flags, and the shape of the fields every worker requires. The
rest of the body is passed to the worker untouched, and the worker's own validation errors are
translated into OpenAI's vocabulary (``gateway.wire.errors.from_upstream``). Which top-level fields a
client may send at all is ``gateway.wire.allowlist``'s decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.wire.errors import InvalidRequest, UnsupportedMediaType

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
#: Deepest nesting accepted. orjson parses up to 1024 levels but serialises only up to 254, and the
#: gateway re-serialises a body a plugin changed (or an alias rewrote): deeper bodies would fail there.
#: vLLM's own parser stops at 200 levels; no OpenAI request needs more than a few dozen.
MAX_DEPTH = 128


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # "chat/completions"
    path: str  # upstream path
    streams: bool  # whether "stream": true is meaningful


ENDPOINTS = {
    "/v1/chat/completions": Endpoint("chat/completions", "/v1/chat/completions", True),
    "/v1/completions": Endpoint("completions", "/v1/completions", True),
    "/v1/embeddings": Endpoint("embeddings", "/v1/embeddings", False),
}
#: vLLM's other model-addressed JSON routes (pooling models: rerankers, cross-encoders, classifiers),
#: served like embeddings: the body's model picks the workers, no streaming, the worker checks the rest.
#: Each goes to the same path on the worker (vLLM serves the unversioned spellings with the same handler).
MODEL_ROUTES = {
    "/v1/rerank": Endpoint("rerank", "/v1/rerank", False),
    "/rerank": Endpoint("rerank", "/rerank", False),
    "/v2/rerank": Endpoint("v2/rerank", "/v2/rerank", False),
    "/v1/score": Endpoint("score", "/v1/score", False),
    "/score": Endpoint("score", "/score", False),
    "/classify": Endpoint("classify", "/classify", False),
    "/pooling": Endpoint("pooling", "/pooling", False),
}
ENDPOINTS.update(MODEL_ROUTES)


def check_content_type(headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a body declared as something other than JSON (``text/plain``, a form, multipart) with a
    415, as OpenAI and vLLM do. ``application/json`` (any parameters) and ``application/*+json`` pass;
    a request without a content-type is read as JSON."""
    for name, value in headers:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            if media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json")):
                return
            shown = media.decode("latin-1")[:100] or "(empty)"
            raise UnsupportedMediaType(
                f"Unsupported content-type '{shown}': send the request body as JSON with"
                " 'content-type: application/json'.",
                code="unsupported_media_type",
            )
    return


def decimal(text: str) -> int | None:
    """``text`` as a non-negative integer of at most 18 ASCII digits, else None: a client's query or
    header value must not turn into a 500. ``str.isdigit`` alone also takes digits such as "²", which
    ``int`` refuses, and ``int`` refuses more than 4,300 digits; no count or age needs more than 18."""
    return int(text) if len(text) <= 18 and text.isascii() and text.isdigit() else None


def parse_body(raw: bytes) -> dict[str, Any]:
    """JSON object or a 400 saying what is wrong with it (NaN and Infinity are not JSON)."""
    if not raw:
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc.args[0]}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise InvalidRequest(
            f"The request body must be a JSON object, not {type(payload).__name__}.", code="invalid_json"
        )
    if too_deep(raw, payload):
        raise InvalidRequest(f"The request body is nested more than {MAX_DEPTH} levels deep.", code="invalid_json")
    return payload


def too_deep(raw: bytes, value: object) -> bool:
    """Whether ``value``, parsed from (a part of) ``raw``, nests arrays/objects more than ``MAX_DEPTH``
    levels. Nesting that deep needs that many brackets in ``raw``: two C-speed counts spare the walk for
    nearly every body."""
    return raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _deeper_than(value, MAX_DEPTH)


def _deeper_than(value: object, limit: int) -> bool:
    """Whether ``value`` nests arrays/objects more than ``limit`` levels (level by level: no recursion)."""
    level: list[Any] = [value]
    depth = 1
    while level:
        if depth > limit:
            return True
        below: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            below.extend(child for child in children if type(child) is dict or type(child) is list)
        level = below
        depth += 1
    return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def requested_choices(body: dict[str, Any]) -> int:
    """How many choices the request asks for (``n``, 1 when absent or not a positive integer)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def requested_prompts(endpoint: str, body: dict[str, Any]) -> int:
    """How many prompts a request to ``endpoint`` (``Endpoint.name``) batches: a completions ``prompt``
    that is a list of strings or of token id lists is one generation (of ``n`` choices) per prompt;
    anything else is one. Only the legacy completions endpoint batches: a ``prompt`` list on any other
    (an operator's extra field on chat, which vLLM ignores there) asks for nothing more."""
    if endpoint != "completions":
        return 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def requested_completion_tokens(endpoint: str, body: dict[str, Any]) -> int | None:
    """The most completion tokens a request to ``endpoint`` allows over all its choices:
    ``max_completion_tokens`` (else ``max_tokens``) times ``n`` times the prompts it batches; None when
    it sets no positive integer limit."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    return limit * requested_choices(body) * requested_prompts(endpoint, body)


def check_request(endpoint: Endpoint, body: dict[str, Any]) -> tuple[str, bool]:
    """Check the fields the gateway relies on. Returns (model name, stream)."""
    model = body.get("model")
    if model is None:
        raise InvalidRequest("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string.", param="model")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    if stream and not endpoint.streams:
        raise InvalidRequest(f"'stream' is not supported on /v1/{endpoint.name}.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")

    if endpoint.name == "chat/completions":
        _check_messages(body.get("messages"))
    elif endpoint.name == "completions":
        _check_prompt(body.get("prompt"))
    elif endpoint.name == "embeddings" and body.get("input") is None:
        raise InvalidRequest("You must provide an 'input' parameter.", param="input", code="missing_required_parameter")

    for name in ("n", "max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise InvalidRequest(f"'{name}' must be a positive integer (got {value!r}).", param=name)
    return model, stream


def _check_messages(messages: object) -> None:
    if messages is None:
        raise InvalidRequest(
            "You must provide a 'messages' parameter.", param="messages", code="missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array of message objects.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"'messages[{i}].role' must be one of {', '.join(sorted(CHAT_ROLES))} (got {role!r}).",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise InvalidRequest(
                f"'messages[{i}].content' must be a string or an array of content parts.",
                param=f"messages[{i}].content",
            )


def _check_prompt(prompt: object) -> None:
    if prompt is None:
        raise InvalidRequest(
            "You must provide a 'prompt' parameter.", param="prompt", code="missing_required_parameter"
        )
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_int(p) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return
    raise InvalidRequest(
        "'prompt' must be a string, an array of strings, or an array (of arrays) of token ids.", param="prompt"
    )


#: Headers that carry a credential: sent twice, a request is refused rather than one of them picked
#: (two readers picking differently is how one credential gets checked and another used).
CREDENTIAL_HEADERS = ("authorization", "x-admin-token", "api-key", "x-api-key")


def header_dict(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """An ASGI scope's headers as the dict plugins see (``ctx.headers``): lower-cased names. A
    credential header sent more than once is a 400 (``duplicate_credentials``)."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
    if len(headers) != len(raw):
        check_single_credentials(raw)
    return headers


def check_single_credentials(raw: list[tuple[bytes, bytes]]) -> None:
    """Raise a 400 when a credential header appears more than once (any spelling of its name)."""
    seen: set[str] = set()
    for name, _ in raw:
        key = name.decode("latin-1").lower()
        if key in CREDENTIAL_HEADERS:
            if key in seen:
                raise InvalidRequest(
                    f"The request has more than one '{key}' header; send exactly one.",
                    param=key,
                    code="duplicate_credentials",
                )
            seen.add(key)
