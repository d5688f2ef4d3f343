"""Batches and files with tenancy on: one tenant can never list, read, download, delete, run or cancel
another's (the same 404 an unknown id gets); lines run as the key that created the batch (its model
allow-list, a revoked key refused line by line) and are charged at the batch price; a line cut midway
pays its prompt when its owner cancelled the batch, and nothing when the gateway stopped it (an
operator's cancel, expiry, a shutdown that gives the line back to run again)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
import redis

from plugins.tenancy.keys import hash_key
from tests.support.batches import batches_section, chat_line, jsonl, parse_jsonl, start, wait_for
from tests.support.fakes import Behavior, FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

KEYS = {
    "acme-1": ("acme", ["*"]),
    "acme-2": ("acme", ["*"]),
    "globex-1": ("globex", ["*"]),
    "narrow": ("initech", ["other-model"]),
}
SECRETS = {kid: f"sk-{kid}-{uuid.uuid4().hex}" for kid in KEYS}
__all__ = ["prefix"]


def gateway_config(upstream_url: str, prefix: str, batch_names: dict[str, Any], **tenancy: Any) -> Any:
    keys = [
        {"id": kid, "tenant": tenant, "hash": hash_key(SECRETS[kid], PEPPER.encode()), "models": models}
        for kid, (tenant, models) in KEYS.items()
    ]
    section = {"redis_prefix": prefix, "keys": keys, **tenancy}
    plugins = [{"name": "tenancy", "config": section}, {"name": "routing"}]
    return base_config([upstream_url], plugins=plugins, batches=batches_section(batch_names))


def sdk(server: ServerThread, kid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=SECRETS[kid], max_retries=0)


def error_of(server: ServerThread, kid: str, method: str, path: str, **kw: Any) -> tuple[int, Any]:
    reply = httpx.request(method, server.url + path, headers={"authorization": f"Bearer {SECRETS[kid]}"}, **kw)
    return reply.status_code, reply.json()


def test_one_tenant_never_reaches_another_tenants_files_or_batches(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    config = gateway_config(upstream_url, prefix, batch_names)
    with gateway_factory(config) as (_, server):
        acme, acme_again, globex = sdk(server, "acme-1"), sdk(server, "acme-2"), sdk(server, "globex-1")
        secret = jsonl([chat_line("a-1", "acme's secret plan")])
        mine = acme.files.create(file=("plan.jsonl", secret), purpose="batch")
        batch = acme.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_for(acme, batch.id, ("completed",))
        assert done.output_file_id is not None

        # the same tenant through another key sees everything
        assert acme_again.files.retrieve(mine.id).id == mine.id
        assert acme_again.batches.retrieve(batch.id).status == "completed"
        assert {f.id for f in acme_again.files.list()} == {mine.id, done.output_file_id}

        # another tenant sees nothing, and each answer is the one an unknown id gets
        assert globex.files.list().data == [] and globex.batches.list().data == []
        unknown_file, unknown_batch = "file-" + "0" * 24, "batch_" + "0" * 24
        for own, other in ((mine.id, unknown_file), (done.output_file_id, unknown_file)):
            for method, suffix in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
                status, body = error_of(server, "globex-1", method, f"/v1/files/{own}{suffix}")
                _, unknown = error_of(server, "globex-1", method, f"/v1/files/{other}{suffix}")
                assert status == 404, body
                assert body["error"] == {**unknown["error"], "message": unknown["error"]["message"].replace(other, own)}
        for method, suffix in (("GET", ""), ("POST", "/cancel")):
            status, body = error_of(server, "globex-1", method, f"/v1/batches/{batch.id}{suffix}")
            _, unknown = error_of(server, "globex-1", method, f"/v1/batches/{unknown_batch}{suffix}")
            assert status == 404, body
            assert body["error"] == {
                **unknown["error"],
                "message": unknown["error"]["message"].replace(unknown_batch, batch.id),
            }
        # nor can it run a batch on acme's file (and learn its content from the output)
        status, body = error_of(
            server,
            "globex-1",
            "POST",
            "/v1/batches",
            json={"input_file_id": mine.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        )
        assert status == 404 and body["error"]["param"] == "input_file_id"
        # acme's file is intact after every attempt
        assert acme.files.content(mine.id).content == secret

        # no key: the plugin's 401, before anything is read or listed
        anonymous = httpx.get(server.url + "/v1/files")
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
        upload = httpx.post(server.url + "/v1/files", files={"file": ("x.jsonl", secret)}, data={"purpose": "batch"})
        assert upload.status_code == 401


def test_lines_run_as_the_key_that_created_the_batch(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    config = gateway_config(upstream_url, prefix, batch_names)
    with gateway_factory(config) as (_, server):
        narrow = sdk(server, "narrow")  # a key that may use 'other-model' only
        source = narrow.files.create(file=("in.jsonl", jsonl([chat_line("n-1", "hi")])), purpose="batch")
        batch = narrow.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_for(narrow, batch.id, ("completed",))
        assert done.error_file_id is not None and done.output_file_id is None
        (line,) = parse_jsonl(narrow.files.content(done.error_file_id).content)
        assert line["custom_id"] == "n-1" and line["response"]["status_code"] == 404
        assert line["response"]["body"]["error"]["code"] == "model_not_found"
    assert upstream.requests == []  # refused by tenancy: the worker never saw the line


def test_a_batch_line_is_charged_at_the_batch_price(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    config = gateway_config(upstream_url, prefix, batch_names, batch_price_factor=0.5)
    with gateway_factory(config, admin_token="adm") as (_, server):
        acme = sdk(server, "acme-1")
        lines = [chat_line(f"c-{i}", "abcd", max_tokens=3) for i in range(4)]
        source = acme.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = acme.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_for(acme, batch.id, ("completed",)).request_counts.completed == 4  # type: ignore[union-attr]
        live = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 3},
            headers={"authorization": f"Bearer {SECRETS['acme-1']}"},
        )
        assert live.status_code == 200
        day = settled_usage(server, lambda d: d.get("requests") == 5 and d.get("completion_tokens", 0) >= 8 + 3)
    # the fake worker reports 5 prompt and 3 completion tokens per answer: a line costs ceil(half) of each
    assert (day["prompt_tokens"], day["completion_tokens"]) == (4 * 3 + 5, 4 * 2 + 3)


def settled_usage(server: ServerThread, done: Any, timeout_s: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.post(
            server.url + "/admin/plugins/tenancy/usage",
            json={"key_id": "acme-1"},
            headers={"authorization": "Bearer adm"},
        )
        assert reply.status_code == 200, reply.text
        day: dict[str, Any] = reply.json()["result"]["day"]
        if done(day) or time.monotonic() > deadline:
            return day
        time.sleep(0.05)


def test_a_tenant_may_have_only_so_many_unfinished_batches(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    """Each unfinished batch holds its input's lines in Redis: one tenant creating batch after batch
    would fill the Redis every tenant's limits, cache and batches share. Past ``max_active_batches`` a
    create is a 429 for that tenant only; a finished batch frees its place."""
    import threading

    config = gateway_config(upstream_url, prefix, batch_names)
    config["batches"]["max_active_batches"] = 2
    upstream.behavior.hold = threading.Event()  # the lines wait at the worker: the batches stay unfinished
    try:
        with gateway_factory(config) as (_, server):
            acme, globex = sdk(server, "acme-1"), sdk(server, "globex-1")
            source = acme.files.create(file=("in.jsonl", jsonl([chat_line("a", "x")])), purpose="batch")
            first = acme.batches.create(
                input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            second = acme.batches.create(
                input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            try:
                acme.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
                raise AssertionError("a third unfinished batch was taken")
            except openai.RateLimitError as refused:
                assert refused.code == "batch_limit_reached"
            # another tenant is not held to acme's count
            theirs = globex.files.create(file=("in.jsonl", jsonl([chat_line("g", "y")])), purpose="batch")
            globex.batches.create(input_file_id=theirs.id, endpoint="/v1/chat/completions", completion_window="24h")
            # a batch that ends (here cancelled) gives its place back
            acme.batches.cancel(first.id)
            upstream.behavior.hold.set()
            wait_for(acme, first.id, ("cancelled",), timeout_s=15)
            upstream.behavior.hold.clear()
            acme.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
            # a batch whose record is gone without turning final (a Redis flush) holds no place for good
            client = redis.Redis()
            client.delete(f"{batch_names['prefix']}:batch:{second.id}")
            client.close()
            acme.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    finally:
        upstream.behavior.hold.set()


def test_creates_at_once_never_pass_max_active_batches(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """30 creates sent at once for a scope that may have 2 unfinished batches: exactly 2 are created (the
    count and the add are one step in Redis), the others are 429 ``batch_limit_reached``."""
    from concurrent.futures import ThreadPoolExecutor

    upstream.behavior.hold = threading.Event()  # the lines wait at the worker: the batches stay unfinished
    config = base_config([upstream_url], batches=batches_section(batch_names, max_active_batches=2))
    try:
        with gateway_factory(config) as (_, server):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            source = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
            body = {"input_file_id": source.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
            barrier = threading.Barrier(30)

            def create(_: int) -> tuple[int, Any]:
                with httpx.Client(timeout=60) as http:
                    barrier.wait()
                    answer = http.post(server.url + "/v1/batches", json=body)
                    return answer.status_code, answer.json()

            with ThreadPoolExecutor(30) as pool:
                answers = list(pool.map(create, range(30)))
            listed = client.batches.list(limit=100).data
            for batch in listed:
                client.batches.cancel(batch.id)
            upstream.behavior.hold.set()
            for batch in listed:
                wait_for(client, batch.id, ("cancelled", "completed"), timeout_s=30)
        codes = [code for code, _ in answers]
        assert codes.count(200) == 2 and codes.count(429) == 28, codes
        assert {a["error"]["code"] for code, a in answers if code == 429} == {"batch_limit_reached"}
        assert len(listed) == 2
    finally:
        upstream.behavior.hold.set()


def test_batches_over_one_input_count_its_lines_in_redis_once_each(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """Each unfinished batch copies its input's lines into Redis, however many batches share the file: past
    ``max_tenant_batch_bytes`` of inputs held by a scope's unfinished batches, a create is a 429
    ``batch_bytes_limit_reached``; a batch that ends gives its input's bytes back."""
    data = jsonl([chat_line(f"q-{i}", "y" * 500) for i in range(20)])
    upstream.behavior.hold = threading.Event()  # the lines wait at the worker: the batches stay unfinished
    section = batches_section(batch_names, max_tenant_batch_bytes=2 * len(data) + len(data) // 2)
    config = base_config([upstream_url], batches=section)
    store = redis.Redis()
    try:
        with gateway_factory(config) as (_, server):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            source = client.files.create(file=("in.jsonl", data), purpose="batch")
            first = start_on(client, source.id)
            start_on(client, source.id)
            with pytest.raises(openai.RateLimitError) as caught:
                start_on(client, source.id)
            assert caught.value.code == "batch_bytes_limit_reached"
            assert len(client.batches.list().data) == 2
            client.batches.cancel(first.id)  # an ended batch gives its input's bytes back
            wait_for(client, first.id, ("cancelled",), timeout_s=30)
            start_on(client, source.id)
            listed = client.batches.list().data
            for batch in listed:
                client.batches.cancel(batch.id)
            upstream.behavior.hold.set()
            for batch in listed:
                wait_for(client, batch.id, ("cancelled", "completed"), timeout_s=30)
            prefix = batch_names["prefix"]
            loaded = list(store.scan_iter(match=f"{prefix}:b:*:lines"))
            assert loaded == [], loaded  # every batch's copy dropped once it ended
    finally:
        upstream.behavior.hold.set()
        store.close()


def start_on(client: openai.OpenAI, input_file_id: str) -> Any:
    return client.batches.create(input_file_id=input_file_id, endpoint="/v1/chat/completions", completion_window="24h")


def cut_midway(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    config: dict[str, Any],
    stop: Any,
    *,
    lines: int = 3,
    running: int = 2,
    endpoint: str = "/v1/chat/completions",
) -> tuple[dict[str, Any], set[str]]:
    """Run a batch of ``lines`` lines (prompt "abcd", 50 tokens at most) as acme-1, ``running`` of them at
    once; once they are all at the worker (which holds them), ``stop(server, client, batch_id)`` ends the
    batch. The key's day usage once every reservation is settled, and the error codes of the lines."""
    config["batches"]["max_in_flight"] = running
    upstream.behavior.hold = threading.Event()  # each line stays at the worker: generating, as it were
    reserved = -(-(5 + 50) // 2)  # a line's reservation at half price: the prompt estimate and max_tokens
    try:
        with gateway_factory(config, admin_token="adm") as (_, server):
            acme = sdk(server, "acme-1")
            if endpoint == "/v1/responses":
                body = {"model": "m1", "input": "abcd", "max_output_tokens": 50}
                line = {"method": "POST", "url": endpoint, "body": body}
                inputs = [{"custom_id": f"c-{i}", **line} for i in range(lines)]
            else:
                inputs = [chat_line(f"c-{i}", "abcd", max_tokens=50) for i in range(lines)]
            batch = start(acme, inputs, endpoint)
            deadline = time.monotonic() + 15
            while len(upstream.requests) < running and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(upstream.requests) == running, "the lines never reached the worker"
            done = stop(server, acme, batch.id)
            day = settled_usage(server, lambda d: d.get("tokens", 0) < reserved)
            codes = set()
            if done.error_file_id is not None:
                codes = {line["error"]["code"] for line in parse_jsonl(acme.files.content(done.error_file_id).content)}
    finally:
        upstream.behavior.hold.set()
    return day, codes


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/responses"])
def test_lines_cut_by_their_owners_cancel_pay_their_prompt(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
    endpoint: str,
) -> None:
    """A line the owner's cancel cuts at the worker is a client that hung up: it pays its prompt (at the
    batch price), or cancelling a batch of long generations just before they end would get them for
    free, batch after batch. A line that never reached a worker pays nothing."""

    def cancel(server: ServerThread, client: openai.OpenAI, batch_id: str) -> Any:
        client.batches.cancel(batch_id)
        return wait_for(client, batch_id, ("cancelled",), timeout_s=15)

    config = gateway_config(upstream_url, prefix, batch_names, batch_price_factor=0.5)
    day, codes = cut_midway(gateway_factory, upstream, config, cancel, endpoint=endpoint)
    assert codes == {"batch_cancelled"}
    # two lines were at the worker: each pays its prompt estimate (5) at half price, rounded up; the
    # third was never sent
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (2 * 3, 0, 2 * 3)


def test_lines_cut_by_an_operators_cancel_or_by_expiry_pay_nothing(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    """Stopped by the gateway's decision, not the owner's: an operator's cancel, or the completion window
    passing (the gateway did not finish in time, like a timeout). Their reservations are released."""

    def operator_cancels(server: ServerThread, client: openai.OpenAI, batch_id: str) -> Any:
        reply = httpx.post(server.url + f"/admin/batches/{batch_id}/cancel", headers={"authorization": "Bearer adm"})
        assert reply.status_code == 200, reply.text
        return wait_for(client, batch_id, ("cancelled",), timeout_s=15)

    def expires(server: ServerThread, client: openai.OpenAI, batch_id: str) -> Any:
        redis_client = redis.Redis()
        redis_client.hset(f"{batch_names['prefix']}:batch:{batch_id}", "expires_at", str(int(time.time()) - 1))
        redis_client.close()
        return wait_for(client, batch_id, ("expired",), timeout_s=15)

    config = gateway_config(upstream_url, prefix, batch_names, batch_price_factor=0.5)
    day, codes = cut_midway(gateway_factory, upstream, config, operator_cancels, lines=2, running=1)
    assert codes == {"batch_cancelled"}
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (0, 0, 0)

    upstream.requests.clear()
    day, codes = cut_midway(gateway_factory, upstream, config, expires, lines=2, running=1)
    assert codes == {"batch_expired"}
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (0, 0, 0)


def test_a_line_cut_by_a_shutdown_is_charged_once_when_it_runs_again(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    """A replica that shuts down gives its running lines back (their leases released): the line runs
    again, here after a restart, and is charged then, once; the cut run costs nothing."""
    config = gateway_config(upstream_url, prefix, batch_names, batch_price_factor=0.5)
    upstream.behavior.hold = threading.Event()
    try:
        with gateway_factory(config, admin_token="adm") as (_, server):
            acme = sdk(server, "acme-1")
            batch = start(acme, [chat_line("s-1", "abcd", max_tokens=3)])
            deadline = time.monotonic() + 15
            while not upstream.requests and time.monotonic() < deadline:
                time.sleep(0.02)
            assert upstream.requests, "the line never reached the worker"
    finally:
        upstream.behavior.hold.set()
    upstream.behavior.hold = None
    with gateway_factory(config, admin_token="adm") as (_, server):
        acme = sdk(server, "acme-1")
        assert wait_for(acme, batch.id, ("completed",), timeout_s=30).request_counts.completed == 1  # type: ignore[union-attr]
        day = settled_usage(server, lambda d: d.get("completion_tokens", 0) > 0 and d.get("tokens", 0) <= 5)
    assert len(upstream.requests) == 2  # the cut run and the one that completed
    # the answer's 5 prompt and 3 completion tokens at half price, rounded up; nothing for the cut run
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (3, 2, 5)


def test_a_cancel_another_replica_finalizes_stops_this_replicas_lines(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    """The replica that takes the cancel finalizes the batch at once; the one running its line looks at
    its batches only every poll interval, by when the batch is no longer among the unfinished ones. Its
    line must still stop (and be charged as the owner's cancel says), not go on generating an answer
    nobody will get, charged in full."""
    config = gateway_config(upstream_url, prefix, batch_names, batch_price_factor=0.5)
    config["upstream"]["first_byte_timeout_s"] = 60  # the line is not ended by the gateway's timeout either
    runs = {**config, "batches": {**config["batches"], "poll_interval_s": 2}}
    reserved = -(-(5 + 50) // 2)
    upstream.behavior.hold = threading.Event()
    try:
        with gateway_factory(runs, admin_token="adm") as (_, running):
            acme = sdk(running, "acme-1")
            batch = start(acme, [chat_line("r-1", "abcd", max_tokens=50)])
            deadline = time.monotonic() + 15
            while not upstream.requests and time.monotonic() < deadline:
                time.sleep(0.02)
            assert upstream.requests, "the line never reached the worker"
            with gateway_factory(config, admin_token="adm") as (_, other):
                sdk(other, "acme-1").batches.cancel(batch.id)
                wait_for(acme, batch.id, ("cancelled",), timeout_s=15)
                day = settled_usage(running, lambda d: d.get("tokens", 0) < reserved)
    finally:
        upstream.behavior.hold.set()
    assert len(upstream.requests) == 1
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (3, 0, 3)


@pytest.mark.parametrize(
    ("endpoint", "first", "slow_status"),
    [
        ("/v1/chat/completions", "taker", 200),
        ("/v1/chat/completions", "slow", 200),
        ("/v1/responses", "taker", 200),
        ("/v1/chat/completions", "slow", 400),
    ],
)
def test_a_line_two_replicas_both_ran_is_charged_once(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
    endpoint: str,
    first: str,
    slow_status: int,
) -> None:
    """A replica whose lease on a running line lapsed (its renewals did not get through in time) is still
    running it when another replica takes the line over: both runs are answered, but the line's result is
    written once and the tenant pays for that one answer. The run whose answer came second was delivered
    to nobody: its charge is given back, whichever replica ran it (``first``: whose run is answered first,
    the replica that took the line over or the slow one). Unless the first answer was an error and the
    second a success (``slow_status`` 400: the slow replica's worker refused its lines): the success
    replaces it, the batch waiting for it, and is paid for."""
    config = gateway_config(upstream_url, prefix, batch_names)
    config["batches"]["max_in_flight"] = 2  # the slow replica runs lines 0 and 1, and claims nothing more
    if endpoint == "/v1/responses":
        body = {"model": "m1", "input": "abcd", "max_output_tokens": 3}
        inputs = [{"custom_id": f"t-{i}", "method": "POST", "url": endpoint, "body": body} for i in range(3)]
    else:
        inputs = [chat_line(f"t-{i}", "abcd", max_tokens=3) for i in range(3)]
    slow_runs, taker_runs = threading.Event(), threading.Event()

    def wait_until(done: Any, what: str) -> None:
        deadline = time.monotonic() + 15
        while not done():
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    upstream.behavior = Behavior(hold=slow_runs, status=slow_status)
    try:
        with gateway_factory(config, admin_token="adm") as (_, slow):
            acme = sdk(slow, "acme-1")
            batch = start(acme, inputs, endpoint)
            wait_until(lambda: len(upstream.requests) == 2, "the lines never reached the worker")
            # the runs already at the worker stay held (each request read the worker's behaviour as it
            # arrived); the other replica's are answered at once, or held until the slow ones are answered
            upstream.behavior = Behavior(hold=taker_runs if first == "slow" else None)
            # line 0's lease lapses: its owner's renewals no longer extend it, anyone may claim it
            client = redis.Redis()
            work = f"{batch_names['prefix']}:b:{batch.id}"
            client.pipeline().zadd(f"{work}:leases", {"0": 0}).hdel(f"{work}:owners", "0").execute()
            client.close()

            def completed() -> int:
                return acme.batches.retrieve(batch.id).request_counts.completed  # type: ignore[union-attr]

            def settled_lines() -> int:
                counts = acme.batches.retrieve(batch.id).request_counts
                assert counts is not None
                return counts.completed + counts.failed

            with gateway_factory(config, admin_token="adm") as _:  # takes lines 0 and 2
                if first == "taker":
                    wait_until(lambda: completed() == 2, "the other replica never answered lines 0 and 2")
                    slow_runs.set()  # line 0's second answer: the slow replica's
                else:
                    wait_until(lambda: len(upstream.requests) == 4, "the other replica never took lines 0 and 2")
                    slow_runs.set()
                    wait_until(lambda: settled_lines() == 2, "the slow replica never answered lines 0 and 1")
                    taker_runs.set()  # line 0's second answer: the other replica's
                done = wait_for(acme, batch.id, ("completed",), timeout_s=15)
                output = parse_jsonl(acme.files.content(done.output_file_id).content)
                errors = parse_jsonl(acme.files.content(done.error_file_id).content) if done.error_file_id else []
                answers = 3 if slow_status == 200 else 2  # line 1 ran once, on the slow replica
                day = settled_usage(slow, lambda d: d.get("requests") == 4 and d.get("tokens", 0) <= answers * 8)
    finally:
        slow_runs.set()
        taker_runs.set()
    assert len(upstream.requests) == 4  # line 0 ran on both replicas
    if slow_status != 200:
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
        assert sorted(line["custom_id"] for line in output) == ["t-0", "t-2"]  # line 0's error replaced
        assert [(line["custom_id"], line["response"]["status_code"]) for line in errors] == [("t-1", 400)]
        assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (2 * 5, 2 * 3, 2 * 8)
        return
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0)
    assert sorted(line["custom_id"] for line in output) == ["t-0", "t-1", "t-2"]  # each result written once
    # three answers of 5 prompt and 3 completion tokens each: line 0's second run costs nothing
    assert (day["prompt_tokens"], day["completion_tokens"], day["tokens"]) == (3 * 5, 3 * 3, 3 * 8)
