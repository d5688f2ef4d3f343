"""A batch's lifecycle beyond the happy path, through the OpenAI SDK on the fake worker: cancel, expiry
after the completion window, an input that is no batch, the file size bound, listing pages, and lines
for the other endpoints."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
import redis.asyncio as aioredis

from gateway.batch.jobs import Jobs
from gateway.batch.work import Work
from gateway.pipeline.batch_config import BatchesConfig
from tests.support.batches import batch_in_progress, batches_section, chat_line, jsonl, parse_jsonl, start, wait_for
from tests.support.cache import cache_gateway_config, namespace, redis_client, wait_stored
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

__all__ = ["namespace", "redis_client"]


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def every_custom_id_once(client: openai.OpenAI, batch: Any) -> dict[str, dict[str, Any]]:
    """The output and error lines by custom_id, checking that none appears twice."""
    lines = []
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            lines += parse_jsonl(client.files.content(file_id).content)
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)), sorted(ids)
    return {line["custom_id"]: line for line in lines}


def test_cancel_stops_the_lines_and_writes_off_the_rest(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    upstream.behavior.hold = threading.Event()  # lines stay at the worker until the test lets them go
    config = base_config([upstream_url], batches=batches_section(batch_names, max_in_flight=2))
    try:
        with gateway_factory(config) as (_, server):
            client = sdk(server)
            batch = start(client, [chat_line(f"c-{i}", f"q{i}") for i in range(10)])
            wait_for(client, batch.id, ("in_progress",))
            cancelling = client.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
            done = wait_for(client, batch.id, ("cancelled",))
            lines = every_custom_id_once(client, done)
            # cancelling again is harmless; a finished batch cannot be cancelled
            assert client.batches.cancel(batch.id).status == "cancelled"
    finally:
        upstream.behavior.hold.set()
    assert set(lines) == {f"c-{i}" for i in range(10)}
    assert all(line["error"]["code"] == "batch_cancelled" for line in lines.values())
    assert done.cancelled_at and done.request_counts.failed == 10  # type: ignore[union-attr]
    assert len(upstream.requests) <= 2  # never more than max_in_flight were sent


def test_a_batch_expires_after_its_window_with_what_was_done(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    upstream.behavior.hold = threading.Event()
    section = batches_section(batch_names, completion_window_s=1.5, max_in_flight=1)
    config = base_config([upstream_url], batches=section)
    try:
        with gateway_factory(config) as (_, server):
            client = sdk(server)
            batch = start(client, [chat_line(f"e-{i}", f"q{i}") for i in range(3)])
            done = wait_for(client, batch.id, ("expired",))
            lines = every_custom_id_once(client, done)
    finally:
        upstream.behavior.hold.set()
    # it ran before it expired (read from the record: a poll may miss a short in_progress on a loaded machine)
    assert done.in_progress_at and done.in_progress_at <= done.expired_at
    assert done.expired_at and done.expires_at and done.expired_at >= done.expires_at
    assert set(lines) == {"e-0", "e-1", "e-2"}
    assert {line["error"]["code"] for line in lines.values()} == {"batch_expired"}


def test_an_input_that_is_no_batch_fails_it(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        twice = start(client, [chat_line("same", "a"), chat_line("same", "b")])
        failed = wait_for(client, twice.id, ("failed", "completed"))
        assert failed.status == "failed" and failed.errors is not None and failed.failed_at
        assert [(e.code, e.line) for e in failed.errors.data or []] == [("duplicate_custom_id", 2)]
        # lines for another endpoint than the batch's, or that cannot be run, go to the error file
        lines = [
            {**chat_line("wrong-url", "a"), "url": "/v1/embeddings"},
            {**chat_line("get", "a"), "method": "GET"},
            chat_line("streams", "a", stream=True),
            {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},
            chat_line("bad-param", "a", n=1000),
            chat_line("fine", "a"),
        ]
        done = wait_for(client, start(client, lines).id, ("completed",))
        by_id = every_custom_id_once(client, done)
    codes = {cid: (line["error"] or {}).get("code") for cid, line in by_id.items()}
    assert codes == {
        "wrong-url": "mismatched_url",
        "get": "invalid_method",
        "streams": "invalid_body",
        "no-body": "invalid_body",
        "bad-param": None,  # ran, and was refused as a live request is: a 400 in its response
        "fine": None,
    }
    assert by_id["bad-param"]["response"]["status_code"] == 400
    assert by_id["bad-param"]["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert by_id["fine"]["response"]["status_code"] == 200
    assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["a"]  # only "fine" reached it


def test_an_input_whose_contents_are_gone_fails_the_batch_saying_so(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """The input file is listed but its contents are not in the file store (deleted as the batch was
    validated, or a replica whose files directory is not the shared one): the batch fails with an error
    that says so, never with an empty ``errors`` list."""
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        source = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "b")])), purpose="batch")
        (batch_names["dir"] / source.id).unlink()
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
        failed = wait_for(client, batch.id, ("failed", "completed"))
    assert failed.status == "failed" and failed.errors is not None
    assert [(e.code, e.message) for e in failed.errors.data or []] == [
        ("invalid_input_file", "The input file is gone.")
    ]
    assert upstream.requests == []


@pytest.mark.parametrize("chunked", [False, True])
def test_a_file_over_the_bound_is_a_413_and_leaves_nothing(
    gateway_factory: GatewayFactory, upstream_url: str, batch_names: dict[str, Any], chunked: bool
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names, max_file_bytes=4096))
    big = jsonl([chat_line(f"r-{i}", "x" * 100) for i in range(100)])
    boundary = "gatewaytestboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + big
        + f"\r\n--{boundary}--\r\n".encode()
    )
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
        content: Any = body if not chunked else iter([body[i : i + 1000] for i in range(0, len(body), 1000)])
        reply = httpx.post(server.url + "/v1/files", content=content, headers=headers)
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["code"] == "file_too_large"
        with pytest.raises(openai.APIStatusError) as caught:
            client.files.create(file=("big.jsonl", big), purpose="batch")
        assert caught.value.status_code == 413
        assert client.files.list().data == []
        small = client.files.create(file=("small.jsonl", big[:1000]), purpose="batch")
        assert client.files.content(small.id).content == big[:1000]
    assert sorted(p.name for p in batch_names["dir"].iterdir()) == [small.id]  # no part file left behind


def test_an_upload_cannot_be_padded_with_form_fields(
    gateway_factory: GatewayFactory, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names, max_file_bytes=4096))
    boundary = "gatewaytestboundary"
    fields = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="pad{i}"\r\n\r\n{"x" * 4000}\r\n'.encode()
        for i in range(1000)  # each field within its bound, 4 MB in all: 1000 times the file's bound
    ]
    tail = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        f"{{}}\r\n--{boundary}--\r\n"
    ).encode()
    with gateway_factory(config) as (_, server):
        headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
        reply = httpx.post(server.url + "/v1/files", content=iter([*fields, tail]), headers=headers)  # chunked
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "invalid_multipart"
        assert sdk(server).files.list().data == []


def test_an_upload_cut_short_is_refused_and_leaves_nothing(
    gateway_factory: GatewayFactory, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    boundary = "gatewaytestboundary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    ).encode() + jsonl([chat_line(f"r-{i}", "x") for i in range(3)])
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    with gateway_factory(config) as (_, server):
        for cut in (body, body + b"\r\n--" + boundary.encode()):  # no closing boundary, or half of one
            reply = httpx.post(server.url + "/v1/files", content=cut, headers=headers)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["code"] == "invalid_multipart"
        whole = httpx.post(server.url + "/v1/files", content=body + f"\r\n--{boundary}--".encode(), headers=headers)
        assert whole.status_code == 200, whole.text  # the closing boundary's line break is optional
        assert [f.id for f in sdk(server).files.list().data] == [whole.json()["id"]]
    assert sorted(p.name for p in batch_names["dir"].iterdir()) == [whole.json()["id"]]


def test_files_and_batches_are_listed_in_pages(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        created = [start(client, [chat_line("x", "y")]) for _ in range(3)]
        first = client.batches.list(limit=2)
        assert [b.id for b in first.data] == [b.id for b in created[::-1][:2]] and first.has_more
        assert [b.id for b in client.batches.list(limit=2)] == [b.id for b in created[::-1]]  # follows 'after'
        assert [b.id for b in client.batches.list(after=created[1].id).data] == [created[0].id]
        uploads = client.files.list(purpose="batch", order="asc").data
        assert [f.id for f in uploads] == [b.input_file_id for b in created]
        client.files.delete(uploads[0].id)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploads[0].id)
        assert len(client.files.list(purpose="batch").data) == 2
        bad = httpx.post(server.url + "/v1/files", files={"file": ("x", b"{}")}, data={"purpose": "fine-tune"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "purpose"


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_deleting_the_files_of_each_page_while_paging_deletes_them_all(
    gateway_factory: GatewayFactory, upstream_url: str, batch_names: dict[str, Any], order: str
) -> None:
    """The SDK's auto-pagination asks for the page after the last file of the page before, which the loop
    has just deleted: the listing goes on from that file's place, as it would from a file still there.
    (It ended after the first page: a deleted ``after`` gave an empty page.) Pages are read a chunk at a
    time: 230 files, more than two chunks."""
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        uploaded = [client.files.create(file=(f"f{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(230)]
        listed = [f.id for f in client.files.list(limit=100, order=order)]
        assert listed == (uploaded if order == "asc" else uploaded[::-1])
        seen = []
        for f in client.files.list(limit=7, order=order):  # each page's files deleted as it is read
            seen.append(f.id)
            client.files.delete(f.id)
        assert seen == listed
        assert client.files.list().data == []
        assert client.files.list(after=uploaded[5]).data == []  # a deleted file's place: nothing after it now
        unknown = "file-" + "0" * 24
        assert client.files.list(after=unknown).data == []  # an id this tenant never had: an empty page


def test_a_limit_that_is_no_integer_is_a_400(
    gateway_factory: GatewayFactory, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        for path in ("/v1/files", "/v1/batches"):
            for limit in ("\u00b2", "0", "-1", "x", "1.5", "100000"):  # a superscript two is a digit to str.isdigit
                reply = httpx.get(server.url + path, params={"limit": limit})
                assert reply.status_code == 400, (path, limit, reply.text)
                assert reply.json()["error"]["param"] == "limit"
            assert httpx.get(server.url + path, params={"limit": "\u0661"}).status_code == 400  # an Arabic-Indic one


@pytest.mark.parametrize(
    ("endpoint", "body", "answer"),
    [
        ("/v1/embeddings", {"model": "m1", "input": "embed me"}, "list"),
        ("/v1/completions", {"model": "alias-1", "prompt": "once upon"}, "text_completion"),
        ("/v1/responses", {"model": "m1", "input": "hello"}, "response"),
    ],
)
def test_lines_for_every_endpoint(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
    endpoint: str,
    body: dict[str, Any],
    answer: str,
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        line = {"custom_id": "only", "method": "POST", "url": endpoint, "body": body}
        done = wait_for(client, start(client, [line], endpoint).id, ("completed",))
        (out,) = parse_jsonl(client.files.content(done.output_file_id or "").content)
    assert out["custom_id"] == "only" and out["response"]["status_code"] == 200
    assert out["response"]["body"]["object"] == answer
    assert [r.path for r in upstream.requests] == ["/v1/chat/completions" if endpoint == "/v1/responses" else endpoint]
    if endpoint == "/v1/responses":  # not stored, and the Response says so
        assert out["response"]["body"]["store"] is False


def test_a_responses_line_asking_to_be_stored_is_refused(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """Batch lines' Responses are not stored (retrieving one by its id would be a 404): a line asking
    for ``store: true`` goes to the error file with a 400 naming the field, and no worker is asked."""
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        body = {"model": "m1", "input": "hello", "store": True}
        line = {"custom_id": "stored", "method": "POST", "url": "/v1/responses", "body": body}
        done = wait_for(client, start(client, [line], "/v1/responses").id, ("completed",))
        (out,) = parse_jsonl(client.files.content(done.error_file_id or "").content)
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["param"] == "store"
    assert upstream.requests == []


def test_a_line_safety_blocks_goes_to_the_error_file_and_never_to_a_worker(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    rule = {"id": "codename", "kind": "pattern", "patterns": [r"(?i)\bproject\s+bluebird\b"], "action": "block"}
    plugins = [{"name": "safety", "config": {"rules": [rule]}}, {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins, batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        batch = start(client, [chat_line("blocked", "tell me about Project Bluebird"), chat_line("ok", "hello")])
        done = wait_for(client, batch.id, ("completed",))
        by_id = every_custom_id_once(client, done)
        live = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "m1", "messages": [{"role": "user", "content": "tell me about Project Bluebird"}]})  # fmt: skip
    blocked = by_id["blocked"]["response"]
    assert blocked["status_code"] == live.status_code and blocked["body"] == live.json()  # as a live request
    assert by_id["ok"]["response"]["status_code"] == 200
    assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["hello"]


def test_a_cache_hit_is_a_line_done_for_free(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
    redis_client: Any,
    namespace: str,
) -> None:
    config = cache_gateway_config(upstream_url, namespace)
    config["batches"] = batches_section(batch_names)
    body = {"model": "m1", "messages": [{"role": "user", "content": "cached question"}], "temperature": 0}
    with gateway_factory(config) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200
        wait_stored(redis_client, namespace)
        client = sdk(server)
        lines = [{"custom_id": f"hit-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
                 for i in range(3)]  # fmt: skip
        done = wait_for(client, start(client, lines).id, ("completed",))
        by_id = every_custom_id_once(client, done)
    assert len(upstream.requests) == 1  # the live request only
    assert {line["response"]["body"]["choices"][0]["message"]["content"] for line in by_id.values()} == {
        upstream.behavior.text
    }


def test_a_custom_id_used_by_a_malformed_line_and_another_line_fails_the_batch(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        for lines in (
            [{**chat_line("same", "a"), "method": "GET"}, chat_line("same", "b")],  # malformed first
            [chat_line("same", "a"), {**chat_line("same", "b"), "url": "/v1/embeddings"}],  # malformed second
            [{**chat_line("same", "a"), "method": "GET"}, {**chat_line("same", "b"), "method": "GET"}],
        ):
            failed = wait_for(client, start(client, lines).id, ("failed", "completed"))
            assert failed.status == "failed" and failed.errors is not None, failed
            assert [(e.code, e.line) for e in failed.errors.data or []] == [("duplicate_custom_id", 2)]
    assert upstream.requests == []  # no line ran only to lose its answer


def test_a_line_without_a_custom_id_is_named_by_its_place_which_no_custom_id_takes(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """Line 2 has no custom_id: its error line says which line it was, and lines whose custom_ids read
    like a line's place ("#line-2", "line 2", "2") are lines of their own, answered."""
    config = base_config([upstream_url], batches=batches_section(batch_names))
    names = ["#line-2", "line 2", "2"]
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        lines = [chat_line(names[0], "a"), {"method": "POST", "url": "/v1/chat/completions", "body": {}}]
        lines += [chat_line(name, "b") for name in names[1:]]
        done = wait_for(client, start(client, lines).id, ("failed", "completed"))
        assert done.status == "completed", done
        answered = parse_jsonl(client.files.content(done.output_file_id).content)
        errors = parse_jsonl(client.files.content(done.error_file_id).content)
    assert [line["custom_id"] for line in answered] == names  # in input order
    assert all(line["response"]["status_code"] == 200 for line in answered)
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [(None, None, "missing_custom_id")]
    assert errors[0]["error"]["message"].startswith("Line 2: ")
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)  # type: ignore[union-attr]


def test_batches_past_their_ttl_neither_hide_the_others_nor_stay_listed(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    store = redis.Redis()
    index = f"{batch_names['prefix']}:batches:shared"
    try:
        with gateway_factory(config) as (_, server):
            client = sdk(server)
            created = [wait_for(client, start(client, [chat_line("x", "y")]).id, ("completed",)) for _ in range(4)]
            for gone in created[1:3]:  # expired (output_ttl_s) between two listings
                store.delete(f"{batch_names['prefix']}:batch:{gone.id}")
            first = client.batches.list(limit=2)
            assert [b.id for b in first.data] == [created[3].id, created[0].id] and not first.has_more
            assert [b.id for b in client.batches.list(limit=1)] == [created[3].id, created[0].id]
            assert {i.decode() for i in store.zrange(index, 0, -1)} == {created[0].id, created[3].id}
    finally:
        store.close()


def test_the_runner_deletes_the_contents_of_expired_output_files(
    gateway_factory: GatewayFactory,
    upstream_url: str,
    batch_names: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("gateway.batch.runner.SWEEP_INTERVAL_S", 0.05, raising=False)
    config = base_config([upstream_url], batches=batches_section(batch_names))
    store = redis.Redis()
    try:
        with gateway_factory(config) as (_, server):
            client = sdk(server)
            batch = start(client, [chat_line("a", "x"), chat_line("b", "y", n=1000)])  # an output and an error
            done = wait_for(client, batch.id, ("completed",))
            produced = {done.output_file_id, done.error_file_id}
            assert produced <= {p.name for p in batch_names["dir"].iterdir()} and None not in produced
            for file_id in produced:  # their output_ttl_s passes: Redis forgets them
                store.delete(f"{batch_names['prefix']}:file:{file_id}")
                store.zadd(f"{batch_names['prefix']}:files-expiring", {file_id: 1})
            deadline = time.monotonic() + 10
            while produced & {p.name for p in batch_names["dir"].iterdir()} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert {p.name for p in batch_names["dir"].iterdir()} == {done.input_file_id}
    finally:
        store.close()


def test_a_batch_whose_answers_outgrow_the_upload_bound_completes(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    # max_file_bytes bounds uploads; the answers to a small input can be far larger
    config = base_config([upstream_url], batches=batches_section(batch_names, max_file_bytes=2048))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        lines = [chat_line(f"q-{i}", "hi") for i in range(8)]
        assert len(jsonl(lines)) < 2048
        done = wait_for(client, start(client, lines).id, ("completed", "failed", "expired"), timeout_s=15)
        assert done.status == "completed" and done.output_file_id, done
        output = client.files.content(done.output_file_id).content
    assert len(output) > 2048
    assert sorted(line["custom_id"] for line in parse_jsonl(output)) == sorted(f"q-{i}" for i in range(8))


def test_a_line_nested_too_deep_is_written_off_and_stops_no_batch(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    messages = b"[" * 300 + b'"x"' + b"]" * 300  # read by a JSON parser; deeper than a live request may be
    deep = b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m1", '
    deep += b'"messages": ' + messages + b"}}"
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        live = httpx.post(
            server.url + "/v1/chat/completions", content=b'{"model": "m1", "messages": ' + messages + b"}"
        )
        assert live.status_code == 400
        batch = start(client, [chat_line("fine", "a"), deep])
        other = start(client, [chat_line("other", "c")])
        done = wait_for(client, batch.id, ("completed", "failed"), timeout_s=15)
        assert wait_for(client, other.id, ("completed",), timeout_s=15).request_counts.completed == 1  # type: ignore[union-attr]
        by_id = every_custom_id_once(client, done)
    assert by_id["fine"]["response"]["status_code"] == 200
    assert by_id["deep"]["response"] is None and by_id["deep"]["error"]["code"] == "invalid_body"


def test_a_line_larger_than_a_live_request_may_be_is_refused_as_one(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names), limits={"max_body_bytes": 2048})
    big = chat_line("big", "x" * 4000)
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        live = httpx.post(server.url + "/v1/chat/completions", json=big["body"])
        assert live.status_code == 413
        done = wait_for(client, start(client, [chat_line("small", "hi"), big]).id, ("completed",))
        by_id = every_custom_id_once(client, done)
    assert by_id["small"]["response"]["status_code"] == 200
    refused = by_id["big"]["response"]
    assert refused["status_code"] == 413 and refused["body"]["error"]["code"] == live.json()["error"]["code"]
    assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["hi"]


def test_a_batch_that_fails_to_move_on_holds_up_no_other(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch whose turn in a round raises (a bug, a file it cannot write) is logged and tried again the
    next round; the other batches of the round still move on and run. The failing one is the first of the
    round (rounds go by batch id), so without that every round would end at it."""
    from gateway.batch.lifecycle import Lifecycle

    validate = Lifecycle.validate
    chosen: list[str] = []  # the failing batch's id, once all are created; nothing is validated before
    failed: set[str] = set()

    async def failing_for_one(self: Lifecycle, batch_id: str, record: dict[str, Any]) -> None:
        if not chosen:
            return
        if batch_id == chosen[0]:
            failed.add(batch_id)
            raise RuntimeError("this batch cannot be validated")
        await validate(self, batch_id, record)

    monkeypatch.setattr(Lifecycle, "validate", failing_for_one)
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        ids = sorted(start(client, [chat_line(f"b{i}", "y")]).id for i in range(4))
        chosen.append(ids[0])
        for other in ids[1:]:
            assert wait_for(client, other, ("completed",), timeout_s=15).request_counts.completed == 1
        assert client.batches.retrieve(ids[0]).status == "validating"
    assert failed == {ids[0]}


def test_a_line_far_larger_than_a_live_request_may_be_is_written_off_unread(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """Past the body bound and the line's envelope, a line is not parsed at all (it could be up to
    max_file_bytes, parsed on the event loop): written off as request_too_large, named by its place."""
    config = base_config([upstream_url], batches=batches_section(batch_names), limits={"max_body_bytes": 2048})
    huge = chat_line("huge", "x" * 8000)
    with gateway_factory(config) as (_, server):
        client = sdk(server)
        done = wait_for(client, start(client, [chat_line("small", "hi"), huge]).id, ("completed",))
        by_id = every_custom_id_once(client, done)
    assert by_id["small"]["response"]["status_code"] == 200
    written_off = by_id[None]
    assert written_off["response"] is None and written_off["error"]["code"] == "request_too_large", written_off
    assert written_off["error"]["message"].startswith("Line 2: ")
    assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["hi"]


def test_a_claimed_line_past_the_body_bound_is_written_off_unread(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """A line loaded within an earlier, larger bound (``limits.max_body_bytes`` lowered since) is written
    off as request_too_large when it is claimed, without being parsed, named by its place."""
    config = base_config([upstream_url], batches=batches_section(batch_names), limits={"max_body_bytes": 2048})
    lines = [orjson.dumps(chat_line("small", "hi")), orjson.dumps(chat_line("huge", "x" * 8000))]

    async def loaded() -> str:
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"]))
            return await batch_in_progress(jobs, Work(client, jobs.config, jobs.key), lines)
        finally:
            await client.aclose()

    with gateway_factory(config) as (_, server):
        client = sdk(server)
        done = wait_for(client, asyncio.run(loaded()), ("completed",))
        by_id = every_custom_id_once(client, done)
    assert by_id["small"]["response"]["status_code"] == 200
    written_off = by_id[None]
    assert written_off["response"] is None and written_off["error"]["code"] == "request_too_large", written_off
    assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["hi"]
