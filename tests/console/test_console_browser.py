"""The operator console in a real headless chromium against a real gateway (admin port), fake workers on
real sockets and the real Redis: sign in, watch a worker go unhealthy, reload a config, create and revoke
a key, stream a playground answer; whatever a tenant sent stays text. Screenshots in .artifacts/console/."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.console.conftest import screenshot
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import prefix

__all__ = ["prefix"]  # the fixture, imported to be used here

pytestmark = pytest.mark.browser

TOKEN = "console-browser-token-41b7"
WAIT_MS = 15_000


@pytest.fixture
def console(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> Iterator[dict[str, Any]]:
    """A gateway with tenancy (no client key needed) and routing in front of two fake workers, the second
    one in a server this test may stop; its admin port serves the console."""
    spare = ServerThread(FakeUpstream(name="spare"))
    spare.__enter__()
    tenancy = {"redis_prefix": prefix, "auth": False, "tenants": {"globex": {"tokens_per_day": 100000}}}
    plugins = [{"name": "tenancy", "config": tenancy}, {"name": "routing"}]
    config = base_config([upstream_url, spare.url], plugins=plugins)
    admin_port = free_port()
    try:
        with gateway_factory(config, admin_token=TOKEN, admin_port=admin_port) as (app, server):
            yield {
                "app": app,
                "public": server.url,
                "admin": f"http://127.0.0.1:{admin_port}",
                "config": config,
                "spare": spare,
                "upstream": upstream,
            }
    finally:
        spare.__exit__()


def sign_in(page: Any, admin: str) -> None:
    page.goto(admin + "/admin/ui")
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#tabs:not([hidden])", timeout=WAIT_MS)


def test_sign_in_then_a_stopped_worker_shows_unhealthy(page: Any, console: dict[str, Any]) -> None:
    page.goto(console["admin"] + "/admin/ui")
    page.fill("#token", "not-the-token")
    page.click("#login-button")
    page.wait_for_selector("#login-error:has-text('Not signed in')", timeout=WAIT_MS)
    assert page.is_hidden("#tabs")

    sign_in(page, console["admin"])
    spare = console["spare"].url
    row = page.locator(f"tr[data-worker='{spare}']")
    row.locator("td.state:has-text('healthy')").wait_for(timeout=WAIT_MS)
    assert page.locator("#workers tr[data-worker]").count() == 2

    console["spare"].__exit__()  # the worker's server stops
    row.locator("td.state:has-text('unhealthy')").wait_for(timeout=WAIT_MS)
    assert row.locator("td").nth(6).inner_text() != "-"  # the health check's reason
    screenshot(page, "workers-unhealthy")

    for i in range(6):
        body = {"model": "m1", "messages": [{"role": "user", "content": f"hi {i}"}], "stream": i % 2 == 0}
        assert httpx.post(console["public"] + "/v1/chat/completions", json=body).status_code == 200
    page.click("#tabs button[data-view='live']")
    live = page.locator("#live-table tr[data-model='m1']")
    live.wait_for(timeout=WAIT_MS)
    assert float(live.locator("td").nth(1).inner_text()) >= 0
    screenshot(page, "live-table")
    assert page.console_errors == []


def test_validate_then_reload_a_config(page: Any, console: dict[str, Any]) -> None:
    app, config = console["app"], console["config"]
    before = app.state.holder.current.version
    sign_in(page, console["admin"])
    page.click("#tabs button[data-view='config']")
    page.wait_for_selector(f"#config-version:has-text('{before}')", timeout=WAIT_MS)

    page.fill("#candidate", "models: 3\n")
    page.click("#validate")
    page.wait_for_selector("#problems li", timeout=WAIT_MS)
    assert page.is_disabled("#apply")

    candidate = {**config, "upstream": {**config["upstream"], "connect_timeout_s": 4}}
    page.fill("#candidate", orjson.dumps(candidate, option=orjson.OPT_INDENT_2).decode())
    page.click("#validate")
    page.wait_for_selector("#diff-table:not([hidden]) td:has-text('upstream.connect_timeout_s')", timeout=WAIT_MS)
    assert app.state.holder.current.version == before  # validating changes nothing
    page.click("#apply")
    page.wait_for_selector("#config-status:has-text('reloaded')", timeout=WAIT_MS)
    after = app.state.holder.current.version
    assert after != before
    assert app.state.holder.current.config.upstream.connect_timeout_s == 4
    page.wait_for_selector(f"#config-version:has-text('{after}')", timeout=WAIT_MS)
    first = page.locator("#reloads-table tbody tr").first
    assert "accepted" in first.inner_text() and "admin token holder from 127.0.0.1" in first.inner_text()
    screenshot(page, "config")
    assert page.console_errors == []


def test_create_a_key_shown_once_then_revoke_it(page: Any, console: dict[str, Any]) -> None:
    sign_in(page, console["admin"])
    page.click("#tabs button[data-view='tenancy']")
    page.fill("#new-tenant", "acme")
    page.fill("#new-id", "console-key-1")
    page.click("#create-key")
    page.wait_for_selector("#new-key:not([hidden])", timeout=WAIT_MS)
    key = page.inner_text("#new-key-value").strip()
    assert len(key) > 20
    row = page.locator("#keys-table tr[data-key='console-key-1']")
    row.wait_for(timeout=WAIT_MS)
    assert "acme" in row.inner_text()
    page.wait_for_selector("#tenants-table tr[data-tenant='acme']", timeout=WAIT_MS)
    declared = page.locator("#tenants-table tr[data-tenant='globex']")  # in config.yaml, no key yet
    assert "/ 100000 tokens" in declared.inner_text()
    screenshot(page, "tenancy")

    # The key works against the real Redis-backed store: its usage is readable through the plugin.
    usage = httpx.post(
        console["admin"] + "/admin/plugins/tenancy/usage",
        json={"key_id": "console-key-1"},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert usage.status_code == 200
    page.click("#new-key-dismiss")
    assert page.inner_text("#new-key-value") == ""  # shown once: gone from the page

    page.once("dialog", lambda dialog: dialog.accept())
    row.locator("button.revoke").click()
    row.wait_for(state="detached", timeout=WAIT_MS)
    listed = httpx.post(
        console["admin"] + "/admin/plugins/tenancy/list_keys", headers={"authorization": f"Bearer {TOKEN}"}
    ).json()
    assert all(k["id"] != "console-key-1" for k in listed["result"]["keys"])
    assert page.console_errors == []


HOSTILE = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'


def test_playground_streams_and_shows_what_the_gateway_added(page: Any, console: dict[str, Any]) -> None:
    upstream: FakeUpstream = console["upstream"]
    upstream.behavior.text = "One two three four five six."
    upstream.behavior.chunks = 6
    upstream.behavior.pace_s = 0.05
    sign_in(page, console["admin"])
    page.click("#tabs button[data-view='playground']")
    page.wait_for_selector("#chat-model option[value='m1']", state="attached", timeout=WAIT_MS)
    page.fill("#chat-prompt", "Count to six")
    page.click("#chat-send")
    page.wait_for_selector("#chat-status:has-text('HTTP 200')", timeout=WAIT_MS)
    assert page.inner_text("#chat-answer") == "One two three four five six."
    headers = page.inner_text("#chat-headers")
    assert re.search(r"x-request-id\s+console-[0-9a-f]{32}", headers)
    assert "text/event-stream" in headers
    assert re.search(r"x-gateway-worker\s+http://127\.0\.0\.1:\d+", headers)
    assert re.search(r"time to first token\s+[0-9.]+ ms", headers)
    assert upstream.requests[-1].body["stream"] is True
    screenshot(page, "playground")
    assert page.console_errors == []


def test_what_a_tenant_sent_is_shown_as_text(page: Any, console: dict[str, Any]) -> None:
    upstream: FakeUpstream = console["upstream"]
    upstream.behavior.text = HOSTILE  # a model answer echoing a tenant's prompt
    sign_in(page, console["admin"])
    page.click("#tabs button[data-view='playground']")
    page.wait_for_selector("#chat-model option[value='m1']", state="attached", timeout=WAIT_MS)
    page.fill("#chat-prompt", HOSTILE)
    page.click("#chat-send")
    page.wait_for_selector("#chat-status:has-text('HTTP 200')", timeout=WAIT_MS)
    assert page.inner_text("#chat-answer") == HOSTILE
    assert page.locator("#chat-answer *").count() == 0  # text only: no element was created

    # A model name the tenant chose comes back inside the gateway's error message: text again.
    page.evaluate(
        "(name) => { const o = document.createElement('option'); o.value = name; o.textContent = name;"
        " document.getElementById('chat-model').append(o); document.getElementById('chat-model').value = name; }",
        HOSTILE,
    )
    page.click("#chat-send")
    page.wait_for_selector("#chat-status:has-text('HTTP 404')", timeout=WAIT_MS)
    assert "<script>window.__xss=2</script>" in page.inner_text("#chat-answer")
    assert page.locator("#chat-answer *").count() == 0
    assert page.evaluate("window.__xss") is None
    assert page.console_errors == []
