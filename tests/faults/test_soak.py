"""The soak in CI: two minutes of mixed traffic (streams, cache hits, safety refusals, guided JSON)
through a real ``gateway serve`` process and a fake worker process, with ``bench/soak.py``'s criteria:
RSS growth <= 10% after warm-up, no file descriptor or asyncio task leak, no unexpected answer. These
are correctness criteria on leaks, not speed targets; the 30-minute run is ``bench/soak.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.scripts import load_script

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


@pytest.mark.slow
def test_two_minute_soak_holds_memory_fds_and_tasks_flat() -> None:
    soak = load_script(SOAK)
    result = soak.run(soak.parse_args(["--minutes", "2", "--sample-s", "10", "--concurrency", "12"]))
    assert result["checks"] == {
        "rss_growth<=10%": True,
        "no_fd_leak": True,
        "no_task_leak": True,
        "no_errors": True,
    }, {k: result.get(k) for k in ("checks", "error_counts", "errors", "idle_tasks", "gateway_log_tail")}
    assert set(result["by_kind"]) == {"plain", "stream", "cached", "refused", "guided", "cached_stream"}
