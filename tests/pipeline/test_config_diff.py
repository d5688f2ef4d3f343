"""A candidate config compared with the running one: leaves by path, named lists by name."""

from __future__ import annotations

from gateway.pipeline.config_diff import config_diff


def test_leaves_are_added_removed_and_changed() -> None:
    running = {"upstream": {"connect_timeout_s": 1, "retries": 2}, "logging": {"level": "info"}}
    candidate = {"upstream": {"connect_timeout_s": 3, "pool": 8}, "logging": {"level": "info"}}
    assert config_diff(running, candidate) == [
        {"path": "upstream.connect_timeout_s", "change": "changed", "running": 1, "candidate": 3},
        {"path": "upstream.retries", "change": "removed", "running": 2, "candidate": None},
        {"path": "upstream.pool", "change": "added", "running": None, "candidate": 8},
    ]
    assert config_diff(running, running) == []


def test_named_lists_compare_by_name_not_position() -> None:
    running = {"plugins": [{"name": "safety", "config": {"x": 1}}, {"name": "routing", "config": {}}]}
    candidate = {"plugins": [{"name": "routing", "config": {}}, {"name": "safety", "config": {"x": 2}}]}
    diff = {d["path"]: d for d in config_diff(running, candidate)}
    assert diff["plugins[].name"]["running"] == ["safety", "routing"]
    assert diff["plugins[].name"]["candidate"] == ["routing", "safety"]
    assert diff["plugins[safety].config.x"]["candidate"] == 2
    assert len(diff) == 2


def test_plain_lists_compare_by_position() -> None:
    diff = config_diff({"workers": ["a", "b"]}, {"workers": ["a", "c", "d"]})
    assert [(d["path"], d["change"]) for d in diff] == [("workers[1]", "changed"), ("workers[2]", "added")]
