"""Beyond ``max_connections`` a new connection is answered 503 at once, unparsed, and closed, while the
connections already open are served as before."""

from __future__ import annotations

import time

import httpx

from tests.server.attacks.raw import CHAT, connect, error_of, read_until_closed
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

LIMIT = 16


def test_connections_beyond_the_limit_get_503_while_established_ones_are_served(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(base_config([upstream_url]), max_connections=LIMIT, first_request_timeout_s=60) as (_, server):
        with httpx.Client(base_url=server.url, timeout=10) as established:
            assert established.get("/health").status_code == 200  # its connection is open and kept
            idle = [connect(server.port) for _ in range(LIMIT - 1)]
            try:
                time.sleep(0.2)  # the server has accepted them all (a loaded machine may take a while)
                flood = [connect(server.port) for _ in range(50)]
                started = time.monotonic()
                answers = [read_until_closed(sock, timeout=10) for sock in flood]
                elapsed = time.monotonic() - started
                for sock in flood:
                    sock.close()
                for answer in answers:
                    error = error_of(answer, 503)
                    assert error["code"] == "too_many_connections" and error["type"] == "server_error"
                assert b"retry-after: 1\r\n" in answers[0]
                print(f"\n50 refused connections answered and closed in {elapsed * 1000:.0f} ms")
                # the established connection is still served, streams included
                assert established.post("/v1/chat/completions", json=CHAT).status_code == 200
                with established.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
                    assert stream.status_code == 200 and b"[DONE]" in stream.read()
            finally:
                for sock in idle:
                    sock.close()
        # once the idle ones are gone, new clients are served again
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "slots were not freed"
            time.sleep(0.1)
    assert len(upstream.requests) == 2
