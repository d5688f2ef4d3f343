"""The console's batches view in a real headless chromium against a real gateway (admin port) with the
Batch API on the real Redis and a fake worker: batches created through the openai SDK show with their
owner, endpoint, models, progress bar and figures, a running batch's progress moves while the view is
open, and what a tenant wrote into a batch (its metadata, a model name) stays text."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest

from tests.console.conftest import screenshot
from tests.support.batches import batch_names, batches_section, chat_line, jsonl, wait_for
from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import GatewayFactory, base_config

__all__ = ["batch_names"]  # the fixture, imported to be used here

pytestmark = pytest.mark.browser

TOKEN = "console-batches-token-5c0e"
WAIT_MS = 15_000
HOSTILE = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'


def sign_in(page: Any, admin: str) -> None:
    page.goto(admin + "/admin/ui")
    page.fill("#token", TOKEN)
    page.click("#login-button")
    page.wait_for_selector("#tabs:not([hidden])", timeout=WAIT_MS)


def cell(row: Any, field: str) -> str:
    return str(row.locator(f"td[data-field='{field}']").inner_text())


def test_batches_view_shows_progress_and_keeps_tenant_text_as_text(
    page: Any,
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names, max_in_flight=1))
    admin_port = free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    with gateway_factory(config, admin_token=TOKEN, admin_port=admin_port) as (_, server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        # Three answered lines and one naming a model the gateway does not serve (refused: failed).
        lines = [chat_line(f"ok-{i}", "hi") for i in range(3)] + [chat_line("bad", "hi", model=HOSTILE)]
        source = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        finished = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"description": HOSTILE})  # fmt: skip
        wait_for(client, finished.id, ("completed",))

        upstream.behavior.hold = threading.Event()  # the next batch's lines wait at the worker
        try:
            held = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")  # fmt: skip
            wait_for(client, held.id, ("in_progress",))

            sign_in(page, admin)
            page.click("#tabs button[data-view='batches']")
            done_row = page.locator(f"#batches-table tr[data-batch='{finished.id}']")
            done_row.wait_for(timeout=WAIT_MS)
            held_row = page.locator(f"#batches-table tr[data-batch='{held.id}']")
            held_row.wait_for(timeout=WAIT_MS)
            rows = page.locator("#batches-table tbody tr")
            assert rows.nth(0).get_attribute("data-batch") == held.id  # newest first

            # The finished batch: every line counted, the bar full, its figures beside it.
            cells = done_row.locator("td")
            assert cells.nth(1).inner_text() == "shared"  # the owner (no tenancy: one shared scope)
            assert cells.nth(2).inner_text() == "completed"
            assert cells.nth(3).inner_text() == "/v1/chat/completions"
            bar = done_row.locator("td.progress progress")
            assert bar.get_attribute("max") == "4" and bar.get_attribute("value") == "4"
            assert done_row.locator("td.progress").inner_text().strip() == "4/4 100 %"
            assert (cell(done_row, "completed"), cell(done_row, "failed"), cell(done_row, "queued")) == ("3", "1", "0")
            assert float(cell(done_row, "tokens_per_s")) > 0
            assert cells.nth(10).inner_text() != "-" and cells.nth(11).inner_text() != "-"  # created, finished

            # The running batch: its refused line done at once (failed), the three others waiting behind the
            # one held at the worker (queued counts the lines not done yet), not finished.
            held_row.locator("td[data-field='failed']:text-is('1')").wait_for(timeout=WAIT_MS)
            assert held_row.locator("td").nth(2).inner_text() == "in_progress"
            assert held_row.locator("td.progress progress").get_attribute("value") == "1"
            assert held_row.locator("td.progress").inner_text().strip() == "1/4 25 %"
            assert (cell(held_row, "completed"), cell(held_row, "queued")) == ("0", "3")
            assert held_row.locator("td").nth(11).inner_text() == "-"
            totals = page.locator("#batches-totals td[data-field]")
            figures = [totals.nth(i).inner_text() for i in range(4)]  # active batches, lines done, failed, queued
            assert figures == ["1", "3", "2", "3"]
            screenshot(page, "batches")
        finally:
            upstream.behavior.hold.set()

        # The view polls: the running batch's bar fills without a click.
        held_row.locator("td.status:has-text('completed')").wait_for(timeout=WAIT_MS)
        assert held_row.locator("td.progress progress").get_attribute("value") == "4"
        assert cell(held_row, "queued") == "0"

        # Tenant text: the metadata value and the model name show as those characters, no element made.
        metadata = done_row.locator("td.metadata")
        assert metadata.inner_text().strip() == f"description {HOSTILE}"
        assert done_row.locator("td.models").inner_text() == f"{HOSTILE}, m1"
        assert done_row.locator("td.metadata img, td.metadata script, td.models img, td.models script").count() == 0
        assert page.locator("#view-batches img, #view-batches script").count() == 0
        assert page.evaluate("window.__xss") is None
        assert page.console_errors == []

        # The view's data is the admin API's: nothing without the token.
        assert httpx.get(admin + "/admin/batches").status_code == 401
