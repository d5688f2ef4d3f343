"""One tenant cannot starve another's schema compiles.

New constraints are compiled on one thread. A client that sent many distinct slow schemas kept that
thread's queue full: another tenant's harmless new schema waited its 5x budget behind them and got 503
``guided_compiler_busy``. With tenancy, a tenant has at most ``max_compiles_per_tenant`` (1) new
constraints compiling or queued; a further new one is refused at once with that 503, a cached one or one
already being compiled is not. Compiles are held here deterministically: the automaton count of a
schema whose property is named ``held`` waits on an Event.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import plugins.guided_json.compile as compile_module
from plugins.tenancy.keys import hash_key
from tests.plugins.routing.test_retry_budget_and_fallback import metric
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

# Large enough that a request queued behind a compile waits (5x: 20 s) far longer than a refusal takes
BUDGET_MS = 4000
REFUSED = 'gateway_guided_json_constraints_total{outcome="refused"}'


def secret(tenant: str) -> str:
    return f"sk-gw-compile-fairness-{tenant}"


class Gate:
    """Holds the count of a schema with a ``held`` property until ``release``; records the order in which
    constraints were counted (by their property name) and how many jobs reached the compile thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = compile_module.count_states
        self.holding, self.released = threading.Event(), threading.Event()
        self.counted: list[str] = []
        self.submitted = 0
        gate = self

        class Executor(ThreadPoolExecutor):
            def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
                future = super().submit(fn, *args, **kwargs)
                gate.submitted += 1  # on the event loop only: no lock needed
                return future

        monkeypatch.setattr(compile_module, "count_states", self)
        monkeypatch.setattr(compile_module, "ThreadPoolExecutor", Executor)

    def __call__(self, regex: str, *limits: float) -> int | str:
        name = next(n for n in ("held", "a1", "a2", "a3", "a4", "b0", "cached", "again") if f'"{n}"' in regex)
        if name == "held":
            self.holding.set()
            assert self.released.wait(60), "the test never released the held compile"
        self.counted.append(name)
        return self.real(regex, *limits)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    return Gate(monkeypatch)


@pytest.fixture
def guided(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, gate: Gate
) -> Iterator[ServerThread]:
    keys = [{"id": f"key-{t}", "tenant": t, "hash": hash_key(secret(t), PEPPER.encode())} for t in ("a", "b")]
    plugins: list[dict[str, Any]] = [
        {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}},
        {"name": "guided_json", "config": {"probe": False, "compile_timeout_ms": BUDGET_MS}},
        {"name": "routing"},
    ]
    upstream.behavior.text = "{}"  # satisfies every schema below
    with gateway_factory(base_config([upstream_url], plugins=plugins)) as (_, server):
        try:
            yield server
        finally:
            gate.released.set()  # a failed test must not leave the compile thread held


def guided_chat(server: ServerThread, tenant: str, name: str, timeout: float = 60) -> httpx.Response:
    """A chat request whose schema is new for each ``name`` (the name is its one property's)."""
    schema = {"type": "object", "properties": {name: {"type": "string"}}}
    body = {
        "model": "m1",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    headers = {"authorization": f"Bearer {secret(tenant)}"}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)


class Sent:
    """A request sent on its own thread; ``reply`` once it has been answered."""

    def __init__(self, call: Callable[[], httpx.Response]) -> None:
        self.reply: httpx.Response | BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,))
        self.thread.start()

    def _run(self, call: Callable[[], httpx.Response]) -> None:
        try:
            self.reply = call()
        except BaseException as exc:  # the test asserts on it
            self.reply = exc

    def answered(self, within_s: float) -> httpx.Response:
        self.thread.join(within_s)
        assert isinstance(self.reply, httpx.Response), f"not answered within {within_s:g} s: {self.reply!r}"
        return self.reply


def hold(server: ServerThread, gate: Gate, tenant: str = "a", timeout: float = 60) -> Sent:
    """``tenant``'s request whose compile holds the compile thread until ``gate.released``."""
    holder = Sent(lambda: guided_chat(server, tenant, "held", timeout))
    assert gate.holding.wait(30), "the held compile never started"
    return holder


def test_a_tenants_further_new_schemas_are_refused_at_once_while_one_compiles(
    guided: ServerThread, gate: Gate, upstream: FakeUpstream
) -> None:
    assert guided_chat(guided, "a", "cached").status_code == 200
    holder = hold(guided, gate)
    joiner = Sent(lambda: guided_chat(guided, "a", "held"))  # the same schema: joins the compile under way
    refused_before = metric(guided, REFUSED)
    burst = [Sent(lambda n=n: guided_chat(guided, "a", n)) for n in ("a1", "a2", "a3")]  # type: ignore[misc]
    for sent in burst:
        reply = sent.answered(10)  # at once: before the fix they queued, and only the 5x wait (20 s) ended it
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "guided_compiler_busy"
        # until the held compile's request stops waiting (5x the budget from its start): a retry after
        # 1 s, as before, spent the client's retries on more refusals while the slot was still held
        assert 10 < int(reply.headers["retry-after"]) <= 5 * BUDGET_MS / 1000
    assert metric(guided, REFUSED) == refused_before + 3
    again = guided_chat(guided, "a", "cached", timeout=10)  # compiled already: no slot needed
    assert again.status_code == 200, again.text
    gate.released.set()
    assert holder.answered(30).status_code == 200
    assert joiner.answered(30).status_code == 200
    assert gate.counted == ["cached", "held"]  # the burst never reached the compile thread


def test_another_tenants_new_schema_waits_only_for_the_one_compile_under_way(
    guided: ServerThread, gate: Gate, upstream: FakeUpstream
) -> None:
    holder = hold(guided, gate)
    submitted = gate.submitted
    burst = [Sent(lambda n=n: guided_chat(guided, "a", n)) for n in ("a1", "a2", "a3", "a4")]  # type: ignore[misc]
    # each of a's is refused (with the fix) or queued for the compile thread (before it: ahead of b's)
    wait_for(lambda: sum(s.reply is not None for s in burst) + gate.submitted - submitted >= 4, 20, "a's burst")
    submitted = gate.submitted
    other = Sent(lambda: guided_chat(guided, "b", "b0"))
    wait_for(lambda: gate.submitted == submitted + 1, 20, "b's compile to be queued")
    gate.released.set()
    reply = other.answered(30)
    assert reply.status_code == 200, reply.text
    assert gate.counted[:2] == ["held", "b0"]  # no other compile of a's ran before b's
    assert holder.answered(30).status_code == 200
    assert [s.answered(30).status_code for s in burst] == [503] * 4


def test_a_client_gone_while_its_compile_runs_frees_its_tenants_slot_when_the_compile_ends(
    guided: ServerThread, gate: Gate, upstream: FakeUpstream
) -> None:
    holder = hold(guided, gate, timeout=0.5)  # the client gives up and disconnects while it is held
    holder.thread.join(10)
    assert isinstance(holder.reply, httpx.TimeoutException), holder.reply
    refused = guided_chat(guided, "a", "a1", timeout=10)  # the compile goes on: the slot is still held
    assert refused.status_code == 503, refused.text
    gate.released.set()
    # the same schema again: it joins the compile or finds it cached, so it answers once the compile ended
    assert guided_chat(guided, "a", "held", timeout=20).status_code == 200
    served = guided_chat(guided, "a", "again", timeout=20)  # no slot kept for a client that is gone
    assert served.status_code == 200, served.text
