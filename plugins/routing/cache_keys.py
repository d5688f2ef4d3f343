"""``prompt_cache_key``: the client's word that requests belong to one cache lineage.

OpenAI routes a request by a hash of its prompt's start combined with this key, so that clients whose
requests share a long prefix (one system prompt for every user) can still keep each user's
conversation on one machine. Without it a gateway cannot tell the first turns of eight conversations
from eight repeats of one prompt: both share the same head and nothing else yet, and only the future
differs (conversations grow; repeats do not). With it:

- approximate affinity hashes the prompt's start and the key together (``affinity_text``);
- precise placement sends a key's first request as if its prompt were cold (to the worker whose recent
  working set is smallest, among those under the load cap), and the key's later requests back to
  where it went last (``KeyHomes``, a scorer of its own beside the held prefix and the load).

The key is scoped by tenant, so two tenants' equal keys are two lineages. Memory: ``KeyHomes`` keeps
at most ``max_entries`` keys per model (a 64-bit hash and a shared URL string each, about 116 bytes),
the least recently used dropped first; a client sending a new key per request spreads its own requests
and can push other lineages out sooner, which are then placed by their held blocks, as without a key.
"""

from __future__ import annotations

from typing import Any

from plugins.routing.policies import stable_hash


def prompt_cache_key(body: dict[str, Any]) -> str | None:
    """The request's ``prompt_cache_key``, when it is a non-empty string."""
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


def affinity_text(prefix: str, body: dict[str, Any]) -> str:
    """What approximate affinity hashes: the prompt's start, and the cache key when there is one."""
    key = prompt_cache_key(body)
    return prefix if key is None else f"{prefix}\x1f{key}"


def lineage(tenant: str | None, body: dict[str, Any]) -> int | None:
    """The request's lineage (its tenant and cache key, hashed), or None without a key."""
    key = prompt_cache_key(body)
    return None if key is None else stable_hash(f"{tenant or ''}\x1f{key}".encode("utf-8", "surrogatepass"))


class KeyHomes:
    """Lineage -> the worker its last request went to, least recently used dropped past ``max_entries``."""

    __slots__ = ("_homes", "max_entries")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._homes: dict[int, str] = {}  # insertion order is recency: a use moves a key to the end

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, lineage: int) -> str | None:
        return self._homes.get(lineage)

    def remember(self, lineage: int, url: str) -> None:
        homes = self._homes
        homes.pop(lineage, None)
        homes[lineage] = url
        while len(homes) > self.max_entries:
            del homes[next(iter(homes))]
