"""A ``dns://`` worker ref whose answers a test controls: the routing plugin with a scripted resolver, and
two fake workers on one port at two loopback addresses (127.0.0.1 and 127.0.0.2)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from plugins.routing import RoutingPlugin
from tests.support.fakes import FakeUpstream, ServerThread

NAME = "workers.default.svc"


def scripted_routing(answers: dict[str, list[str]]) -> type[RoutingPlugin]:
    """The routing plugin resolving each name to ``answers[name]`` as it is at that moment."""

    class ScriptedRouting(RoutingPlugin):
        @staticmethod
        async def resolver(host: str, port: int) -> list[str]:
            return list(answers[host])

    return ScriptedRouting


@contextlib.contextmanager
def two_addresses(port: int) -> Iterator[tuple[FakeUpstream, FakeUpstream]]:
    """Fake workers at 127.0.0.1:``port`` and 127.0.0.2:``port``, serving until the block ends."""
    first, second = FakeUpstream(name="a"), FakeUpstream(name="b")
    one, two = ServerThread(first, port), ServerThread(second, port)
    two.server.config.host = "127.0.0.2"
    with one, two:
        yield first, second
