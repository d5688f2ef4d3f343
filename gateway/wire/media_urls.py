"""Media URLs in chat messages that point inside the deployment are refused before they reach a worker.

The gateway never fetches a URL a client sends. vLLM does: for a multimodal model it downloads an
``image_url`` / ``audio_url`` / ``video_url`` part itself, from inside the network the workers run in,
so a URL such as ``http://169.254.169.254/latest/meta-data/`` or ``http://redis:6379/`` would make the
worker a request forger (SSRF). The gateway therefore refuses, with 400 naming the part:

- schemes other than ``http``, ``https`` and ``data`` (``file:``, ``ftp:``, ...);
- IP literals that are not globally routable (loopback, private, link-local and the cloud metadata
  address, unspecified, reserved), in every spelling ``inet_aton`` accepts (``127.1``, ``0x7f.0.0.1``,
  ``2130706433``) and IPv6 (including IPv4-mapped);
- host names that only mean something inside a network: ``localhost``, single-label names (resolved
  through the search domains: ``redis``, ``vllm-0``), and ``.localhost``, ``.local``, ``.internal``,
  ``.lan``, ``.home.arpa``, ``.svc``, ``.cluster.local`` names.

A public-looking name can still resolve to an internal address; only the party that resolves and
connects can stop that, so deployments that serve multimodal models also start vLLM with
``--allowed-media-domains`` (and never ``--allowed-local-media-path``). Text-only models refuse media
parts anyway; this check costs a walk over the message parts and nothing for plain string content.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

from gateway.wire.errors import InvalidRequest

_URL_PARTS = ("image_url", "audio_url", "video_url", "input_image")
_INTERNAL_SUFFIXES = (".localhost", ".local", ".internal", ".lan", ".home.arpa", ".svc", ".cluster.local")


_SCORING = frozenset({"rerank", "v2/rerank", "score"})
_SCORING_FIELDS = ("query", "documents", "text_1", "text_2", "queries", "items", "data_1", "data_2")
_CONVERSATIONS = frozenset({"embeddings", "classify", "pooling"})  # input or messages may be conversations


def check_request_media(endpoint: str, body: dict[str, Any]) -> None:
    """``check_media_urls`` on every chat conversation of a request: a chat completion's ``messages``,
    and on embeddings ``messages`` or ``input`` holding one conversation or a batch of them (vLLM
    renders those with the chat template and fetches their media just as for chat)."""
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if isinstance(messages, list):
            check_media_urls(messages)
        return
    if endpoint in _SCORING:
        # Multimodal queries and documents are ``{"content": [parts]}`` objects, fetched like chat's.
        for name in _SCORING_FIELDS:
            value = body.get(name)
            items = [item for item in (value if isinstance(value, list) else [value]) if isinstance(item, dict)]
            if items:
                check_media_urls(items, name)
        return
    if endpoint not in _CONVERSATIONS:
        return
    for name in ("messages", "input"):
        value = body.get(name)
        if not isinstance(value, list) or not value:
            continue
        if all(isinstance(item, dict) for item in value):
            check_media_urls(value, name)
        elif all(isinstance(item, list) for item in value):
            for i, conversation in enumerate(value):
                check_media_urls(conversation, f"{name}[{i}]")


def check_media_urls(messages: list[Any], where: str = "messages") -> None:
    """Raise a 400 for the first media URL that points inside the network (``messages`` is checked;
    ``where`` is its name in the request, for the error's ``param``)."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            found = _part_problem(part) if isinstance(part, dict) else None
            if found is not None:
                field, problem = found
                param = f"{where}[{i}].content[{j}].{field}"
                raise InvalidRequest(
                    f"'{param}' is not accepted: {problem}. Send a public https URL or a data: URL.",
                    param=param,
                    code="url_not_allowed",
                )


def _part_problem(part: dict[str, Any]) -> tuple[str, str] | None:
    """(field, why) for the first media URL of a content part that may not reach a worker, or None."""
    for field in _URL_PARTS:
        value = part.get(field)
        url = value.get("url") if isinstance(value, dict) else value
        problem = url_problem(url) if isinstance(url, str) else None
        if problem is not None:
            return field, problem
    return None


def url_problem(url: str) -> str | None:
    """Why ``url`` may not be handed to a worker, or None when it may."""
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
    except ValueError:
        return "it is not a valid URL"
    scheme = parts.scheme.lower()
    if scheme == "data":
        return None
    if scheme not in ("http", "https"):
        return f"the scheme '{scheme or '(none)'}' is not fetched for clients"
    if not host:
        return "it has no host"
    host = host.rstrip(".").lower()
    address = _ip_literal(host)
    if address is not None:
        return None if address.is_global else f"{address} is not a public address"
    if host == "localhost" or "." not in host or host.endswith(_INTERNAL_SUFFIXES):
        return f"'{host}' names a host inside the network"
    return None


def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            # The spellings C resolvers accept and ipaddress does not: 127.1, 0x7f.1, 017700000001, 2130706433.
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
