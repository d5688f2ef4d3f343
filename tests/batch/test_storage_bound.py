"""What one tenant may store in the file store every tenant shares (``batches.max_tenant_bytes`` and
``max_tenant_files``): an upload past it is a 400 and leaves nothing, uploads at once cannot pass it
together, deleting and expiry give room back, the files a batch writes are counted but never refused,
and another tenant is never held to it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.usage import StorageFull
from gateway.pipeline.batch_config import BatchesConfig
from tests.batch.test_tenants import SECRETS, gateway_config, sdk
from tests.support.batches import batches_section, chat_line, jsonl, start, wait_for
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import prefix

__all__ = ["prefix"]
BOUND = 8192
BOUNDARY = "gatewaytestboundary"


def stored_names(names: dict[str, Any]) -> set[str]:
    return {p.name for p in names["dir"].iterdir()} if names["dir"].exists() else set()


def refused_for_storage(caught: pytest.ExceptionInfo[openai.BadRequestError], code: str) -> None:
    assert caught.value.status_code == 400
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["param"] == "file", error


def test_a_tenant_past_its_bound_is_refused_and_another_tenant_is_not(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    config = gateway_config(upstream_url, prefix, batch_names)
    config["batches"]["max_tenant_bytes"] = BOUND
    with gateway_factory(config) as (_, server):
        acme, globex = sdk(server, "acme-1"), sdk(server, "globex-1")
        first = acme.files.create(file=("a.jsonl", b"a" * 5000), purpose="batch")
        with pytest.raises(openai.BadRequestError) as caught:  # 5000 + 5000 > 8192
            acme.files.create(file=("b.jsonl", b"b" * 5000), purpose="batch")
        refused_for_storage(caught, "stored_bytes_exceeded")
        assert [f.id for f in acme.files.list()] == [first.id]
        assert stored_names(batch_names) == {first.id}  # nothing of the refused upload, no part file
        # the same tenant through another key is held to the same bound
        with pytest.raises(openai.BadRequestError):
            sdk(server, "acme-2").files.create(file=("b.jsonl", b"b" * 5000), purpose="batch")
        # another tenant stores as much as it may, whatever acme holds
        theirs = globex.files.create(file=("g.jsonl", b"g" * 5000), purpose="batch")
        assert globex.files.content(theirs.id).content == b"g" * 5000
        # a deleted file gives its room back
        acme.files.delete(first.id)
        second = acme.files.create(file=("b.jsonl", b"b" * 5000), purpose="batch")
        assert acme.files.content(second.id).content == b"b" * 5000
        assert stored_names(batch_names) == {theirs.id, second.id}


def _upload_body(data: bytes) -> tuple[bytes, bytes]:
    """A multipart upload of ``data`` in two parts: all but the file's last half, then the rest."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    ).encode()
    half = len(data) // 2
    return head + data[:half], data[half:] + f"\r\n--{BOUNDARY}--\r\n".encode()


def test_two_uploads_at_once_cannot_both_pass_when_one_fits(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    """Each upload has its first half on the way before either sends the rest: each fits on its own,
    both do not. One is stored, the other refused; the refused one holds nothing afterwards."""
    config = gateway_config(upstream_url, prefix, batch_names)
    config["batches"]["max_tenant_bytes"] = BOUND
    both_started = threading.Barrier(2, timeout=10)
    replies: dict[str, httpx.Response] = {}

    def upload(name: str, url: str) -> None:
        first, rest = _upload_body(name.encode() * 5000)

        def body() -> Iterator[bytes]:
            yield first
            both_started.wait()
            yield rest

        headers = {
            "authorization": f"Bearer {SECRETS['acme-1']}",
            "content-type": f"multipart/form-data; boundary={BOUNDARY}",
            "content-length": str(len(first) + len(rest)),
        }
        replies[name] = httpx.post(url + "/v1/files", content=body(), headers=headers, timeout=30)

    with gateway_factory(config) as (_, server):
        threads = [threading.Thread(target=upload, args=(name, server.url)) for name in ("x", "y")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        statuses = sorted(reply.status_code for reply in replies.values())
        assert statuses == [200, 400], {name: reply.text for name, reply in replies.items()}
        (kept,) = [reply.json()["id"] for reply in replies.values() if reply.status_code == 200]
        (refusal,) = [reply.json()["error"] for reply in replies.values() if reply.status_code == 400]
        assert refusal["code"] == "stored_bytes_exceeded" and refusal["type"] == "invalid_request_error"
        acme = sdk(server, "acme-1")
        assert [f.id for f in acme.files.list()] == [kept]
        assert stored_names(batch_names) == {kept}
        # the refused upload's reservation was given back: after a delete the whole bound is free again
        acme.files.delete(kept)
        again = acme.files.create(file=("z.jsonl", b"z" * BOUND), purpose="batch")
        assert again.bytes == BOUND


def test_a_tenant_may_store_only_so_many_files(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    config = gateway_config(upstream_url, prefix, batch_names)
    config["batches"]["max_tenant_files"] = 2
    with gateway_factory(config) as (_, server):
        acme, globex = sdk(server, "acme-1"), sdk(server, "globex-1")
        kept = [acme.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch") for i in range(2)]
        with pytest.raises(openai.BadRequestError) as caught:
            acme.files.create(file=("2.jsonl", b"{}\n"), purpose="batch")
        refused_for_storage(caught, "stored_files_exceeded")
        assert len(acme.files.list().data) == 2 and len(stored_names(batch_names)) == 2
        globex.files.create(file=("g.jsonl", b"{}\n"), purpose="batch")
        acme.files.delete(kept[0].id)
        acme.files.create(file=("2.jsonl", b"{}\n"), purpose="batch")


def test_a_batchs_output_files_are_counted_and_never_fail_it(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answers are written even past the bound (the lines were run and charged); the tenant's next
    upload is refused until the output file is deleted or expires and is swept."""
    monkeypatch.setattr("gateway.batch.runner.SWEEP_INTERVAL_S", 0.05, raising=False)
    config = base_config([upstream_url], batches=batches_section(batch_names, max_tenant_bytes=2048))
    lines = [chat_line(f"q-{i}", "hi") for i in range(8)]
    assert len(jsonl(lines)) < 2048
    store = redis.Redis()
    try:
        with gateway_factory(config) as (_, server):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            done = wait_for(client, start(client, lines).id, ("completed", "failed", "expired"), timeout_s=15)
            assert done.status == "completed" and done.output_file_id and done.error_file_id is None, done
            output = client.files.retrieve(done.output_file_id)
            assert output.bytes + len(jsonl(lines)) > 2048  # past the bound, written all the same
            with pytest.raises(openai.BadRequestError) as caught:
                client.files.create(file=("small.jsonl", b"{}\n"), purpose="batch")
            refused_for_storage(caught, "stored_bytes_exceeded")
            # the output file's output_ttl_s passes (Redis forgets its record) and the runner sweeps it
            store.delete(f"{batch_names['prefix']}:file:{done.output_file_id}")
            store.zadd(f"{batch_names['prefix']}:files-expiring", {done.output_file_id: 1})
            deadline = time.monotonic() + 10
            while done.output_file_id in stored_names(batch_names) and time.monotonic() < deadline:
                time.sleep(0.05)
            small = client.files.create(file=("small.jsonl", b"{}\n"), purpose="batch")
            assert stored_names(batch_names) == {done.input_file_id, small.id}
    finally:
        store.close()


async def _pieces(data: bytes, halfway: asyncio.Event, go_on: asyncio.Event) -> AsyncIterator[bytes]:
    yield data[: len(data) // 2]
    halfway.set()
    await go_on.wait()
    yield data[len(data) // 2 :]


def test_usage_follows_uploads_writes_deletions_and_sweeps(batch_names: dict[str, Any]) -> None:
    """On the real Redis, with the interleaving fixed: two uploads each wrote half of what they send
    (both fit so far) before either goes on; the second to need its other half is refused while writing,
    and nothing of it is kept. A file the gateway writes is counted once however often it is written."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], max_tenant_bytes=BOUND)
        client = aioredis.Redis()
        try:
            files = Files(client, DirectoryStore(config.files_dir), config)
            halfway = [asyncio.Event(), asyncio.Event()]
            go_on = [asyncio.Event(), asyncio.Event()]
            uploads = [
                asyncio.create_task(files.store(_pieces(b"u" * 5000, halfway[i], go_on[i]), scope="t:acme"))
                for i in range(2)
            ]
            for event in halfway:
                await event.wait()
            go_on[0].set()
            kept = await uploads[0]
            go_on[1].set()
            with pytest.raises(StorageFull):
                await uploads[1]
            await files.register("t:acme", kept, "in.jsonl", "batch")
            assert await files.usage.stored("t:acme") == (5000, 1)
            assert stored_names(batch_names) == {kept.file_id}

            # files a batch writes: counted past the bound, once per id even when written again
            first = await files.create("t:acme", "out.jsonl", "batch_output", _once(b"o" * 4000), file_id="file-out")
            await files.create("t:acme", "out.jsonl", "batch_output", _once(b"o" * 4500), file_id="file-out")
            assert first["id"] == "file-out" and await files.usage.stored("t:acme") == (9500, 2)
            assert await files.usage.stored("t:globex") == (0, 0)
            # expired and swept, deleted: each given back once
            await client.delete(f"{batch_names['prefix']}:file:file-out")
            assert await files.sweep(time.time() + config.output_ttl_s + 1) == 1
            assert await files.sweep(time.time() + config.output_ttl_s + 1) == 0
            assert await files.usage.stored("t:acme") == (5000, 1)
            assert await files.delete("t:acme", kept.file_id)
            assert not await files.delete("t:acme", kept.file_id)
            assert await files.usage.stored("t:acme") == (0, 0)
            assert stored_names(batch_names) == set()
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_hold_left_by_an_upload_that_died_lapses(
    batch_names: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica killed mid-upload never releases what the upload held: the hold lapses on its own."""
    monkeypatch.setattr("gateway.batch.usage.HOLD_S", 0.3)

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], max_tenant_bytes=BOUND)
        client = aioredis.Redis()
        try:
            files = Files(client, DirectoryStore(config.files_dir), config)
            assert await files.usage.reserve("t:acme", "died", BOUND, BOUND) == BOUND  # and is never released
            with pytest.raises(StorageFull):
                await files.store(_once(b"x" * 10), scope="t:acme")
            await asyncio.sleep(0.5)
            stored = await files.store(_once(b"x" * 10), scope="t:acme")
            await files.register("t:acme", stored, "in.jsonl", "batch")
            assert await files.usage.stored("t:acme") == (10, 1)
        finally:
            await client.aclose()

    asyncio.run(scenario())


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def refused_batch(caught: pytest.ExceptionInfo[openai.BadRequestError], code: str) -> None:
    assert caught.value.status_code == 400
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code, error


def test_a_tenant_whose_results_filled_its_storage_creates_no_batch_until_it_deletes(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """A 4 KB input of 2,000 malformed lines writes an error file far larger than the bound, for free (no
    line reaches a worker). The batch's results are written all the same, but the next batch is refused
    (nothing more is written) until files are deleted: batches over one small input cannot pile results up."""
    config = base_config([upstream_url], batches=batches_section(batch_names, max_tenant_bytes=BOUND))
    store = redis.Redis()
    try:
        with gateway_factory(config) as (_, server):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            source = client.files.create(file=("in.jsonl", b"x\n" * 2000), purpose="batch")
            done = wait_for(client, start_on(client, source.id).id, ("completed", "failed"), timeout_s=60)
            assert done.error_file_id is not None, done
            result = client.files.retrieve(done.error_file_id).bytes
            assert result > BOUND
            for _ in range(3):
                with pytest.raises(openai.BadRequestError) as caught:
                    start_on(client, source.id)
                refused_batch(caught, "stored_bytes_exceeded")
            assert len(client.batches.list().data) == 1
            stored = int(store.hget(f"{batch_names['prefix']}:usage:shared", "bytes") or 0)
            assert stored == len(b"x\n" * 2000) + result <= BOUND + result
            client.files.delete(done.error_file_id)  # room again: batches may be created
            again = wait_for(client, start_on(client, source.id).id, ("completed", "failed"), timeout_s=60)
            assert again.error_file_id is not None, again
    finally:
        store.close()


def test_a_tenant_with_its_most_files_creates_no_batch(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names, max_tenant_files=2))
    with gateway_factory(config) as (_, server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        source = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
        done = wait_for(client, start_on(client, source.id).id, ("completed", "failed"), timeout_s=30)
        assert done.status == "completed" and done.output_file_id is not None, done
        with pytest.raises(openai.BadRequestError) as caught:  # the input and the output: 2 files
            start_on(client, source.id)
        refused_batch(caught, "stored_files_exceeded")


def start_on(client: openai.OpenAI, input_file_id: str) -> Any:
    return client.batches.create(input_file_id=input_file_id, endpoint="/v1/chat/completions", completion_window="24h")
