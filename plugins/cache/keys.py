"""The cache key: a hash over the canonical request, the namespace and the tenant scope.

What is in the key is decided by exclusion: every top-level request field is assumed to change the
answer (messages, sampling parameters, response_format, tools, tool_choice, logprobs, n, and any
engine-specific extra such as ``guided_json``) except the few listed in ``NOT_IN_KEY``, which only
change how the answer is delivered or who asked. A field vLLM adds tomorrow is therefore keyed by
default: a missed hit costs engine time, a wrong hit serves a wrong answer.

The key also names the model's backing (``backing_of``: the name the workers serve it under and the
workers it is configured on): a config that changes either makes the older entries unreachable at
once, with no scan and no purge (they expire by their TTL).

Only the top level is normalised (key order, ``null`` meaning absent, ``1.0 == 1``): nested objects
are hashed as the client sent them, because their order can change the output (the property order of
a JSON schema is the order guided decoding emits fields in).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import quote

import orjson

#: Fields that never change the generated answer. ``model`` is replaced by the resolved model name,
#: so an alias and its model share entries.
NOT_IN_KEY = frozenset(
    {"model", "stream", "stream_options", "user", "request_id", "metadata", "store", "priority", "service_tier"}
)
#: Fields whose output one shape of answer cannot carry to the other: the token ids vLLM returns
#: (``prompt_token_ids`` on the first stream event, ``token_ids`` per choice) are lost when stream events
#: are assembled into an answer or an answer is replayed as events, and vLLM refuses ``prompt_logprobs``
#: on a stream. A request with one of them keeps ``stream`` in its key.
_SHAPE_BOUND = ("return_token_ids", "prompt_logprobs")
KEY_VERSION = b"2"
_INT_RANGE = 2**63
_GLOB_SPECIAL = str.maketrans({c: "\\" + c for c in "*?[]\\"})


@dataclass(frozen=True, slots=True)
class CacheKey:
    """The Redis keys of one request: its entry and its single-flight lock (same hash slot)."""

    digest: str
    entry: str
    lock: str


def _shape_bound(body: dict[str, Any]) -> bool:
    """Whether the request asks for something only its own shape of answer carries (``_SHAPE_BOUND``)."""
    for name in _SHAPE_BOUND:
        asked = body.get(name)
        if asked is not None and asked is not False:
            return True
    return False


def canonical_request(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The output-relevant fields of a request body, in a stable order."""
    out: list[tuple[str, Any]] = []
    for name in sorted(body):
        value = body[name]
        if name in NOT_IN_KEY and (name != "stream" or value is not True or not _shape_bound(body)):
            continue
        if value is None or (name == "n" and value == 1):
            continue  # explicit null and the default n are the same request as leaving them out
        if isinstance(value, float) and value.is_integer() and -_INT_RANGE <= value < _INT_RANGE:
            value = int(value)  # a larger one stays a float: JSON serialization takes 64-bit integers only
        out.append((name, value))
    return out


def backing_of(served_name: str, workers: list[str], managed: dict[str, str]) -> str:
    """A short hash of what produces a model's answers: the name its workers serve it under and its
    worker refs (a managed worker named by the model it runs, so swapping that model changes it)."""
    refs = sorted(f"{ref}={managed[ref]}" if ref in managed else ref for ref in workers)
    return hashlib.blake2b(orjson.dumps([served_name, refs]), digest_size=8).hexdigest()


def make_key(
    *,
    prefix: str,
    namespace: str,
    tenant: str | None,
    default_scope: str,
    endpoint: str,
    model: str,
    body: dict[str, Any],
    backing: str = "",
    omit: str | None = None,
) -> CacheKey:
    """Hash everything that decides the answer and who may see it.

    A tenant and the default scope are tagged differently, so a tenant named like the default scope
    still never shares entries with unscoped requests. ``omit``: a field the gateway, not the client,
    put in the body (tenancy's clamped ``max_tokens``), keyed as if absent: the request is keyed as the
    client sent it, so that a value that changes with every request does not change its key.
    """
    if omit is not None and omit in body:
        body = {name: value for name, value in body.items() if name != omit}
    scope = ["tenant", tenant] if tenant is not None else ["scope", default_scope]
    material = orjson.dumps([namespace, scope, endpoint, model, backing, canonical_request(body)])
    digest = hashlib.blake2b(KEY_VERSION + material, digest_size=16).hexdigest()
    # The {digest} hash tag keeps entry and lock in one slot, so the Lua scripts also work on a cluster.
    return CacheKey(
        digest=digest,
        entry=f"{prefix}:{namespace}:e:{_segment(model)}:{{{digest}}}",
        lock=f"{prefix}:{namespace}:l:{{{digest}}}",
    )


def entry_pattern(prefix: str, namespace: str, model: str | None) -> str:
    """A SCAN MATCH pattern for the entries of a namespace, or of one model in it (for purges)."""
    base = f"{prefix}:{namespace}:e:".translate(_GLOB_SPECIAL)
    if model is None:
        return base + "*"
    return base + _segment(model).translate(_GLOB_SPECIAL) + ":*"


@lru_cache(maxsize=1024)  # a key per request, and the models a config serves are few
def _segment(model: str) -> str:
    # Model names may contain ':' (e.g. "llama3:8b"); quoting keeps one model's pattern from
    # matching another's entries.
    return quote(model, safe="")
