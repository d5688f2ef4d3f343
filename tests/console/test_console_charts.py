"""The console's charts in a real headless chromium: the live and workers views draw the in-memory series
after a burst of requests (pixels of the series' colour on the canvas, points in the series), and the usage
view shows the tenancy counters kept in the real Redis for a known set of requests, with a CSV that is the
admin JSON row for row. Screenshots in .artifacts/console/."""

from __future__ import annotations

import csv
import io
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.server.console import assets
from plugins.tenancy.budgets import usage_key
from tests.console.conftest import screenshot
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import USAGE_KEYS, prefix, usage_plugins

__all__ = ["prefix"]  # the fixture, imported to be used here

pytestmark = pytest.mark.browser

TOKEN = "console-charts-token-7c1d"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
WAIT_MS = 20_000
KEYS = USAGE_KEYS
BLUE = (0x1F, 0x6F, 0xEB)  # the first series' stroke in charts.js


@pytest.fixture
def console(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> Iterator[dict[str, Any]]:
    """Tenancy with three keys of two tenants (k1 limited to 3 requests a minute), routing to the fake
    worker; the console on the admin port; the live series sampled every 0.2 s."""
    plugins = usage_plugins(prefix)
    admin_port = free_port()
    settings = {"admin_token": TOKEN, "admin_port": admin_port, "console_sample_s": 0.2}
    with gateway_factory(base_config([upstream_url], plugins=plugins), **settings) as (app, server):
        yield {"app": app, "public": server.url, "admin": f"http://127.0.0.1:{admin_port}", "worker": upstream_url}


def sign_in(page: Any, admin: str) -> None:
    page.goto(admin + "/admin/ui")
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#tabs:not([hidden])", timeout=WAIT_MS)


def chat(server: ServerThread | str, key: str, **extra: Any) -> httpx.Response:
    url = server if isinstance(server, str) else server.url
    body = {"model": "m1", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 8, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def coloured_pixels(page: Any, selector: str, rgb: tuple[int, int, int]) -> int:
    """Pixels of the chart's canvas within a small distance of ``rgb`` (anti-aliasing blurs the edges)."""
    count: int = page.evaluate(
        """([selector, rgb]) => {
          const canvas = document.querySelector(selector + " canvas");
          const { data } = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
          let n = 0;
          for (let i = 0; i < data.length; i += 4) {
            const d = Math.abs(data[i] - rgb[0]) + Math.abs(data[i + 1] - rgb[1]) + Math.abs(data[i + 2] - rgb[2]);
            if (data[i + 3] > 200 && d < 40) n++;
          }
          return n;
        }""",
        [selector, list(rgb)],
    )
    return count


def wait_for_points(page: Any, selector: str) -> None:
    """Until the chart at ``selector`` has two points or more. A function, not an expression: the page's
    CSP forbids the eval Playwright would poll an expression with."""
    predicate = "(selector) => Number(document.querySelector(selector)?.dataset.points) >= 2"
    page.wait_for_function(predicate, arg=selector, timeout=WAIT_MS)


def burst(public: str, seconds: float) -> None:
    """Requests for ``seconds``, paced streams among them (so some are in flight when a sample is taken)."""
    deadline = time.monotonic() + seconds

    def client(stream: bool) -> None:
        while time.monotonic() < deadline:
            assert chat(public, KEYS["k2"], stream=stream).status_code == 200

    threads = [threading.Thread(target=client, args=(i % 2 == 0,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_live_and_worker_charts_draw_the_series_after_a_burst(
    page: Any, console: dict[str, Any], upstream: FakeUpstream
) -> None:
    upstream.behavior.chunks = 4
    upstream.behavior.pace_s = 0.05
    burst(console["public"], 1.5)
    series = httpx.get(console["admin"] + "/admin/series", headers=ADMIN).json()
    requests = [v for v in series["models"]["m1"]["requests_per_s"] if v]
    assert len(requests) >= 2  # the series has points with traffic in them
    assert any(v for v in series["workers"][console["worker"]]["in_flight"])

    sign_in(page, console["admin"])
    page.click("#tabs button[data-view='live']")
    traffic = "div.model-charts[data-model='m1'] div.chart[data-chart='traffic']"
    wait_for_points(page, traffic)
    assert coloured_pixels(page, traffic, BLUE) > 50  # the requests/s line, not only axes and grid
    for name in ("ttft", "latency", "tokens", "load"):
        chart = f"div.model-charts[data-model='m1'] div.chart[data-chart='{name}']"
        assert int(page.get_attribute(chart, "data-points")) >= 2, name
        assert coloured_pixels(page, chart, BLUE) > 5, name  # a line, or dots where a value stands alone
    page.locator("#live-table tr[data-model='m1']").wait_for(timeout=WAIT_MS)  # the table stays under them
    assert page.is_hidden("#charts-missing")
    screenshot(page, "live")

    page.click("#tabs button[data-view='workers']")
    spark = f"#workers tr[data-worker='{console['worker']}'] td.spark"
    wait_for_points(page, spark)
    assert coloured_pixels(page, spark, BLUE) > 10  # its in-flight line
    held = page.locator(f"#workers tr[data-worker='{console['worker']}'] td.held")
    assert held.count() == 2  # where cached blocks and adapters will show
    screenshot(page, "workers")
    assert page.console_errors == []


def redis_counts(prefix: str, tenant: str, scope: str, name: str, period_id: str) -> dict[str, int]:
    client = redis.Redis()
    try:
        raw = client.hgetall(usage_key(prefix, tenant, scope, name, period_id))
    finally:
        client.close()
    return {k.decode(): int(v) for k, v in raw.items()}


def shown_totals(page: Any) -> dict[str, int]:
    cells = page.locator("#usage-totals td[data-field]")
    return {cells.nth(i).get_attribute("data-field"): int(cells.nth(i).inner_text()) for i in range(cells.count())}


def show(page: Any, scope: str, period: str) -> None:
    """Ask for ``scope`` per ``period`` and wait for its answer: not for any rows (an earlier refresh's
    answer may still be on its way), but for the table that says it holds this scope and period."""
    page.select_option("#usage-scope", scope)
    page.select_option("#usage-period", period)
    page.evaluate("document.getElementById('usage-table').tBodies[0].replaceChildren()")
    page.click("#usage-refresh")
    page.wait_for_selector(f"#usage-table[data-shown='{scope}/{period}'] tbody tr", timeout=WAIT_MS)


def test_usage_view_shows_the_tenancy_counters_and_its_csv_is_the_json(
    page: Any, console: dict[str, Any], upstream: FakeUpstream, prefix: str
) -> None:
    upstream.behavior.chunks = 4  # 4 completion tokens per answer
    public = console["public"]
    statuses = [chat(public, KEYS["k1"]).status_code for _ in range(5)]  # 3 a minute: 2 refused
    statuses += [chat(public, KEYS["k2"]).status_code for _ in range(2)]
    statuses += [chat(public, KEYS["other"]).status_code]
    assert statuses == [200, 200, 200, 429, 429, 200, 200, 200]
    now = datetime.now(UTC)
    hour, day = now.strftime("h%Y%m%d%H"), now.strftime("d%Y%m%d")

    sign_in(page, console["admin"])
    page.click("#tabs button[data-view='usage']")
    page.wait_for_selector("#usage-scope option[value='key:k1']", state="attached", timeout=WAIT_MS)
    for scope, (tenant, kind, name) in {
        "tenant:acme": ("acme", "tenant", "acme"),
        "key:k1": ("acme", "key", "k1"),
        "tenant:globex": ("globex", "tenant", "globex"),
    }.items():
        for period, period_id in (("hour", hour), ("day", day)):
            show(page, scope, period)
            counters = redis_counts(prefix, tenant, kind, name, period_id)
            expected = {f: counters.get(f, 0) for f in ("requests", "refusals", "prompt_tokens", "completion_tokens")}
            assert shown_totals(page) == expected, (scope, period)
            row = page.locator("#usage-table tbody tr").first
            shown_row = {f: int(row.locator(f"td[data-field='{f}']").inner_text()) for f in expected}
            assert shown_row == expected, (scope, period)
    acme = redis_counts(prefix, "acme", "tenant", "acme", day)
    assert (acme["requests"], acme["refusals"], acme["completion_tokens"]) == (5, 2, 5 * 4)
    globex = redis_counts(prefix, "globex", "tenant", "globex", day)
    assert (globex["requests"], globex.get("refusals", 0)) == (1, 0)  # acme's refusals stay acme's

    show(page, "key:k1", "day")
    for chart in ("#usage-tokens-chart", "#usage-requests-chart"):
        assert coloured_pixels(page, chart, BLUE) > 20, chart  # today's bar
    screenshot(page, "usage")

    show(page, "key:k1", "hour")
    with page.expect_download(timeout=WAIT_MS) as download:
        page.click("#usage-csv")
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text(encoding="utf-8"))))
    query = {"key_id": "k1", "period": "hour", "days": 30}
    answer = httpx.post(console["admin"] + "/admin/plugins/tenancy/usage_history", json=query, headers=ADMIN)
    fields = answer.json()["result"]["fields"]
    expected_rows = [{"start": r["start"], **{f: str(r[f]) for f in fields}} for r in answer.json()["result"]["rows"]]
    assert rows == expected_rows
    assert len(rows) == 30 * 24
    assert page.console_errors == []


def test_without_the_charting_library_the_page_says_what_to_run(
    page: Any,
    gateway_factory: GatewayFactory,
    upstream_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkout where `make vendor` never ran: the console's own files, no vendor/ folder."""
    static = tmp_path / "static"
    static.mkdir()
    for name, _ in assets.FILES.values():
        if not name.startswith("vendor/"):
            (static / name).write_bytes((Path(assets.__file__).parent / "static" / name).read_bytes())
    monkeypatch.setattr(assets.resources, "files", lambda package: tmp_path)
    admin_port = free_port()
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN, admin_port=admin_port):
        admin = f"http://127.0.0.1:{admin_port}"
        stand_in = httpx.get(admin + "/admin/ui/vendor/uPlot.iife.min.js")
        assert stand_in.status_code == 200 and b"make vendor" in stand_in.content
        sign_in(page, admin)
        page.click("#tabs button[data-view='live']")
        page.wait_for_selector("#charts-missing:not([hidden])", timeout=WAIT_MS)
        assert "make vendor" in page.inner_text("#charts-missing")
        page.locator("#live-table tbody").wait_for(state="attached", timeout=WAIT_MS)
        page.click("#tabs button[data-view='workers']")
        page.wait_for_selector("#workers tr[data-worker]", timeout=WAIT_MS)  # the tables still work
    assert page.console_errors == []
