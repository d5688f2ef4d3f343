"""The front door subclasses uvicorn's httptools protocol and uses some of its internals; uvicorn is
pinned to a minor range for that. These tests fail loudly, naming the attribute, when an installed
uvicorn no longer has one of them, and show that the check itself can fail."""

from __future__ import annotations

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.ops.settings import Settings
from gateway.server import front_door, uvicorn_internals


def test_every_uvicorn_internal_the_front_door_uses_is_there() -> None:
    assert uvicorn_internals.missing_internals() == []


def test_a_missing_internal_is_named_and_stops_the_server_from_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(HttpToolsProtocol, "_should_upgrade")
    assert uvicorn_internals.missing_internals() == ["HttpToolsProtocol._should_upgrade"]
    with pytest.raises(RuntimeError, match="_should_upgrade"):
        front_door.http_protocol(Settings())


def test_an_instance_attribute_no_method_sets_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    renamed = (*uvicorn_internals.CYCLE_INTERNALS, "renamed_in_a_new_release")
    monkeypatch.setattr(uvicorn_internals, "CYCLE_INTERNALS", renamed)
    assert uvicorn_internals.missing_internals() == ["RequestResponseCycle().renamed_in_a_new_release"]
