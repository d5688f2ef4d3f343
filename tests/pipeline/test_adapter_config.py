"""LoRA adapters in config.yaml: validation, the model table's view of them, and /v1/models."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.pipeline.config import AdapterModel, ConfigError, parse_config
from gateway.pipeline.models import ModelTable
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

ADAPTERS = [
    {"name": "sql", "path": "/adapters/sql", "aliases": ["sql-v1"]},
    {"name": "support", "path": "s3://bucket/support", "served_name": "support-2"},
]


def yaml_with(adapters: list[dict[str, Any]], **model: Any) -> str:
    import yaml

    entry = {"name": "base", "aliases": ["b"], "workers": ["http://127.0.0.1:1"], "adapters": adapters, **model}
    return yaml.safe_dump({"models": [entry]})


def test_an_adapter_resolves_to_a_model_of_its_own_on_the_base_models_workers() -> None:
    config = parse_config(yaml_with(ADAPTERS, max_model_len=2048))
    table = ModelTable(config)
    sql = table.resolve("sql-v1")
    assert isinstance(sql, AdapterModel)
    assert (sql.name, sql.base, sql.upstream_name, sql.workers) == ("sql", "base", "sql", ["http://127.0.0.1:1"])
    assert sql.max_model_len == 2048
    support = table.resolve("support")
    assert isinstance(support, AdapterModel) and support.upstream_name == "support-2"
    assert [m.name for m in table.models] == ["base"]  # the base models only
    assert table.all_worker_urls() == ["http://127.0.0.1:1"]
    base = table.resolve("b")
    assert base is not None and base.lora_settings is not None and base.lora_settings.max_loras == 4
    # every plugin is handed the same objects as the table (routing compares them by identity)
    assert config.served_models[1] is sql


@pytest.mark.parametrize(
    ("adapters", "model", "problem"),
    [
        ([{"name": "b", "path": "/x"}], {}, "'b' is used twice"),
        ([{"name": "x", "path": "/x", "aliases": ["base"]}], {}, "'base' is used twice"),
        ([{"name": "x", "path": "/x"}, {"name": "x", "path": "/y"}], {}, "'x' is used twice"),
        ([{"name": "x", "path": "relative/dir"}], {}, "must be absolute"),
        ([{"name": "x", "path": "/x", "served_name": "base"}], {}, "served under a base model's name"),
        (
            [{"name": "x", "path": "/x"}, {"name": "y", "path": "/y", "served_name": "x"}],
            {},
            "adapters 'x' and 'y' are both served as 'x' (lora_name) from different paths",
        ),
        ([{"name": "x", "path": "/x"}], {"lora": {"max_lora_rank": 12}}, "max_lora_rank must be one of"),
        ([{"name": "x", "path": "/x", "weights": 1}], {}, "Extra inputs are not permitted"),
    ],
)
def test_bad_adapter_configs_are_refused_with_the_reason(
    adapters: list[dict[str, Any]], model: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml_with(adapters, **model))
    assert problem in str(caught.value)


def test_a_model_without_adapters_runs_its_workers_without_lora() -> None:
    config = parse_config(yaml_with([]))
    assert config.models[0].lora_settings is None
    with_slots = parse_config(yaml_with([], lora={"max_loras": 2, "max_lora_rank": 8}))
    assert with_slots.models[0].lora_settings is not None  # ready for adapters added by a later reload


def test_each_worker_has_one_set_of_lora_settings_whatever_the_models_sharing_it_ask_for() -> None:
    """A worker's adapter slots are its own: a managed worker's as launched (its own ``lora:`` first), an
    external one's the largest its models ask for, as a managed one shared by several models."""
    config = parse_config(
        orjson.dumps(
            {
                "models": [
                    {"name": "a", "workers": ["own", "plain", "http://x:1"], "lora": {"max_loras": 2}},
                    {"name": "b", "workers": ["own", "plain", "http://x:1", "dns://y:2"], "adapters": ADAPTERS},
                    {"name": "c", "workers": ["http://z:3"]},
                ],
                "engine": {
                    "workers": [
                        {"name": "own", "model": "smollm2", "port": 8001, "lora": {"max_loras": 1}},
                        {"name": "plain", "model": "smollm2", "port": 8002},
                    ]
                },
            }
        )
    )
    slots = {ref: lora.max_loras for ref, lora in config.worker_lora().items()}
    assert slots == {"own": 1, "plain": 4, "http://x:1": 4, "dns://y:2": 4}
    assert {w.name: w.lora and w.lora.max_loras for w in config.managed_workers()} == {"own": 1, "plain": 4}


def test_models_lists_each_adapter_with_its_base_model_as_parent(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    config["models"][0]["adapters"] = ADAPTERS
    with gateway_factory(config) as (_, server):
        cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
        one = httpx.get(server.url + "/v1/models/sql-v1").json()
    assert set(cards) == {"m1", "alias-1", "sql", "sql-v1", "support"}
    assert cards["sql"]["parent"] == "m1" and cards["sql"]["root"] == "sql"
    assert cards["sql-v1"]["parent"] == "m1" and cards["sql-v1"]["root"] == "sql"
    assert cards["alias-1"]["parent"] == "m1" and "parent" not in cards["m1"]
    assert one["id"] == "sql-v1" and one["parent"] == "m1"
