"""Reload under load: 20 config swaps while requests and open streams flow; nothing fails, every stream
completes on the config it started with, and every retired config's plugins are closed once drained."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import orjson
from pydantic import BaseModel, ConfigDict

from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "load-admin-token"
RELOADS = 20


class GenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generation: int


class Generation(Plugin):
    """Tags each response with its config generation; counts instances open and closed."""

    name = "generation"
    Config = GenConfig

    def __init__(self, config: GenConfig, services: Any) -> None:
        super().__init__(config, services)
        services.shared.setdefault("generation", {"started": [], "closed": []})["started"].append(config.generation)
        self.book = services.shared["generation"]
        self.closed = False

    async def on_request(self, ctx: RequestContext) -> None:
        assert not self.closed, "a request ran on a closed plugin"
        ctx.response_headers["x-generation"] = str(self.config.generation)

    async def aclose(self) -> None:
        self.closed = True
        self.book["closed"].append(self.config.generation)


def config_for(upstream_url: str, generation: int) -> dict[str, Any]:
    plugins = [{"name": "generation", "config": {"generation": generation}}, {"name": "routing"}]
    return base_config([upstream_url], plugins=plugins)


def test_twenty_reloads_under_load_drop_nothing(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    upstream.behavior.chunks = 10
    upstream.behavior.pace_s = 0.03
    failures: list[str] = []
    done = {"requests": 0, "streams": 0}
    stop = threading.Event()
    lock = threading.Lock()

    with gateway_factory(config_for(upstream_url, 0), plugins={"generation": Generation}, admin_token=TOKEN) as (
        app,
        server,
    ):
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}

        def requests_loop() -> None:
            with httpx.Client(base_url=server.url, timeout=10) as client:
                while not stop.is_set():
                    r = client.post("/v1/chat/completions", json=chat)
                    if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != upstream.behavior.text:
                        failures.append(f"request: {r.status_code} {r.text[:200]}")
                    with lock:
                        done["requests"] += 1

        def streams_loop() -> None:
            with httpx.Client(base_url=server.url, timeout=10) as client:
                while not stop.is_set():
                    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                        lines = [line for line in r.iter_lines() if line]
                    text = "".join(
                        orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        for line in lines
                        if line.startswith("data: {")
                    )
                    if r.status_code != 200 or lines[-1] != "data: [DONE]" or text != upstream.behavior.text:
                        failures.append(f"stream: {r.status_code} {lines[-2:]}")
                    with lock:
                        done["streams"] += 1

        threads = [threading.Thread(target=requests_loop) for _ in range(3)]
        threads += [threading.Thread(target=streams_loop) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {TOKEN}"}) as admin:
                versions = set()
                for generation in range(1, RELOADS + 1):
                    time.sleep(0.05)
                    r = admin.put("/admin/config", content=orjson.dumps(config_for(upstream_url, generation)))
                    assert r.status_code == 200 and r.json()["changed"] is True, r.text
                    versions.add(r.json()["version"])
                assert len(versions) == RELOADS
            time.sleep(0.3)  # let streams that started on the last configs run on
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)

        assert failures == []
        assert done["requests"] > RELOADS and done["streams"] > RELOADS // 2
        book = app.state.services.shared["generation"]
        assert book["started"] == list(range(RELOADS + 1))
        # Every retired generation was closed once its requests drained; the live one is still open.
        deadline = time.monotonic() + 5
        while len(book["closed"]) < RELOADS and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(book["closed"]) == list(range(RELOADS))
        r = httpx.post(server.url + "/v1/chat/completions", json=chat)
        assert r.headers["x-generation"] == str(RELOADS)
