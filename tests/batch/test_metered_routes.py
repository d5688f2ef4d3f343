"""The Files and Batch APIs count against a key's request limits like every other route (uploads,
listings, retrievals, downloads, deletes, batch creation and cancellation: one request each, a 429 with
OpenAI's rate-limit headers past the limit), and the lines a batch runs are counted once each, as
inference requests, never again as calls of these routes. Tenancy on real Redis, a fake worker."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import httpx
import pytest

from gateway.pipeline import ModelResponse, Plugin, RequestContext
from gateway.pipeline.plugin import SideCall
from plugins.tenancy.keys import hash_key
from tests.support.batches import batches_section, chat_line, jsonl
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

LIMITED = f"sk-files-limited-{uuid.uuid4().hex}"  # RPM requests a minute
FREE = f"sk-files-free-{uuid.uuid4().hex}"  # the same tenant, no limits
RPM = 3
UNKNOWN_FILE, UNKNOWN_BATCH = "file-" + "0" * 24, "batch_" + "0" * 24


class Recorder(Plugin):
    """Between tenancy and routing: the side calls tenancy let through, and the batch lines that ran."""

    name = "recorder"
    sides: ClassVar[list[str]] = []
    lines: ClassVar[list[str]] = []

    async def on_side_request(self, call: SideCall) -> None:
        type(self).sides.append(call.route)

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        if ctx.batch_line is not None:
            type(self).lines.append(ctx.request_id)
        return None


def config(upstream_url: str, prefix: str, batch_names: dict[str, Any]) -> dict[str, Any]:
    keys = [
        {"id": "limited", "tenant": "acme", "hash": hash_key(LIMITED, PEPPER.encode()),
         "limits": {"requests_per_minute": RPM}},
        {"id": "free", "tenant": "acme", "hash": hash_key(FREE, PEPPER.encode())},
    ]  # fmt: skip
    plugins = [
        {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}},
        {"name": "recorder"},
        {"name": "routing"},
    ]
    return base_config([upstream_url], plugins=plugins, batches=batches_section(batch_names))


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def calls(server: ServerThread, key: str) -> dict[str, Callable[[], httpx.Response]]:
    """One call of each route (unknown ids where one is needed: the call is counted before the lookup)."""
    url, headers = server.url, auth(key)

    def upload() -> httpx.Response:
        data = jsonl([chat_line("a-1", "hi")])
        return httpx.post(url + "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
                          headers=headers, timeout=10)  # fmt: skip

    def request(method: str, path: str, **kw: Any) -> Callable[[], httpx.Response]:
        return lambda: httpx.request(method, url + path, headers=headers, timeout=10, **kw)

    create = {"input_file_id": UNKNOWN_FILE, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return {
        "files.create": upload,
        "files.list": request("GET", "/v1/files"),
        "files.retrieve": request("GET", f"/v1/files/{UNKNOWN_FILE}"),
        "files.content": request("GET", f"/v1/files/{UNKNOWN_FILE}/content"),
        "files.delete": request("DELETE", f"/v1/files/{UNKNOWN_FILE}"),
        "batches.create": request("POST", "/v1/batches", json=create),
        "batches.list": request("GET", "/v1/batches"),
        "batches.retrieve": request("GET", f"/v1/batches/{UNKNOWN_BATCH}"),
        "batches.cancel": request("POST", f"/v1/batches/{UNKNOWN_BATCH}/cancel"),
    }


ROUTES = ("files.create", "files.list", "files.retrieve", "files.content", "files.delete",
          "batches.create", "batches.list", "batches.retrieve", "batches.cancel")  # fmt: skip


@pytest.mark.parametrize("route", ROUTES)
def test_each_files_and_batches_route_counts_against_the_keys_request_limit(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
    route: str,
) -> None:
    with gateway_factory(config(upstream_url, prefix, batch_names), plugins={"recorder": Recorder}) as (_, server):
        call = calls(server, LIMITED)[route]
        answered = [call().status_code for _ in range(RPM)]
        refused = call()
        free = calls(server, FREE)[route]().status_code  # another key of the same tenant is not limited
    assert 429 not in answered, answered
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
    assert refused.headers["x-ratelimit-limit-requests"] == str(RPM)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.headers["retry-after"]) >= 1
    assert free == answered[0]


def test_the_lines_of_a_batch_are_counted_once_each_and_not_as_route_calls(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    Recorder.sides.clear()
    Recorder.lines.clear()
    with gateway_factory(config(upstream_url, prefix, batch_names), plugins={"recorder": Recorder}) as (_, server):
        data = jsonl([chat_line(f"l-{i}", "hi") for i in range(4)])
        upload = httpx.post(server.url + "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
                            headers=auth(FREE), timeout=10)  # fmt: skip
        assert upload.status_code == 200, upload.text
        body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch = httpx.post(server.url + "/v1/batches", json=body, headers=auth(FREE), timeout=10).json()
        polls, deadline = 0, time.monotonic() + 60
        while True:
            polls += 1
            got = httpx.get(f"{server.url}/v1/batches/{batch['id']}", headers=auth(FREE), timeout=10).json()
            if got["status"] in ("completed", "failed") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert got["status"] == "completed", got
        output = httpx.get(f"{server.url}/v1/files/{got['output_file_id']}/content", headers=auth(FREE), timeout=10)
        assert output.status_code == 200 and output.content.count(b"\n") == 4
    assert len(Recorder.lines) == 4  # each line once, through the inference path
    assert Counter(Recorder.sides) == {"files.create": 1, "batches.create": 1, "batches.retrieve": polls,
                                       "files.content": 1}  # fmt: skip
