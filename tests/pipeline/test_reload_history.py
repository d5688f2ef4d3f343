"""The reload history the console shows is bounded and newest first."""

from __future__ import annotations

from gateway.pipeline.reload_history import ReloadHistory


def test_history_keeps_the_newest_entries_only() -> None:
    history = ReloadHistory(limit=3)
    for i in range(5):
        history.record("api", f"admin API from 10.0.0.{i}", "accepted", f"v{i}")
    history.record("watch", None, "refused", "v4", "The new config was refused ...")
    latest = history.latest()
    assert [e.version for e in latest] == ["v4", "v4", "v3"]
    assert latest[0].who == "watch"  # no caller named: the source says who
    assert latest[0].as_json()["at_iso"].endswith("+00:00")
    assert latest[0].as_json()["reason"].startswith("The new config was refused")
