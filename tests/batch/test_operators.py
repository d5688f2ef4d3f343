"""What operators see of batches: ``gateway batches`` (list, show, cancel with a progress bar) and the
admin JSON behind it, every tenant's batches with owner and progress; the batch metrics on /metrics."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
from click.testing import CliRunner

from gateway.cli import main
from tests.support.batches import batches_section, chat_line, jsonl, wait_for
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "batch-admin-token"


def test_gateway_batches_lists_shows_and_cancels(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names, max_in_flight=1))
    runner = CliRunner()
    with gateway_factory(config, admin_token=TOKEN) as (_, server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        source = client.files.create(file=("in.jsonl", jsonl([chat_line(f"o-{i}", "x") for i in range(4)])),
                                     purpose="batch")  # fmt: skip
        finished = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")  # fmt: skip
        wait_for(client, finished.id, ("completed",))
        upstream.behavior.hold = threading.Event()
        try:
            held = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")  # fmt: skip
            wait_for(client, held.id, ("in_progress",))
            args = ["--url", server.url, "--token", TOKEN]
            listed = runner.invoke(main, ["batches", "list", *args])
            assert listed.exit_code == 0, listed.output
            rows = listed.output.splitlines()
            assert rows[0].startswith(held.id) and "in_progress" in rows[0]
            assert rows[1].startswith(finished.id) and "[########################] 4/4 100%" in rows[1]
            auth = {"authorization": f"Bearer {TOKEN}"}
            running = httpx.get(f"{server.url}/admin/batches/{held.id}", headers=auth).json()
            assert (running["models"], running["queued"], running["key_id"]) == (["m1"], 4, None)
            done = httpx.get(f"{server.url}/admin/batches/{finished.id}", headers=auth).json()
            assert (done["models"], done["queued"], done["progress"]) == (["m1"], 0, 1.0)
            assert done["output_tokens_per_s"] <= 12  # 12 tokens over at least one (whole) second
            shown = runner.invoke(main, ["batches", "show", finished.id, *args])
            assert shown.exit_code == 0 and '"owner": "shared"' in shown.output and '"progress": 1.0' in shown.output
            cancelled = runner.invoke(main, ["batches", "cancel", held.id, *args])
            assert cancelled.exit_code == 0 and held.id in cancelled.output
            assert wait_for(client, held.id, ("cancelled",)).request_counts.total == 4  # type: ignore[union-attr]
            again = runner.invoke(main, ["batches", "cancel", finished.id, *args])
            assert again.exit_code == 1 and "can no longer be cancelled" in again.output
            denied = runner.invoke(main, ["batches", "list", "--url", server.url, "--token", "wrong"])
            assert denied.exit_code == 1 and "403" in denied.output
        finally:
            upstream.behavior.hold.set()
        metrics = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"}).text
    assert 'gateway_batch_lines_total{outcome="completed"} 4.0' in metrics
    assert 'gateway_batch_tokens_total{kind="output"} 12.0' in metrics  # the fake answers 3 tokens a line
