"""Shared by the tenancy tests: the pepper they hash keys with, and a unique Redis prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from plugins.tenancy.keys import hash_key

PEPPER = "pepper-for-tests"


@pytest.fixture
def prefix(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A unique Redis namespace per test, deleted afterwards."""
    monkeypatch.setenv("GATEWAY_TENANCY_PEPPER", PEPPER)
    name = f"test:tenancy:{uuid.uuid4().hex}"
    yield name
    client = redis.Redis()
    keys = list(client.scan_iter(match=f"{name}*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


#: Client keys of two tenants for the usage tests: k1 and k2 of acme (k1 limited to 3 requests a
#: minute, so its 4th and 5th are refused), other of globex.
USAGE_KEYS = {"k1": "sk-gw-usage-one", "k2": "sk-gw-usage-two", "other": "sk-gw-usage-other"}


def usage_plugins(prefix: str) -> list[dict[str, object]]:
    """Tenancy with ``USAGE_KEYS`` under ``prefix``, then routing."""
    keys: list[dict[str, object]] = [
        {"id": key_id, "tenant": "globex" if key_id == "other" else "acme", "hash": hash_key(key, PEPPER.encode())}
        for key_id, key in USAGE_KEYS.items()
    ]
    keys[0]["limits"] = {"requests_per_minute": 3}
    return [{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}}, {"name": "routing"}]
