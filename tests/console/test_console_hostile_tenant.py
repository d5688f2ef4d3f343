"""The console against a tenant who writes markup wherever the API lets them, in a real headless chromium: a
real gateway (admin port, tenancy with client keys, the Batch API on the real Redis, a fake worker).

The tenant plants its payloads through the public API with its own key (a batch's metadata keys and values,
custom ids, model names, an input file's name, a chat naming a model that does not exist); the operator
then opens every view. Nothing of it becomes an element or runs, the admin token never leaves the page but
in the ``x-admin-token`` header of same-origin calls (no URL, no storage, no cookie, no referrer), and
were markup ever to get in, the page's Content-Security-Policy would still stop inline script, other
origins' images and connections to anywhere else."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.console.conftest import screenshot
from tests.support.batches import batch_names, batches_section, chat_line, jsonl, wait_for
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import USAGE_KEYS, prefix, usage_plugins

__all__ = ["batch_names", "prefix"]  # the fixtures, imported to be used here

pytestmark = pytest.mark.browser

TOKEN = "console-hostile-token-a93c"
WAIT_MS = 15_000
TENANT_KEY = USAGE_KEYS["k2"]  # acme's key without a per-minute limit
#: Each sets window.__pwned if it ever runs (short enough for a metadata key: 64 characters at most).
IMG = "<img src=x onerror=window.__pwned=1>"
SCRIPT = "<script>window.__pwned=2</script>"
SVG = "<svg onload=window.__pwned=3>"
LINK = '"><a href="javascript:window.__pwned=4">x</a>'
HOSTILE = IMG + SCRIPT + SVG + LINK
#: Records every Content-Security-Policy violation the page reports, before any of its own scripts run.
RECORD_VIOLATIONS = (
    "window.__violations = [];"
    "document.addEventListener('securitypolicyviolation',"
    " (e) => window.__violations.push(e.effectiveDirective + ' ' + e.blockedURI));"
)
VIEWS = ["workers", "live", "config", "usage", "batches", "tenancy", "playground"]


@pytest.fixture
def hostile(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    """The gateway, with acme's batch planted through the public API with the tenant's own key."""
    config = base_config([upstream_url], plugins=usage_plugins(prefix), batches=batches_section(batch_names))
    admin_port = free_port()
    with gateway_factory(config, admin_token=TOKEN, admin_port=admin_port) as (_, server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=TENANT_KEY, max_retries=0)
        lines = [chat_line(IMG, "hi"), chat_line(SCRIPT, "hi", model=HOSTILE)]
        source = client.files.create(file=(f"{IMG}.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                      completion_window="24h",
                                      metadata={IMG: HOSTILE, SVG: LINK})  # fmt: skip
        wait_for(client, batch.id, ("completed",))
        # An unknown model: its name comes back in the error message, and the request is counted.
        refused = httpx.post(server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {TENANT_KEY}"},
                             json={"model": HOSTILE, "messages": [{"role": "user", "content": HOSTILE}]})  # fmt: skip
        assert refused.status_code == 404 and IMG in refused.json()["error"]["message"]
        yield {"admin": f"http://127.0.0.1:{admin_port}", "batch": batch.id}


class Thief:
    """Another origin: records every request that reaches it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def open_console(page: Any, admin: str) -> list[Any]:
    """Sign in, the page's requests recorded from the first one on."""
    requests: list[Any] = []
    page.on("request", lambda request: requests.append(request))
    page.add_init_script(RECORD_VIOLATIONS)
    page.goto(admin + "/admin/ui")
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#tabs:not([hidden])", timeout=WAIT_MS)
    return requests


def test_a_tenants_markup_stays_text_in_every_view_and_the_token_stays_in_the_page(
    page: Any, hostile: dict[str, Any]
) -> None:
    admin = hostile["admin"]
    requests = open_console(page, admin)

    page.click("#tabs button[data-view='batches']")
    row = page.locator(f"#batches-table tr[data-batch='{hostile['batch']}']")
    row.wait_for(timeout=WAIT_MS)
    metadata = row.locator("td.metadata div")
    assert sorted(metadata.nth(i).inner_text() for i in range(2)) == sorted([f"{IMG} {HOSTILE}", f"{SVG} {LINK}"])
    assert row.locator("td.models").inner_text() == f"{HOSTILE}, m1"
    assert row.locator("td").nth(1).inner_text() == "t:acme\nkey k2"  # the owner's scope, the key below it
    screenshot(page, "hostile-batches")

    for view in VIEWS:
        page.click(f"#tabs button[data-view='{view}']")
        page.wait_for_selector(f"#view-{view}:not([hidden])", timeout=WAIT_MS)
    page.wait_for_selector("#keys-table tr[data-key='k2']", state="attached", timeout=WAIT_MS)
    page.click("#tabs button[data-view='usage']")
    page.wait_for_selector("#usage-table[data-shown]", state="attached", timeout=WAIT_MS)

    # The playground: the tenant's model name echoed in the gateway's error, the answer too.
    page.click("#tabs button[data-view='playground']")
    page.wait_for_selector("#chat-model option[value='m1']", state="attached", timeout=WAIT_MS)
    page.fill("#chat-key", TENANT_KEY)
    # Chosen and sent in one task: the view's periodic refresh replaces the options, which would drop
    # an option added before a separate click (the request then names no model: a 400, not the 404).
    page.evaluate(
        "(name) => { const s = document.getElementById('chat-model');"
        " s.append(new Option(name, name)); s.value = name; document.getElementById('chat-send').click(); }",
        HOSTILE,
    )
    page.wait_for_selector("#chat-status:has-text('HTTP 404')", timeout=WAIT_MS)
    assert HOSTILE in page.inner_text("#chat-answer")

    # No markup became an element anywhere, nothing ran, nothing needed the policy to stop it.
    made = page.locator("main img, main script, main svg, main a, main iframe, main object, main embed")
    assert made.count() == 0
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("window.__violations") == []
    assert page.console_errors == []

    # The token: only ever in the x-admin-token header of this origin's calls, never in a URL or a
    # referrer, never stored, the sign-in field emptied.
    assert page.url == admin + "/admin/ui"
    assert page.input_value("#token") == ""
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0
    assert page.evaluate("document.cookie") == ""
    assert page.context.cookies() == []
    carried = [r for r in requests if r.headers.get("x-admin-token") == TOKEN]
    assert {r.url.split("?")[0].removeprefix(admin) for r in carried} >= {"/admin/batches", "/admin/ui/chat"}
    for request in requests:
        assert request.url.startswith(admin + "/admin/"), request.url  # nothing goes anywhere else
        assert TOKEN not in request.url
        assert not request.headers.get("referer"), request.url  # no-referrer: none, not even this page
        assert all(TOKEN not in value for name, value in request.headers.items() if name != "x-admin-token")
        assert request.post_data is None or TOKEN not in request.post_data


def test_the_policy_stops_markup_that_got_in(page: Any, hostile: dict[str, Any]) -> None:
    """Defence in depth: were a view ever to parse a tenant's text as HTML, the page's own policy would
    keep it from running or from sending the token anywhere."""
    thief = Thief()
    with ServerThread(thief, lifespan="off") as server:
        requests = open_console(page, hostile["admin"])
        inject(page, server.url + "/steal")
        assert reported(page, {"script-src-attr", "script-src-elem", "img-src", "connect-src"})
    assert page.evaluate("window.__pwned") is None
    assert all(r.failure == "csp" for r in requests if r.url.startswith(server.url))
    assert thief.seen == []  # the other origin was never reached


def inject(page: Any, elsewhere: str) -> None:
    """What a view that parsed HTML would let in: markup, an inline script, a javascript: link, an image
    and a fetch to another origin (where the token could be sent)."""
    page.evaluate(
        """([markup, elsewhere]) => {
             const box = document.createElement('div');
             box.innerHTML = markup + `<img src="${elsewhere}?img">`;  // the <a> first: inside <svg> it is not drawn
             document.querySelector('main').append(box);
             const script = document.createElement('script');
             script.textContent = 'window.__pwned = 5';
             document.head.append(script);
             fetch(elsewhere + '?fetch').catch(() => {});
           }""",
        [LINK + IMG + SCRIPT + SVG, elsewhere],
    )
    page.click("main a")  # the javascript: link


def reported(page: Any, wanted: set[str]) -> set[str]:
    """The directives the page reported violated, once ``wanted`` are among them or after a bound (the
    events are dispatched asynchronously). Polled from here: the page's policy forbids string evaluation."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:
        directives = {v.split(" ", 1)[0] for v in page.evaluate("() => window.__violations")}
        if wanted <= directives or time.monotonic() > deadline:
            assert wanted <= directives, directives
            return directives
        page.wait_for_timeout(50)


def test_a_tenants_file_is_no_script_for_the_console(
    browser: Any,
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
) -> None:
    """Without an admin port the console shares its origin with the Files API, and its policy allows this
    origin's scripts: a file a tenant uploaded must not be one. Were markup ever to get into the page (an
    ``<iframe srcdoc>`` with a ``<script src>`` needs no inline script), the file's content would run
    with the page's rights, the token's included."""
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config, admin_token=TOKEN) as (_, server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        planted = client.files.create(file=("x.jsonl", b"window.__pwned = 'from a file';\n"), purpose="batch")
        # The console on the public port, behind something that adds the admin token (as docs/console.md says).
        context = browser.new_context(extra_http_headers={"authorization": f"Bearer {TOKEN}"})
        try:
            page = context.new_page()
            page.goto(server.url + "/admin/ui")
            page.wait_for_selector("#login:not([hidden])", timeout=WAIT_MS)
            outcome = page.evaluate(
                """(src) => new Promise((resolve) => {
                     const script = document.createElement('script');
                     script.src = src;
                     script.addEventListener('load', () => resolve('load'));
                     script.addEventListener('error', () => resolve('error'));
                     document.head.append(script);
                   })""",
                f"/v1/files/{planted.id}/content",
            )
            assert (outcome, page.evaluate("() => window.__pwned")) == ("error", None)
        finally:
            context.close()
