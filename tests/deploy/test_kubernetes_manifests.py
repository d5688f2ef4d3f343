"""deploy/k8s: every manifest validates against the Kubernetes schemas (kubernetes-validate, strict), the
overlays render with kustomize (``kubectl kustomize``) into valid objects, the ConfigMaps' config.yaml
passes the gateway's own check, and the pieces agree with each other (selectors, ports, probes, the
DNS name of the workers, shutdown timings, pod security). Nothing here needs a cluster or a network.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.pipeline.config import parse_config
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.validate import resolve_plugins
from plugins.routing.config import RoutingConfig
from plugins.tenancy.config import TenancyConfig

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes minor still commonly run, and the newest the validator ships schemas for.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# Custom resources (Prometheus Operator, KEDA): no schema in kubernetes-validate; checked by hand below.
CUSTOM_KINDS = {"PodMonitor", "ScaledObject"}
UVICORN_GRACEFUL_S = 30  # gateway serve: uvicorn.run(timeout_graceful_shutdown=30)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(directory: Path) -> dict[str, Any]:
    return dict(yaml.safe_load((directory / "kustomization.yaml").read_text()))


def manifest_files() -> list[Path]:
    """Complete objects: the files base/ and the components list as resources, and the Secret example."""
    files = [K8S / "secrets" / "secret.example.yaml"]
    for directory in (K8S / "base", K8S / "components" / "monitoring", K8S / "components" / "keda"):
        files += [directory / name for name in kustomization(directory)["resources"]]
    return files


def validate(obj: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {where}: {exc.message}")


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_validates(path: Path) -> None:
    docs = load_docs(path)
    assert docs
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        validate(doc)


def test_validation_is_strict() -> None:
    """An unknown field (a typo) must fail, or the checks above prove nothing."""
    deployment = load_docs(K8S / "base" / "gateway-deployment.yaml")[0]
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


# -- overlays -------------------------------------------------------------------------------------


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (kustomize) is not installed; the base files and patches are checked on their own")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}"
    return matches[0]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_rendered_overlay_validates(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objs = rendered
    kinds = {o["kind"] for o in objs}
    assert {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    } <= kinds
    assert kinds >= CUSTOM_KINDS
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "vllm-gateway", f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] not in CUSTOM_KINDS:
            validate(obj)


def test_rendered_config_passes_the_gateway_check(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, objs = rendered
    text = find(objs, "ConfigMap", "vllm-gateway-config")["data"]["config.yaml"]
    config = parse_config(text, source=f"overlays/{overlay} ConfigMap")
    resolved = resolve_plugins(config, PluginRegistry())
    assert [p.entry.name for p in resolved] == ["tenancy", "safety", "cache", "guided_json", "routing"]
    by_name = {p.entry.name: p.config for p in resolved}
    tenancy = by_name["tenancy"]
    assert isinstance(tenancy, TenancyConfig) and tenancy.auth is True
    routing = by_name["routing"]
    assert isinstance(routing, RoutingConfig)
    assert routing.default.policy == "prefix_affinity"
    assert routing.default.admission.max_in_flight is not None
    # The workers are found through the headless Service, re-resolved by the routing plugin.
    service = find(objs, "Service", "vllm-worker")
    assert service["spec"]["clusterIP"] == "None"
    port = service["spec"]["ports"][0]["port"]
    assert config.models[0].workers == [f"dns://vllm-worker.vllm-gateway.svc.cluster.local:{port}"]
    # The model the gateway offers is the one the worker serves.
    args = container(find(objs, "Deployment", "vllm-worker"), "vllm")["args"]
    assert args[args.index("--served-model-name") + 1] == config.models[0].upstream_name


def test_gpu_overlay_asks_for_gpus() -> None:
    objs = render("gpu")
    worker = container(find(objs, "Deployment", "vllm-worker"), "vllm")
    assert worker["image"].startswith("vllm/vllm-openai:")
    gpus = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    args = worker["args"]
    assert int(args[args.index("--tensor-parallel-size") + 1]) == gpus
    assert "--speculative-config" in args and "--gpu-memory-utilization" in args
    # The patch merged into the base container rather than replacing it: probes and mounts survive.
    assert worker["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {m["name"] for m in worker["volumeMounts"]} >= {"tmp", "home", "dshm", "models-cache"}
    scaled = find(objs, "ScaledObject", "vllm-worker")
    assert all('"qwen2.5-7b-instruct"' in t["metadata"]["query"] for t in scaled["spec"]["triggers"])


def test_patches_target_base_objects() -> None:
    """Without kustomize, this is what keeps a patch from silently missing its target."""
    base = [doc for name in kustomization(K8S / "base")["resources"] for doc in load_docs(K8S / "base" / name)]
    for overlay in OVERLAYS:
        for patch in kustomization(K8S / "overlays" / overlay)["patches"]:
            if "path" not in patch:
                continue
            for doc in load_docs(K8S / "overlays" / overlay / patch["path"]):
                target = find(base, doc["kind"], doc["metadata"]["name"])
                base_names = {c["name"] for c in target["spec"]["template"]["spec"]["containers"]}
                patched = {c["name"] for c in doc["spec"]["template"]["spec"]["containers"]}
                assert patched <= base_names, f"{overlay}/{patch['path']} would add containers {patched - base_names}"


# -- the pieces agree -----------------------------------------------------------------------------


def base_objects() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in load_docs(path)]


def test_gateway_rolls_without_dropping_requests() -> None:
    objs = base_objects()
    deployment = find(objs, "Deployment", "vllm-gateway")
    spec = deployment["spec"]["template"]["spec"]
    gateway = container(deployment, "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pre_stop = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > int(pre_stop[1]) + UVICORN_GRACEFUL_S
    assert gateway["resources"]["requests"]["cpu"], "the HPA's CPU target is a share of the request"
    pdb = find(objs, "PodDisruptionBudget", "vllm-gateway")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    spread = spec["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}


def test_config_is_mounted_as_a_watched_directory() -> None:
    deployment = find(base_objects(), "Deployment", "vllm-gateway")
    gateway = container(deployment, "gateway")
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    mount = next(m for m in gateway["volumeMounts"] if m["name"] == "config")
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    assert Path(env["GATEWAY_CONFIG_PATH"]).parent == Path(mount["mountPath"])
    assert float(env["GATEWAY_CONFIG_WATCH_S"]) > 0
    assert env["GATEWAY_MANAGED_WORKERS"] == "false"
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    generator = kustomization(K8S / "base")["configMapGenerator"][0]
    assert volume["configMap"]["name"] == generator["name"]
    assert generator["options"]["disableNameSuffixHash"] is True, "a hashed name turns edits into restarts"
    secret = load_docs(K8S / "secrets" / "secret.example.yaml")[0]
    assert gateway["envFrom"][0]["secretRef"]["name"] == secret["metadata"]["name"]
    assert {"GATEWAY_ADMIN_TOKEN", "GATEWAY_TENANCY_PEPPER"} <= set(secret["stringData"])


def test_every_pod_meets_the_restricted_pod_security_standard() -> None:
    namespace = find(base_objects(), "Namespace", "vllm-gateway")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    deployments = [o for o in base_objects() if o["kind"] == "Deployment"]
    if shutil.which("kubectl"):
        deployments += [o for overlay in OVERLAYS for o in render(overlay) if o["kind"] == "Deployment"]
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod.get("automountServiceAccountToken") is False
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_services_and_monitors_select_the_right_pods() -> None:
    objs = base_objects()
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objs if o["kind"] == "Deployment"}
    for service in (o for o in objs if o["kind"] == "Service"):
        (template,) = [t for t in pods.values() if labels_match(service["spec"]["selector"], t["metadata"]["labels"])]
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    gateway = pods["vllm-gateway"]
    monitor = find(objs, "PodMonitor", "vllm-gateway")
    assert labels_match(monitor["spec"]["selector"]["matchLabels"], gateway["metadata"]["labels"])
    # The admin port: the public /metrics sums the model and worker labels the dashboards use away.
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["admin"]
    admin_port = next(p for c in gateway["spec"]["containers"] for p in c["ports"] if p["name"] == "admin")
    assert gateway["metadata"]["annotations"]["prometheus.io/port"] == str(admin_port["containerPort"])
    gateway_service = find(objs, "Service", "vllm-gateway")
    assert "admin" not in {p["targetPort"] for p in gateway_service["spec"]["ports"]}  # never exposed
    pod_monitor = find(objs, "PodMonitor", "vllm-worker")
    worker = pods["vllm-worker"]
    assert labels_match(pod_monitor["spec"]["selector"]["matchLabels"], worker["metadata"]["labels"])
    for name in ("vllm-gateway", "vllm-worker"):
        annotations = pods[name]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"


def test_autoscalers_target_existing_deployments_with_sane_targets() -> None:
    objs = base_objects()
    hpa = find(objs, "HorizontalPodAutoscaler", "vllm-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == find(objs, "Deployment", "vllm-gateway")["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 2, "one replica left alone cannot roll without a gap"
    pdb = find(objs, "PodDisruptionBudget", "vllm-gateway")
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]
    pods_metric = next(m for m in hpa["spec"]["metrics"] if m["type"] == "Pods")
    target = float(pods_metric["pods"]["target"]["averageValue"])
    # Scale out before one replica's admission limit makes it queue requests.
    config = parse_config((K8S / "base" / "config.yaml").read_text())
    routing = RoutingConfig.model_validate(next(p.config for p in config.plugins if p.name == "routing"))
    assert routing.default.admission.max_in_flight is not None
    assert target < routing.default.admission.max_in_flight
    scaled = find(objs, "ScaledObject", "vllm-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == find(objs, "Deployment", "vllm-worker")["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        assert float(trigger["metadata"]["threshold"]) > 0


def _redis_policy(args: list[str]) -> tuple[str | None, str | None]:
    flags = dict(zip(args[::2], args[1::2], strict=False))
    return flags.get("--maxmemory"), flags.get("--maxmemory-policy")


def test_redis_is_bounded_and_never_evicts_silently() -> None:
    """Tenancy budgets, rate windows and stored responses have TTLs: any eviction policy could drop them
    without a word. A full Redis must refuse writes instead (tenancy then fails closed, loudly)."""
    redis = find(base_objects(), "Deployment", "redis")["spec"]["template"]["spec"]["containers"][0]
    memory, policy = _redis_policy(redis["args"])
    assert memory and policy == "noeviction", redis["args"]
    limit = redis["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(memory.removesuffix("mb")) < float(limit.removesuffix("Gi")) * 1024
    compose = yaml.safe_load((K8S.parent / "compose.yaml").read_text())
    command = compose["services"]["redis"]["command"]
    memory, policy = _redis_policy(command[1:])
    assert memory and policy == "noeviction", command
