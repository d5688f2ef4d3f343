"""The console over plain HTTP: who gets the page and with which headers, and the admin endpoints it reads
(stats, workers, reload history, config diff) and its playground, against a real gateway and fake worker."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson
import pytest

from gateway.server.console.assets import CONTENT_SECURITY_POLICY, FILES
from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "console-admin-token-9d2e"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PAGES = list(FILES)  # the page, its scripts and stylesheets, the vendored chart library


def test_public_port_answers_the_page_like_any_admin_path(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (_, server):
        reference = httpx.get(server.url + "/admin/config")
        assert reference.status_code == 401
        for path in PAGES:
            anonymous = httpx.get(server.url + path)
            assert anonymous.status_code == 401, path
            assert anonymous.json()["error"]["code"] == reference.json()["error"]["code"]
            assert "content-security-policy" not in anonymous.headers
            assert httpx.get(server.url + path, headers={"authorization": "Bearer wrong"}).status_code == 403
            assert httpx.get(server.url + path, headers=AUTH).status_code == 200
        chat = httpx.post(server.url + "/admin/ui/chat", json={"model": "m1", "messages": []})
        assert chat.status_code == 401
        assert upstream.requests == []


def test_with_an_admin_port_the_public_port_has_no_console(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    admin_port = free_port()
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN, admin_port=admin_port) as (_, server):
        for path in PAGES:
            assert httpx.get(server.url + path).status_code == 404
            assert httpx.get(server.url + path, headers=AUTH).status_code == 404
        assert httpx.post(server.url + "/admin/ui/chat", headers={"x-admin-token": TOKEN}).status_code == 404
        admin = f"http://127.0.0.1:{admin_port}"
        # On the admin port the page (no data in it) loads without the token; what it reads needs it.
        page = httpx.get(admin + "/admin/ui")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        for path in ("/admin/stats", "/admin/series", "/admin/workers", "/admin/reloads", "/admin/batches"):
            assert httpx.get(admin + path).status_code == 401, path
        assert httpx.post(admin + "/admin/config/diff", content=b"models: []").status_code == 401


def test_every_console_file_carries_a_strict_policy(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (_, server):
        for path in PAGES:
            response = httpx.get(server.url + path, headers=AUTH)
            policy = response.headers["content-security-policy"]
            assert policy == CONTENT_SECURITY_POLICY
            directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
            assert directives["default-src"] == "'self'"
            assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"
            assert directives["frame-ancestors"] == "'none'"
            assert "unsafe" not in policy
            assert response.headers["x-content-type-options"] == "nosniff"
            assert response.headers["cache-control"] == "no-store"
        page = httpx.get(server.url + "/admin/ui", headers=AUTH).text
        assert "<script>" not in page and "<style" not in page and " style=" not in page
        assert not re.search(r"<[^>]*\son[a-z]+\s*=", page)  # no inline event handlers
        for path in (p for p in PAGES if p.endswith(".js")):  # the console's scripts and the vendored uPlot
            script = httpx.get(server.url + path, headers=AUTH).text
            assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "eval(" not in script, path
            assert "new Function" not in script and "document.write" not in script, path


def test_stats_report_the_requests_just_served(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (app, server):
        httpx.get(server.url + "/admin/stats", headers=AUTH)  # the first sample
        for i in range(4):
            body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": i % 2 == 0}
            assert httpx.post(server.url + "/v1/chat/completions", json=body).status_code == 200
        stats = httpx.get(server.url + "/admin/stats", headers=AUTH).json()
        m1 = stats["models"]["m1"]
        assert m1["requests_per_s"] > 0
        assert m1["tokens_per_s"] > 0
        assert m1["errors_per_s"] == 0
        assert 0 < m1["latency_p50_s"] <= m1["latency_p99_s"]
        assert m1["ttft_p50_s"] is not None
        assert m1["cache_hit_rate"] is None  # no cache plugin configured
        assert stats["config_version"] == app.state.holder.current.version


def test_workers_show_health_and_load(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway_factory(base_config([upstream_url, dead]), admin_token=TOKEN) as (_, server):
        rows: dict[str, Any] = {}
        for _ in range(100):
            models = httpx.get(server.url + "/admin/workers", headers=AUTH).json()["models"]
            rows = {w["url"]: w for w in models[0]["workers"]}
            if not rows[dead]["healthy"]:
                break
            httpx.get(server.url + "/health")  # let the health loop run
        assert models[0]["model"] == "m1"
        assert models[0]["in_flight"] == 0 and models[0]["queued"] == 0
        assert rows[upstream_url]["healthy"] and rows[upstream_url]["available"]
        assert rows[dead]["healthy"] is False
        assert rows[dead]["last_error"]
        assert rows[upstream_url]["in_flight"] == 0


def test_reload_history_names_who_and_why(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    with gateway_factory(config, admin_token=TOKEN) as (_, server):
        refused = httpx.put(server.url + "/admin/config", headers=AUTH, content=b"models: 3")
        assert refused.status_code == 400
        changed = {**config, "upstream": {**config["upstream"], "connect_timeout_s": 2}}
        accepted = httpx.put(server.url + "/admin/config", headers=AUTH, content=orjson.dumps(changed))
        assert accepted.status_code == 200
        history = httpx.get(server.url + "/admin/reloads", headers=AUTH).json()
        assert history["version"] == accepted.json()["version"]
        newest, older = history["reloads"][:2]
        assert newest["outcome"] == "accepted" and newest["version"] == accepted.json()["version"]
        assert older["outcome"] == "refused" and "models" in older["reason"]
        assert older["who"].startswith("admin token holder from 127.0.0.1")
        assert newest["at"] >= older["at"]


def test_diff_validates_without_going_live(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    with gateway_factory(config, admin_token=TOKEN) as (app, server):
        version = app.state.holder.current.version
        candidate = {**config, "upstream": {**config["upstream"], "connect_timeout_s": 3}}
        candidate["plugins"] = [{"name": "routing"}, {"name": "safety"}]
        answer = httpx.post(server.url + "/admin/config/diff", headers=AUTH, content=orjson.dumps(candidate)).json()
        assert answer["valid"] is True and answer["running_version"] == version
        paths = {d["path"]: d for d in answer["diff"]}
        assert paths["upstream.connect_timeout_s"]["running"] == 1
        assert paths["upstream.connect_timeout_s"]["candidate"] == 3
        assert paths["plugins[safety]"]["change"] == "added"
        invalid = dict(candidate, plugins=[{"name": "routing", "config": {"policy": "nonsense"}}])
        refused = httpx.post(server.url + "/admin/config/diff", headers=AUTH, content=orjson.dumps(invalid)).json()
        assert refused["valid"] is False and refused["problems"][0].startswith("plugins[0].config")
        assert app.state.holder.current.version == version  # nothing went live
        assert httpx.get(server.url + "/admin/reloads", headers=AUTH).json()["reloads"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_playground_goes_through_the_real_pipeline(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, stream: bool
) -> None:
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (_, server):
        body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        headers = {"x-admin-token": TOKEN, "x-request-id": "console-test-1"}
        answer = httpx.post(server.url + "/admin/ui/chat", json=body, headers=headers)
        assert answer.status_code == 200
        assert answer.headers.get_list("x-request-id") == ["console-test-1"]
        text = answer.text
        assert ("data: [DONE]" in text) == stream
        assert "Hello" in text or "fake" in text
        assert upstream.requests[-1].path == "/v1/chat/completions"
        assert "x-admin-token" not in upstream.requests[-1].headers
        assert answer.headers["x-gateway-worker"] == upstream_url  # the playground sees which worker answered
        client = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert client.status_code == 200 and "x-gateway-worker" not in client.headers  # a client never does
        wrong = httpx.post(server.url + "/admin/ui/chat", json=body, headers={"x-admin-token": "nope"})
        assert wrong.status_code == 403
        assert len(upstream.requests) == 2


def test_polling_the_stats_stores_a_bounded_number_of_samples(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    """``GET /admin/stats`` called as fast as a client can: the samples its answers are measured from stay
    at most one per tenth of the window (and the newest), not one per call."""
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN) as (app, server):
        with httpx.Client(base_url=server.url, headers=AUTH) as client:
            for _ in range(300):
                assert client.get("/admin/stats").status_code == 200
        assert len(app.state.live_stats._samples) <= 11
