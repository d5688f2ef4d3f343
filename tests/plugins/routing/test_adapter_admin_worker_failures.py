"""Admin actions on adapters whose call to the worker fails on the way (refused, no answer in time): the
operator gets the loader's error in the OpenAI shape, naming the worker, never a 500; what the gateway
believes the worker holds is left as it was."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from tests.plugins.routing.test_adapters_through_the_gateway import ADMIN_TOKEN, admin, fleet, lora_config
from tests.support.faults import BlackHole, check_openai_error
from tests.support.gateways import GatewayFactory


@contextlib.contextmanager
def refusing_url() -> Iterator[str]:
    """The URL of a port bound but not listening, held for the test: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_pinning_an_adapter_on_a_worker_that_refuses_connections_is_a_502(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, refusing_url() as dead:
        config = lora_config(workers)
        config["models"][0]["workers"].append(dead)
        with gateway_factory(config, admin_token=ADMIN_TOKEN) as (app, gw):
            reply = admin(gw, "pin_adapter", adapter="sql-v1", worker=dead)
            assert reply.status_code == 502, reply.text
            error = check_openai_error(reply.json())
            assert (error["type"], error["code"]) == ("server_error", "adapter_load_failed")  # the loader's code
            assert dead in error["message"] and "'sql'" in error["message"]
            state = app.state.services.workers.get(dead).adapters
            assert "sql" not in state.pinned and "sql" not in state.held and not state.loading


def test_unloading_an_adapter_from_a_worker_that_refuses_connections_is_a_502(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, refusing_url() as dead:
        config = lora_config(workers)
        config["models"][0]["workers"].append(dead)
        with gateway_factory(config, admin_token=ADMIN_TOKEN) as (app, gw):
            state = app.state.services.workers.get(dead).adapters
            state.added("sql", 1.0, "/adapters/sql")  # learnt before the worker went away
            reply = admin(gw, "unload_adapter", adapter="sql", worker=dead)
            assert reply.status_code == 502, reply.text
            assert check_openai_error(reply.json())["code"] == "adapter_load_failed"
            assert dead in reply.json()["error"]["message"]
            assert not state.unloading  # (what it holds may be forgotten meanwhile: the worker is unhealthy)


def test_pinning_an_adapter_on_a_worker_that_never_answers_is_a_504(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, BlackHole() as hole:
        config = lora_config(workers)
        config["models"][0]["workers"].append(hole.url)
        config["upstream"]["first_byte_timeout_s"] = 0.5
        with gateway_factory(config, admin_token=ADMIN_TOKEN) as (app, gw):
            reply = admin(gw, "pin_adapter", adapter="sql", worker=hole.url)
            assert reply.status_code == 504, reply.text
            assert check_openai_error(reply.json())["code"] == "adapter_load_timeout"
            assert "sql" not in app.state.services.workers.get(hole.url).adapters.pinned
