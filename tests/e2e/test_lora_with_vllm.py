"""LoRA adapters served by two real vLLM CPU workers, driven through the gateway with the OpenAI SDK.

The adapters are made at test time from the locally prepared default model with ``peft`` (no hub): a
rank-8 ``LoraConfig`` on ``q_proj``/``v_proj`` whose B matrices are random (std 0.15, seeded per
adapter), so each one changes the greedy answer while keeping it readable. The gateway of this module
starts two managed workers with LoRA enabled (``max_loras`` 2, small KV cache, ``--enforce-eager``).

- an adapter served by name answers differently from the base model at temperature 0; the first
  request loads it on one worker and the next ones stay there (one load);
- on one worker, more adapters than ``max_loras`` evict the least recently used;
- an adapter a worker holds from another path than the configured one is loaded again from it;
- a worker killed and restarted by the engine supervisor comes back without its adapters, and the
  gateway loads the adapter again when it is next asked for.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.engine.model_prep import is_complete
from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import GatewayApp, create_app
from tests.support.fakes import ServerThread, free_port
from tests.support.faults import wait_for
from tests.support.gateways import ENGINE_MODEL, REPO, GatewayFactory, base_config, engine_config
from tests.support.processes import kill_worker

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]  # two workers start, one restarts

NAMES = ("sql", "support", "legal")
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]
ADMIN_TOKEN = "lora-e2e-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def make_adapters(model_dir: Path, directory: Path) -> dict[str, str]:
    """Rank-8 adapters of the prepared model, saved by peft (adapter_config.json + safetensors)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = {}
    for seed, name in enumerate(NAMES):
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        model = peft.get_peft_model(base, config, adapter_name=name)
        generator = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:  # B = 0 would make the adapter a no-op
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
        out = directory / name
        model.save_pretrained(out, selected_adapters=[name])
        saved = out / name if (out / name / "adapter_config.json").is_file() else out
        paths[name] = str(saved.resolve())
        base = model.unload()  # the plain model again, for the next adapter
    return paths


def lora_config(ports: list[int], adapters: dict[str, str]) -> dict[str, Any]:
    config = engine_config(ports[0], plugins=[{"name": "routing", "config": {"adapters": {"sync_interval_s": 1}}}])
    spec = config["engine"]["workers"][0]
    config["engine"]["workers"] = [
        {**spec, "name": f"lora-{i}", "port": p, "omp_threads_bind": str(i % 2), "max_num_seqs": 8}
        for i, p in enumerate(ports)
    ]
    model = config["models"][0]
    model["workers"] = ["lora-0", "lora-1"]
    model["adapters"] = [{"name": n, "path": p} for n, p in adapters.items()]
    model["lora"] = {"max_loras": 2, "max_lora_rank": 8}
    return config


@dataclass
class LoraFleet:
    app: GatewayApp
    gateway: ServerThread
    workers: list[str]  # the two workers' URLs
    adapters: dict[str, str]  # name -> path


def private_model_copy(directory: Path) -> Path:
    """A copy of the prepared model that is this module's alone: a worker restarted by the test reads its
    model again, and the shared models/ may be re-prepared by someone else meanwhile."""
    shared = REPO / "models" / ENGINE_MODEL
    wait_for(lambda: is_complete(shared), 600, "the prepared model (models/smollm2)")
    shutil.copytree(shared, directory / ENGINE_MODEL, symlinks=False)
    return directory


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraFleet]:
    if not (REPO / "models").is_dir():
        pytest.skip("the default model is not prepared (models/smollm2)")
    models = private_model_copy(tmp_path_factory.mktemp("models"))
    adapters = make_adapters(models / ENGINE_MODEL, tmp_path_factory.mktemp("adapters"))
    ports = [free_port(), free_port()]
    config = GatewayConfig.model_validate(lora_config(ports, adapters))
    app = create_app(Settings(model_dir=models, admin_token=ADMIN_TOKEN), registry=PluginRegistry(), config=config)
    with ServerThread(app, start_timeout_s=900) as server:
        yield LoraFleet(app, server, [f"http://127.0.0.1:{p}" for p in ports], adapters)


def ask(server: ServerThread, model: str) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    reply = client.chat.completions.create(model=model, messages=PROMPT, temperature=0, max_tokens=24)  # type: ignore[arg-type]
    return str(reply.choices[0].message.content)


def held(url: str) -> set[str]:
    """What the worker itself lists (adapters carry ``parent``)."""
    cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def loads(server: ServerThread, adapter: str) -> float:
    text = httpx.get(server.url + "/metrics", headers=ADMIN, timeout=10).text
    prefix = f'gateway_adapter_loads_total{{adapter="{adapter}",outcome="ok",'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def admin(fleet: LoraFleet, action: str, adapter: str, worker: str) -> None:
    reply = httpx.post(
        f"{fleet.gateway.url}/admin/plugins/routing/{action}",
        headers=ADMIN,
        json={"adapter": adapter, "worker": worker},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text


def test_an_adapter_answers_differently_and_stays_on_the_worker_that_loaded_it(fleet: LoraFleet) -> None:
    gw = fleet.gateway
    base = ask(gw, ENGINE_MODEL)
    first = ask(gw, "sql")
    assert first and first != base, "the adapter did not change the greedy answer"
    holders = [url for url in fleet.workers if "sql" in held(url)]
    assert len(holders) == 1
    for _ in range(3):
        assert ask(gw, "sql")
    assert loads(gw, "sql") == 1
    assert [url for url in fleet.workers if "sql" in held(url)] == holders


def test_more_adapters_than_max_loras_evict_the_least_recently_used(
    fleet: LoraFleet, gateway_factory: GatewayFactory
) -> None:
    """A second gateway in front of one of the two workers only: every adapter must go there."""
    worker = fleet.workers[1]
    config = base_config([worker], plugins=[{"name": "routing", "config": {"adapters": {"sync_interval_s": 1}}}])
    config["models"][0] |= {
        "name": ENGINE_MODEL,
        "aliases": [],
        "adapters": [{"name": n, "path": p} for n, p in fleet.adapters.items()],
        "lora": {"max_loras": 2, "max_lora_rank": 8},
    }
    config["upstream"] |= {"first_byte_timeout_s": 300, "idle_timeout_s": 120}
    with gateway_factory(config) as (app, gw):
        state = app.state.services.workers.get(worker).adapters
        wait_for(lambda: state.synced_at > 0, 30, "the gateway to read what the worker holds")
        for model in ("support", "legal", "support"):  # legal is now the least recently used of the two
            ask(gw, model)
        assert {"support", "legal"} <= held(worker)
        ask(gw, "sql")
        wait_for(lambda: held(worker) == {"support", "sql"}, 30, "legal to be evicted from the worker")


def test_an_adapter_held_from_another_path_is_loaded_again_from_the_configured_one(
    fleet: LoraFleet, gateway_factory: GatewayFactory
) -> None:
    """A gateway whose config serves ``sql`` from the ``legal`` adapter's files (a new path given in a
    reload, or a replica started with it), in front of a worker that holds ``sql`` from its old path: the
    worker loads it again in place (vLLM's ``load_inplace``), and ``sql`` then answers as ``legal`` does.
    vLLM's prefix-cache keys carry the adapter's path, so no block of the old weights is reused."""
    # The gateway of the test before this one evicted adapters behind this module's gateway, which learns
    # that at its next read of the workers' lists: until then a worker it believes holds an adapter may
    # answer vLLM's 404, and the gateway loads the adapter there again and retries (no wait needed).
    legal = ask(fleet.gateway, "legal")
    ask(fleet.gateway, "sql")  # held by some worker, whatever the tests before this one left loaded
    worker = next(url for url in fleet.workers if "sql" in held(url))
    config = base_config([worker], plugins=[{"name": "routing", "config": {"adapters": {"sync_interval_s": 1}}}])
    config["models"][0] |= {
        "name": ENGINE_MODEL,
        "aliases": [],
        "adapters": [{"name": "sql", "path": fleet.adapters["legal"]}],
        "lora": {"max_loras": 2, "max_lora_rank": 8},
    }
    config["upstream"] |= {"first_byte_timeout_s": 300, "idle_timeout_s": 120}
    try:
        with gateway_factory(config) as (app, gw):
            state = app.state.services.workers.get(worker).adapters
            wait_for(lambda: state.synced_at > 0, 30, "the gateway to read what the worker holds")
            assert state.paths.get("sql") == fleet.adapters["sql"]  # learnt with the path the worker read
            assert ask(gw, "sql") == legal
            assert state.paths["sql"] == fleet.adapters["legal"]
            cards = httpx.get(worker + "/v1/models", timeout=10).json()["data"]
            assert [c["root"] for c in cards if c["id"] == "sql"] == [fleet.adapters["legal"]]
    finally:  # the module's gateway still takes sql there for its own: it goes
        admin(fleet, "unload_adapter", "sql", worker)


def test_a_restarted_worker_loses_its_adapters_and_the_gateway_loads_them_again(fleet: LoraFleet) -> None:
    gw, (victim, other) = fleet.gateway, fleet.workers
    admin(fleet, "pin_adapter", "sql", victim)  # sql on the victim only
    admin(fleet, "unpin_adapter", "sql", victim)
    admin(fleet, "unload_adapter", "sql", other)
    before = loads(gw, "sql")
    kill_worker(victim)
    deadline = time.monotonic() + 900
    while True:  # the engine supervisor restarts it
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(victim + "/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "the killed worker was not restarted"
        time.sleep(2)
    assert "sql" not in held(victim) and "sql" not in held(other)  # run-time adapters do not survive it
    wait_for(lambda: fleet.app.state.services.workers.get(victim).available(), 60, "the gateway to see it back")
    answer = ask(gw, "sql")
    assert answer and answer != ask(gw, ENGINE_MODEL)
    assert loads(gw, "sql") == before + 1  # loaded again, on demand
    assert any("sql" in held(url) for url in fleet.workers)
