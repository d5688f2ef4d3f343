"""deploy/docker and deploy/compose.yaml, checked without a Docker engine: the Dockerfiles parse and copy
files that exist, the worker images run exactly the command the gateway gives a managed worker
(gateway/engine/launch.py), the compose file parses and refers to files that exist, and the gateway
image's claim to need no torch or vLLM is tested by running ``gateway serve`` with those imports blocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.engine.launch import build_argv, build_env
from gateway.engine.spec import ManagedWorkerSpec, SpeculativeSpec
from gateway.ops.settings import Settings
from gateway.pipeline.config import load_config, parse_config
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.validate import resolve_plugins
from gateway.server.admin_hosts import host_allowed, host_names
from tests.support.fakes import FakeUpstream, free_port
from tests.support.tenancy import prefix

__all__ = ["prefix"]  # the fixture, used by name

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILES = ("gateway.Dockerfile", "worker-cpu.Dockerfile")
ENGINE_PACKAGES = ("torch", "vllm", "transformers", "accelerate", "gguf", "torchvision")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and parser directives dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, f"{path.name}: ends inside a continued line"
    return out


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def env_of(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in instructions(path):
        if keyword == "ENV":
            for pair in args.split():
                key, _, value = pair.partition("=")
                env[key] = value
    return env


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_is_well_formed(name: str) -> None:
    path = DEPLOY / "docker" / name
    steps = instructions(path)
    known = {"ARG", "FROM", "ENV", "WORKDIR", "RUN", "COPY", "USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD"}
    assert {k for k, _ in steps} <= known, {k for k, _ in steps} - known
    stages = [args for k, args in steps if k == "FROM"]
    assert len(stages) == 2, "a build stage and a slim runtime stage"
    final = steps[max(i for i, (k, _) in enumerate(steps) if k == "FROM") :]
    users = [args for k, args in final if k == "USER"]
    assert users and not users[-1].startswith(("0", "root")), "the runtime stage runs as a non-root user"
    healthcheck = next(args for k, args in final if k == "HEALTHCHECK")
    assert "/health" in healthcheck
    exec_form(next(args for k, args in final if k == "ENTRYPOINT"))
    for keyword, args in steps:
        if keyword == "COPY" and "--from=" not in args:
            *sources, _ = args.split()
            for source in sources:
                assert (REPO / source).exists(), f"{name}: COPY {source}: no such file in the repository"
    # Only what the image needs is sent to the builder (BuildKit's per-Dockerfile ignore file).
    lines = (DEPLOY / "docker" / f"{name}.dockerignore").read_text().splitlines()
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*", "everything is excluded first, then what the image needs is let in"
    assert "!gateway/" in patterns and "!plugins/" in patterns


def test_gateway_image_installs_no_engine() -> None:
    steps = instructions(DEPLOY / "docker" / "gateway.Dockerfile")
    runs = " ".join(args for k, args in steps if k == "RUN")
    assert "pip install ." in runs and "[engine]" not in runs
    env = env_of(DEPLOY / "docker" / "gateway.Dockerfile")
    assert env["GATEWAY_MANAGED_WORKERS"] == "false"
    assert exec_form(next(args for k, args in steps if k == "ENTRYPOINT")) == ["gateway", "serve"]
    # The config baked in as a default must itself pass the gateway's check.
    copied = next(args.split()[0] for k, args in steps if k == "COPY" and args.endswith(env["GATEWAY_CONFIG_PATH"]))
    resolve_plugins(load_config(REPO / copied), PluginRegistry())


def managed_cpu_spec() -> ManagedWorkerSpec:
    """The root config.yaml's managed worker, listening where a container does."""
    spec = load_config(REPO / "config.yaml").engine.workers[0]
    return spec.model_copy(update={"host": "0.0.0.0", "port": 8000})


def in_image(argv: list[str]) -> list[str]:
    """The managed worker's argv as the worker image runs it: shipped chat templates are copied to
    /models/templates at build time (the package's own path depends on the venv's Python version)."""
    out = list(argv)
    if "--chat-template" in out:
        at = out.index("--chat-template") + 1
        out[at] = "/models/templates/" + Path(out[at]).name
    return out


def test_worker_cpu_image_runs_the_managed_worker_command() -> None:
    path = DEPLOY / "docker" / "worker-cpu.Dockerfile"
    steps = instructions(path)
    argv = exec_form(next(a for k, a in steps if k == "ENTRYPOINT")) + exec_form(
        next(a for k, a in steps if k == "CMD")
    )
    spec = managed_cpu_spec()
    model_dir = Path("/models") / spec.model
    assert argv[1:] == in_image(build_argv(spec, model_dir))[1:]
    runs = " ".join(a for k, a in steps if k == "RUN")
    assert f"gateway model prepare {spec.model} --models-dir /models" in runs
    assert "pip uninstall -y torchvision torchaudio torchcodec" in runs
    assert "download.pytorch.org/whl/cpu" in path.read_text()
    env = env_of(path)
    expected = build_env(spec, model_dir, preload=env["LD_PRELOAD"].split(":"))
    for key, value in expected.items():
        assert env.get(key) == value, f"worker-cpu.Dockerfile ENV {key}: {env.get(key)!r}, launch.py: {value!r}"
    assert len(env["LD_PRELOAD"].split(":")) == 2  # tcmalloc, then Intel OpenMP


def patched_container(overlay: str, patch: str) -> dict[str, Any]:
    doc = yaml.safe_load((DEPLOY / "k8s" / "overlays" / overlay / patch).read_text())
    return dict(doc["spec"]["template"]["spec"]["containers"][0])


def test_kubernetes_cpu_worker_runs_the_managed_worker_command() -> None:
    worker = patched_container("cpu", "worker-cpu.yaml")
    spec = managed_cpu_spec()
    expected = in_image(build_argv(spec, Path("/models") / spec.model))
    assert worker["command"][0] == "python"  # the image's venv interpreter, first on PATH
    assert worker["command"][1:] + worker["args"] == expected[1:]
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["VLLM_CPU_KVCACHE_SPACE"] == build_env(spec, Path("/models"))["VLLM_CPU_KVCACHE_SPACE"]


def test_kubernetes_gpu_worker_uses_the_launch_flags() -> None:
    worker = patched_container("gpu", "worker-gpu.yaml")
    args = worker["args"]
    spec = ManagedWorkerSpec(
        name="gpu",
        model=args[args.index("--model") + 1],
        served_model_name=args[args.index("--served-model-name") + 1],
        host="0.0.0.0",
        port=8000,
        device="gpu",
        dtype="bfloat16",
        max_model_len=8192,
        max_num_seqs=128,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.9,
        speculative=SpeculativeSpec(method="ngram", num_speculative_tokens=4),
        structured_outputs_backend="outlines",
    )
    assert worker["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert args == build_argv(spec, spec.model)[3:]


# -- compose -------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "compose.yaml").read_text()))


def test_compose_parses_and_refers_to_existing_files() -> None:
    services = compose()["services"]
    assert set(services) == {"gateway", "worker-cpu", "redis", "prometheus", "grafana"}
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), f"{name}: no {build['dockerfile']}"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: volume source {source} does not exist"
    gateway = services["gateway"]
    mounted = next(v for v in gateway["volumes"] if v.endswith("/etc/gateway/config.yaml:ro"))
    config = load_config(DEPLOY / mounted.split(":")[0])
    resolve_plugins(config, PluginRegistry())
    assert config.models[0].workers == ["http://worker-cpu:8000"]
    assert gateway["environment"]["GATEWAY_REDIS_URL"].startswith("redis://redis:")
    assert gateway["read_only"] is True and "/tmp" in gateway["tmpfs"]


def test_prometheus_scrapes_the_compose_services() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    # The gateway's admin port: every series (its public /metrics sums models and workers away).
    assert targets == {"gateway:8001", "worker-cpu:8000"}
    environment = compose()["services"]["gateway"]["environment"]
    assert "8001" in environment["GATEWAY_ADMIN_PORT"]
    # The admin port answers a DNS name in Host only when it is listed: the one Prometheus scrapes it by.
    listed = host_names(Settings(admin_hosts=environment.get("GATEWAY_ADMIN_HOSTS", "")).admin_host_names())
    assert host_allowed("gateway:8001", listed)
    pods = yaml.safe_load((DEPLOY / "prometheus" / "kubernetes-pods.yml").read_text())
    labels = {r.get("target_label") for r in pods["scrape_configs"][0]["relabel_configs"]}
    assert {"namespace", "pod"} <= labels, "prometheus-adapter maps series to pods by these labels"


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    services = compose()["services"]
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    source = datasources["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/vllm-gateway.yaml").read_text())
    path = providers["providers"][0]["options"]["path"]
    mounts = dict(reversed(v.split(":")[:2]) for v in services["grafana"]["volumes"] if v.startswith("."))
    dashboards = DEPLOY / mounts[path]
    dashboard = json.loads((dashboards / "vllm-gateway.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}


# -- the slim gateway image needs no engine packages --------------------------------------------

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ImportError(f"{{name}} is not installed in the gateway image")

    sys.meta_path.insert(0, Blocked())
    from gateway.cli import main
    main(["serve"])
    """
)


def test_gateway_serves_without_engine_packages(
    tmp_path: Path, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    """``gateway serve`` as the image runs it (env settings, the compose config with every plugin on),
    in a process where importing torch, vLLM or transformers fails."""
    text = (DEPLOY / "compose" / "gateway.yaml").read_text().replace("http://worker-cpu:8000", upstream_url)
    # Nothing left in Redis: no cache entries, and tenancy's counters under a prefix deleted afterwards.
    text = text.replace("default_ttl_s: 3600", "default_ttl_s: 0")
    tenancy = "      anonymous_tenant: local\n"
    assert tenancy in text
    text = text.replace(tenancy, f"{tenancy}      redis_prefix: {prefix}\n")
    # The fake worker enforces no constraint: skip the capability probe so the request is compiled.
    text = text.replace("  - name: guided_json\n", "  - name: guided_json\n    config: {probe: false}\n")
    parse_config(text)
    (tmp_path / "config.yaml").write_text(text)
    port = free_port()
    env = {
        **os.environ,
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_CONFIG_PATH": str(tmp_path / "config.yaml"),
        "GATEWAY_MANAGED_WORKERS": "false",
        "GATEWAY_CONFIG_WATCH_S": "0",
    }
    process = subprocess.Popen(
        [sys.executable, "-c", BLOCKER.format(blocked=set(ENGINE_PACKAGES))],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0].decode()[-3000:]
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway did not become ready within 60 s"
            time.sleep(0.2)
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
        assert reply.status_code == 200, reply.text
        guided = {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}}  # fmt: skip
        # The constraint is compiled at the gateway (outlines) before the fake worker is called; the
        # fake's answer does not match it, so the request may be refused afterwards, which is fine here.
        httpx.post(url + "/v1/chat/completions", json=guided, timeout=10)
        metrics = httpx.get(url + "/metrics", timeout=2).text
        assert 'gateway_guided_json_constraints_total{outcome="compiled"} 1.0' in metrics
        assert httpx.get(url + "/health", timeout=2).status_code == 200
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0].decode()
    assert "not installed in the gateway image" not in output, output[-3000:]
