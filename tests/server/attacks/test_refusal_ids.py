"""The front door's own answers (a head refused, a body that does not arrive) carry an ``x-request-id``
like every answer of the app, and each is written to the access log under that id, so a client's report
of a refusal can be found in the logs."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest

from tests.server.attacks.raw import connect, error_of, head, parse, read_until_closed
from tests.server.attacks.test_head_bounds import send_and_read
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config


@pytest.fixture
def strict(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> Iterator[ServerThread]:
    with gateway_factory(base_config([upstream_url]), body_timeout_s=1.0) as (_, server):
        yield server


def _refusals(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "gateway.access" and getattr(r, "fields", {}).get("route") == "front_door"
    ]


def test_each_refused_head_gets_a_request_id_of_its_own_and_an_access_line(
    strict: ServerThread, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    too_large = head(extra=b"X-Big: " + b"a" * 64 * 1024 + b"\r\n\r\n")
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        answers = [send_and_read(strict.port, too_large) for _ in range(2)]
    ids = []
    for answer in answers:
        assert error_of(answer, 431)["code"] == "request_header_fields_too_large"
        ids.append(parse(answer)[1]["x-request-id"])
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1], ids
    assert [(f["request_id"], f["status"]) for f in _refusals(caplog)] == [(ids[0], 431), (ids[1], 431)]
    assert upstream.requests == []


def test_a_body_that_does_not_arrive_keeps_the_clients_request_id(
    strict: ServerThread, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    # The head was read, so the client's own id is known: its 408 carries it, as any answer would.
    framing = b"x-request-id: client-req-17\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    with caplog.at_level(logging.INFO, logger="gateway.access"), connect(strict.port) as sock:
        sock.sendall(head(extra=framing) + b'{"model":')
        answer = read_until_closed(sock, timeout=10)
    assert error_of(answer, 408)["code"] == "request_timeout"
    assert parse(answer)[1]["x-request-id"] == "client-req-17"
    assert [(f["request_id"], f["status"]) for f in _refusals(caplog)] == [("client-req-17", 408)]
    assert upstream.requests == []
