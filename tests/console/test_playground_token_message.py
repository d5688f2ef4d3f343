"""The playground's 401 says where it reads the admin token, and it does read it there (issue 30: it
told the user to send ``Authorization: Bearer <admin token>`` but read only ``x-admin-token``, since its
``Authorization`` carries the client key it passes on). The other admin routes take either header and
say so."""

from __future__ import annotations

import httpx

from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "playground-message-admin-token"
BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def test_the_playground_401_names_the_header_it_reads_and_that_header_works(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (_, server):
        url = server.url + "/admin/ui/chat"
        refused = [
            httpx.post(url, json=BODY),
            httpx.post(url, json=BODY, headers={"authorization": f"Bearer {TOKEN}"}),  # where the 401 used to say
        ]
        for answer in refused:
            assert answer.status_code == 401, answer.text
            message = answer.json()["error"]["message"]
            assert "x-admin-token: <GATEWAY_ADMIN_TOKEN>" in message
            assert "Authorization: Bearer <GATEWAY_ADMIN_TOKEN>" not in message
        assert upstream.requests == []
        # Doing what the message says works.
        assert httpx.post(url, json=BODY, headers={"x-admin-token": TOKEN}).status_code == 200


def test_other_admin_routes_say_both_headers_and_take_both(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (_, server):
        url = server.url + "/admin/config"
        message = httpx.get(url).json()["error"]["message"]
        assert "Authorization: Bearer <GATEWAY_ADMIN_TOKEN>" in message and "x-admin-token" in message
        assert httpx.get(url, headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert httpx.get(url, headers={"x-admin-token": TOKEN}).status_code == 200
