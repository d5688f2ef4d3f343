"""A gateway on the fake worker whose Responses store lives under a prefix of its own, deleted after."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import redis

from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config


@contextlib.contextmanager
def responses_gateway(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    prefix = f"test:responses:{uuid.uuid4().hex}"
    try:
        with gateway_factory(base_config([upstream_url], responses={"redis_prefix": prefix})) as (_, server):
            yield server
    finally:
        client = redis.Redis()
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
