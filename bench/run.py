"""The benchmark: the gateway side by side with its peers, in one run, on this machine.

Proxies are pinned to core 0; the mock upstream, the load generators and this runner to core 1.
Peers (each a real process): ``direct`` (the mock itself), ``nginx`` (reverse proxy, keep-alive
upstream, no buffering), ``gateway`` (routing only), ``gateway-full-miss`` and ``gateway-full-hit``
(the default plugin set, with a new prompt per request or the same prompt every time),
``gateway-production`` (tenancy with a key, limits and budgets before the default set, every request a
miss: what deploy/k8s runs) and ``litellm``
(when installed in /tmp/litellm-venv). Every scenario is repeated ``--reps`` times, interleaved (each
repetition goes over every peer before the next begins) and the medians are reported.

Scenarios: wrk at concurrency 1, 16, 64 (req/s, p50, p99) and paced SSE streams at 128 and 512
concurrent streams (stalls, TTFC p50/p99, gap p99). Then memory, on a fresh routing-only gateway: RSS
after warm-up vs after 200,000 more requests, and RSS per 1,000 open streams.

    .venv/bin/python bench/run.py            # everything (about 15 minutes)
    .venv/bin/python bench/run.py --quick    # issue 2's comparison: direct vs gateway, ~2 minutes

Results: a table on stdout, ``bench/results/<stamp>.json`` and ``bench/results/<stamp>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load
import peers
import report

ALL_PEERS = [
    "direct",
    "nginx",
    "python-hop",
    "gateway",
    "gateway-full-miss",
    "gateway-full-hit",
    "gateway-production",
    "litellm",
]
#: The production set (deploy/k8s): tenancy with a key (limits and budgets too high to refuse) before the
#: full set, each request a cache miss. The key and pepper are this run's own.
PRODUCTION_KEY = "sk-gw-bench-" + os.urandom(12).hex()
PRODUCTION_PEPPER = "bench-production-pepper"
_HIGH = 1_000_000_000
#: The default plugin set in the order DESIGN.md gives; plugins not installed yet are skipped.
DEFAULT_PLUGINS = ["safety", "cache", "guided_json", "routing"]
CACHE_PREFIX = "gwbench"
ADMISSION_IN_FLIGHT = 100_000
CACHE_NAMESPACE = f"run{os.getpid()}"
TENANCY_PREFIX = f"{CACHE_PREFIX}:tenancy:run{os.getpid()}"  # deleted with the cache entries after the run


def delete_cache_entries(redis_url: str) -> int:
    """Remove what the cache and tenancy plugins stored during the run (their keys carry the bench's prefix)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=f"{CACHE_PREFIX}*", count=1000))
        for i in range(0, len(keys), 1000):
            client.delete(*keys[i : i + 1000])
        return len(keys)
    except redis.RedisError:
        return 0
    finally:
        client.close()


def resolve_plugins(names: list[str], overrides: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Config entries for the plugins that are installed and accept their config; and what was skipped.

    A plugin's config comes from ``--plugin-config``, else from the root config.yaml, else ``{}``.
    """
    from gateway.pipeline.registry import PluginRegistry

    product = yaml.safe_load((peers.ROOT / "config.yaml").read_text()) or {}
    from_product = {p["name"]: p for p in product.get("plugins") or [] if p.get("enabled", True)}
    registry = PluginRegistry()
    entries: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name in names:
        entry = {k: v for k, v in from_product.get(name, {"name": name}).items() if k != "enabled"}
        if name in overrides:
            entry["config"] = overrides[name]
        if name == "routing" and name not in overrides:
            # The product's admission limits describe the CPU engine's capacity (64 in flight), not the
            # mock's: keep the gate (its cost is part of the hop) but high enough never to queue or refuse.
            entry = copy.deepcopy(entry)
            for model in ((entry.get("config") or {}).get("models") or {}).values():
                if model.get("admission"):
                    model["admission"]["max_in_flight"] = ADMISSION_IN_FLIGHT
        if name == "cache":  # the bench's entries live under their own prefix and are deleted after
            entry["config"] = {**(entry.get("config") or {}), "key_prefix": CACHE_PREFIX, "namespace": CACHE_NAMESPACE}
        try:
            cls = registry.get(name)
            cls.Config.model_validate(entry.get("config") or {})
        except Exception as exc:
            skipped.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        entries.append(entry)
    if not any(e["name"] == "routing" for e in entries):
        entries.append({"name": "routing"})
    return entries, skipped


def measure(peer: peers.Peer, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    """One scenario on one peer, with the proxy's own CPU per request (wrk) or per stream: the figure that
    other load on the machine (or a hypervisor taking the CPU away) disturbs least."""
    pid = peer.proc.pid if peer.proc is not None else None
    before = peers.cpu_split(pid) if pid else (0.0, 0.0)
    if scenario.startswith("c"):
        result = load.run_wrk(
            peer.url, int(scenario[1:]), args.duration, model=peer.model, mode=peer.mode, token=peer.token
        )
        if pid and result["requests"]:
            user, system = (after - at for after, at in zip(peers.cpu_split(pid), before, strict=True))
            result["cpu_us_per_req"] = (user + system) / result["requests"] * 1e6
            result["sys_us_per_req"] = system / result["requests"] * 1e6
        return result
    cmd = [sys.executable, str(Path(load.__file__)), "streams", "--url", peer.url, "--model", peer.model]
    cmd += ["-n", scenario[1:], "-d", str(args.duration), "--interval-ms", str(args.interval_ms)]
    cmd += ["--tokens", str(args.tokens), "--token", peer.token] + (["--fixed"] if peer.mode == "fixed" else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=args.duration + 120).stdout
    result = dict(orjson.loads(out.strip().splitlines()[-1]))
    if pid and result.get("streams"):
        result["cpu_us_per_stream"] = (peers.cpu_seconds(pid) - sum(before)) / result["streams"] * 1e6
    return result


def warm_up(peer: peers.Peer, args: argparse.Namespace) -> None:
    """Open pools, fill the cache for the hit peer, let the first-request costs pass."""
    load.run_wrk(peer.url, 16, 1, model=peer.model, mode=peer.mode, token=peer.token)
    if any(s.startswith("s") for s in args.scenarios):
        cmd = [sys.executable, str(Path(load.__file__)), "streams", "--url", peer.url, "--model", peer.model]
        cmd += ["-n", "4", "-d", "1", "--tokens", "4", "--token", peer.token] + (
            ["--fixed"] if peer.mode == "fixed" else []
        )
        subprocess.run(cmd, capture_output=True, check=True, timeout=60)


def requests_until(url: str, total: int, connections: int = 64) -> int:
    """Send at least ``total`` requests (wrk in 2 s slices); returns how many were sent."""
    sent = 0
    while sent < total:
        sent += load.run_wrk(url, connections, 2)["requests"]
    return sent


def measure_memory(tmp: Path, mock: peers.Peer, args: argparse.Namespace) -> dict[str, Any]:
    """RSS of a fresh routing-only gateway: growth over N requests after warm-up, and per 1,000 streams."""
    # Held streams need a slow worker (a chunk every 500 ms), so the open streams sit mostly idle.
    slow = peers.start_mock(tmp, 500.0, 400, name="mock-slow")
    gw = peers.start_gateway(tmp, "gateway-memory", mock.url, [{"name": "routing"}])
    # More streams than the default 512 connections per worker need a larger pool (a config knob).
    pool = {"max_connections_per_worker": max(512, args.memory_streams + 64)}
    stream_gw = peers.start_gateway(tmp, "gateway-memory-streams", slow.url, [{"name": "routing"}], upstream=pool)
    assert gw.proc is not None and stream_gw.proc is not None
    pid = gw.proc.pid
    try:
        started_kib = peers.rss_kib(pid)
        requests_until(gw.url, args.memory_warmup)
        time.sleep(1)
        warm_kib = peers.rss_kib(pid)
        sent = requests_until(gw.url, args.memory_requests)
        time.sleep(1)
        after_kib = peers.rss_kib(pid)
        load.run_wrk(stream_gw.url, 16, 1, model=stream_gw.model)  # warm the stream gateway up
        time.sleep(1)
        idle_kib = peers.rss_kib(stream_gw.proc.pid)
        cmd = [sys.executable, str(Path(load.__file__)), "hold", "--url", stream_gw.url]
        cmd += ["-n", str(args.memory_streams), "--model", stream_gw.model]
        holder = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdin is not None
        line = holder.stdout.readline()
        opened = orjson.loads(line)["open"] if line.startswith("{") else 0
        time.sleep(1)
        streams_kib = peers.rss_kib(stream_gw.proc.pid)
        holder.stdin.close()
        holder.wait(timeout=60)
    finally:
        gw.stop()
        stream_gw.stop()
        slow.stop()
    return {
        "rss_at_start_mib": started_kib / 1024,
        "rss_after_warmup_mib": warm_kib / 1024,
        f"rss_after_{sent}_requests_mib": after_kib / 1024,
        "rss_growth_pct": 100 * (after_kib - warm_kib) / warm_kib,
        "open_streams": opened,
        "rss_streams_gateway_idle_mib": idle_kib / 1024,
        f"rss_with_{opened}_streams_mib": streams_kib / 1024,
        "rss_per_1000_streams_mib": (streams_kib - idle_kib) / 1024 * 1000 / opened if opened else None,
    }


def production_plugins(full: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tenancy (auth on, one key, requests and tokens per minute, daily and monthly budgets) first, then
    ``full``, as deploy/k8s runs them."""
    from plugins.tenancy.keys import hash_key

    limits = {
        "requests_per_minute": _HIGH,
        "tokens_per_minute": _HIGH,
        "tokens_per_day": _HIGH,
        "tokens_per_month": _HIGH,
    }
    key = {
        "id": "bench",
        "tenant": "bench",
        "hash": hash_key(PRODUCTION_KEY, PRODUCTION_PEPPER.encode()),
        "limits": limits,
    }
    section = {"redis_prefix": TENANCY_PREFIX, "keys": [key], "tenants": {"bench": limits}}
    return [{"name": "tenancy", "config": section}, *(e for e in full if e["name"] != "tenancy")]


def start_peers(
    tmp: Path, mock: peers.Peer, args: argparse.Namespace, stack: contextlib.ExitStack
) -> tuple[list[peers.Peer], list[str]]:
    """The peers ``args`` names, each stopped by ``stack`` from the moment it started: a failure while
    the others start or warm up must not leave gateway processes running on the machine."""
    started: list[peers.Peer] = []
    notes: list[str] = []
    full, skipped = resolve_plugins(args.plugins, args.plugin_config)
    full_names = ",".join(e["name"] for e in full)
    if skipped and any(p.startswith(("gateway-full", "gateway-production")) for p in args.peers):
        notes.append("plugins skipped (not installed or config refused): " + "; ".join(skipped))
    for name in args.peers:
        peer: peers.Peer | None
        # "<gateway peer>@base": the same peer running the code copied to --baseline-src before a change.
        base_name, at, _ = name.partition("@")
        source = args.baseline_src if at else None
        if at and (source is None or not base_name.startswith("gateway")):
            raise SystemExit(f"{name}: an @base peer is a gateway peer and needs --baseline-src")
        code = f", code from {source}" if source is not None else ""
        if name == "direct":
            peer = mock
        elif name == "nginx":
            peer = peers.start_nginx(tmp, mock.url)
        elif name == "python-hop":
            peer = peers.start_minimal_hop(tmp, mock.url)
        elif base_name == "gateway":
            peer = peers.start_gateway(tmp, name, mock.url, [{"name": "routing"}], note="routing" + code, source=source)
        elif base_name == "gateway-full-miss":
            note = full_names + code
            peer = peers.start_gateway(tmp, name, mock.url, full, mode="unique", note=note, source=source)
        elif base_name == "gateway-full-hit":
            note = full_names + code
            peer = peers.start_gateway(tmp, name, mock.url, full, mode="fixed", note=note, source=source)
        elif base_name == "gateway-production":
            note = "tenancy (key, limits, budgets)," + full_names + code
            env = {"GATEWAY_TENANCY_PEPPER": PRODUCTION_PEPPER}
            plugins = production_plugins(full)
            peer = peers.start_gateway(tmp, name, mock.url, plugins, mode="unique", note=note, source=source, env=env)
            peer.token = PRODUCTION_KEY
        elif name == "litellm":
            peer = peers.start_litellm(tmp, mock.url)
        else:
            raise SystemExit(f"unknown peer {name}; known: {', '.join(ALL_PEERS)}")
        if peer is None:
            notes.append(f"{name}: not available on this machine, skipped")
            continue
        if peer is not mock:
            stack.callback(peer.stop)
        started.append(peer)
    return started, notes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="direct vs gateway, short runs, small memory counts")
    parser.add_argument("--peers", help=f"comma list (default: all of {','.join(ALL_PEERS)})")
    parser.add_argument("--plugins", default=",".join(DEFAULT_PLUGINS), help="the 'full' plugin set, in order")
    parser.add_argument(
        "--plugin-config", action="append", default=[], metavar="NAME=JSON", help="config for one plugin"
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="a copy of the tree (gateway/, plugins/) taken before a change: adds '<peer>@base' for each gateway peer",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--duration", type=float, help="seconds per measurement (default 5, quick 3)")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--streams", default="128,512", help="concurrent stream counts")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="the mock's pacing between chunks")
    parser.add_argument("--tokens", type=int, default=32, help="content chunks per stream")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-requests", type=int, help="default 200,000 (quick 20,000)")
    parser.add_argument("--memory-streams", type=int, help="default 1,000 (quick 250)")
    parser.add_argument("--out", type=Path, default=peers.ROOT / "bench" / "results")
    args = parser.parse_args()
    args.peers = (args.peers or ("direct,gateway" if args.quick else ",".join(ALL_PEERS))).split(",")
    if args.baseline_src is not None:
        # Each gateway peer gets its "@base" twin, once: named already in --peers, it is not added again.
        twins = [f"{p}@base" for p in args.peers if p.startswith("gateway") and "@" not in p]
        args.peers += [twin for twin in twins if twin not in args.peers]
    args.plugins = [p for p in args.plugins.split(",") if p]
    args.plugin_config = {k: orjson.loads(v) for k, v in (item.split("=", 1) for item in args.plugin_config)}
    args.duration = args.duration or (3.0 if args.quick else 5.0)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.stream_counts = [int(n) for n in args.streams.split(",") if n] if not args.quick else [128]
    args.scenarios = [f"c{c}" for c in args.concurrency] + [f"s{n}" for n in args.stream_counts]
    args.memory_requests = args.memory_requests or (20_000 if args.quick else 200_000)
    args.memory_warmup = max(args.memory_requests // 10, 5_000)
    args.memory_streams = args.memory_streams or (250 if args.quick else 1_000)
    return args


def counter_totals(families: Iterable[Metric], *names: str) -> dict[str, float]:
    """Each named counter family's total over its label sets (0 for a family not there)."""
    totals = dict.fromkeys(names, 0.0)
    for family in families:
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def cache_errors(peer: peers.Peer) -> float:
    """The Redis failures a gateway peer's cache counted (none without a cache). Each sent a request past
    the cache, which then cost less than a miss: the peer's figures no longer measure its plugin set."""
    with urllib.request.urlopen(f"{peer.url}/metrics", timeout=5) as resp:
        families = text_string_to_metric_families(resp.read().decode())
        return counter_totals(families, "gateway_cache_errors")["gateway_cache_errors"]


def main() -> None:
    args = parse_args()
    if shutil.which("wrk") is None:  # every peer is warmed up with it, before any scenario
        raise SystemExit("wrk is not installed (apt-get install -y wrk): it drives the request scenarios")
    os.sched_setaffinity(0, {int(peers.LOAD_CPU)})  # the runner and its load generators share core 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        mock = peers.start_mock(tmp, args.interval_ms, args.tokens)
        stack.callback(mock.stop)
        running, notes = start_peers(tmp, mock, args, stack)
        for peer in running:
            warm_up(peer, args)
        for rep in range(args.reps):
            for scenario in args.scenarios:
                for peer in running:
                    result = measure(peer, scenario, args)
                    results.setdefault(peer.name, {}).setdefault(scenario, []).append(result)
                    print(f"rep {rep + 1} {scenario:>5} {peer.name:<18} {orjson.dumps(result).decode()}", flush=True)
        for peer in running:
            failed = cache_errors(peer) if peer.name.startswith(("gateway-full", "gateway-production")) else 0
            if failed:
                notes.append(f"{peer.name}: {failed:.0f} of the cache's Redis calls failed: requests went past it")
        memory = {} if args.no_memory else measure_memory(tmp, mock, args)
    if any(p.startswith(("gateway-full", "gateway-production")) for p in args.peers):
        deleted = delete_cache_entries(os.environ.get("GATEWAY_REDIS_URL", "redis://127.0.0.1:6379/0"))
        notes.append(f"deleted {deleted} cache and tenancy entries the run stored in Redis")
    medians = {peer: {s: report.median_of(runs) for s, runs in scen.items()} for peer, scen in results.items()}
    print()
    print(report.main_table(medians, args.concurrency, args.stream_counts))
    if "direct" in medians:
        print()
        print(report.added_latency_table(medians, "direct", [c for c in (1, 64) if c in args.concurrency]))
    if memory:
        print()
        print(report.memory_table(memory))
    for note in notes:
        print(f"note: {note}")
    args.out.mkdir(parents=True, exist_ok=True)
    png = report.plot(medians, args.concurrency, args.out / f"{stamp}.png")
    record = {
        "stamp": stamp,
        "command": " ".join(sys.argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "peers": {p.name: p.note for p in running},
        "notes": notes,
        "medians": medians,
        "runs": results,
        "memory": memory,
    }
    (args.out / f"{stamp}.json").write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2, default=str))
    print(f"\nsaved {args.out / f'{stamp}.json'}" + (f" and {png}" if png else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
