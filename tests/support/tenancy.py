"""Shared by the tenancy tests: the pepper they hash keys with, and a unique Redis prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

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
