"""What tenancy adds to each request: the same gateway with and without auth, limits and budgets.

Starts the benchmark mock worker and three gateways (``gateway serve``, one core each run in turn):
routing only; tenancy with auth off (anonymous tenant, usage counted); tenancy with auth on, a key,
key and tenant RPM/TPM limits and day/month budgets (limits high enough that nothing is refused).
Every request is admitted with one Redis script and charged with another (real Redis at
GATEWAY_REDIS_URL, default 127.0.0.1:6379). Prints one table: requests/s and latency percentiles
per peer and concurrency, the p50 added over "routing only", and the gateway's CPU time per request.

    .venv/bin/python bench/bench_tenancy.py -d 5 -c 1 16
    .venv/bin/python bench/bench_tenancy.py -d 4 --reps 3 --baseline-src /tmp/before   # before vs after
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load
import peers

from plugins.tenancy.keys import hash_key

KEY = "sk-gw-bench-" + uuid.uuid4().hex
PEPPER = "bench-pepper"
LUA = Path(__file__).with_name("wrk_post.lua")
HIGH = 1_000_000_000


def wrk(url: str, connections: int, duration_s: float, headers: list[str]) -> dict[str, Any]:
    cmd = ["taskset", "-c", peers.LOAD_CPU, "wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s"]
    cmd += ["--timeout", "10s", "-s", str(LUA)]
    for header in headers:
        cmd += ["-H", header]
    cmd += [url, "--", peers.GATEWAY_MODEL, "unique", "/v1/chat/completions", uuid.uuid4().hex[:8]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60, check=True).stdout
    return load.parse_wrk(out)


def peer_plugins(prefix: str) -> dict[str, list[dict[str, Any]]]:
    limits = {"requests_per_minute": HIGH, "tokens_per_minute": HIGH, "tokens_per_day": HIGH, "tokens_per_month": HIGH}
    key = {"id": "bench", "tenant": "bench", "hash": hash_key(KEY, PEPPER.encode()), "limits": limits}
    auth_on = {"redis_prefix": prefix, "keys": [key], "tenants": {"bench": limits}}
    auth_off = {"redis_prefix": prefix, "auth": False, "anonymous_tenant": "anon"}
    return {
        "routing only": [{"name": "routing"}],
        "tenancy, auth off": [{"name": "tenancy", "config": auth_off}, {"name": "routing"}],
        "tenancy, auth + limits + budgets": [{"name": "tenancy", "config": auth_on}, {"name": "routing"}],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-d", "--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("-c", "--connections", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--baseline-src", type=Path, help="a copy of gateway/ + plugins/ from before a change: adds '<peer> @base' rows"
    )
    parser.add_argument(
        "--reps", type=int, default=1, help="rounds over every peer, interleaved; the medians are reported"
    )
    args = parser.parse_args()
    os.environ["GATEWAY_TENANCY_PEPPER"] = PEPPER
    prefix = f"bench:tenancy:{uuid.uuid4().hex}"
    headers = [f"Authorization: Bearer {KEY}"]
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        mock = peers.start_mock(tmp, 0.0, 16)
        try:
            runs = [(name, plugins, None) for name, plugins in peer_plugins(prefix).items()]
            if args.baseline_src is not None:
                runs += [(f"{name} @base", plugins, args.baseline_src) for name, plugins, _ in runs[1:]]
            for rep in range(args.reps):  # interleaved: a busy moment of the machine hits every peer alike
                for name, plugins, source in runs:
                    slug = name.replace(" ", "_").replace(",", "").replace("@", "") + f"-{rep}"
                    gateway = peers.start_gateway(tmp, slug, mock.url, plugins, source=source)
                    try:
                        wrk(gateway.url, 8, 1, headers)  # warm-up: pools, script cache
                        assert gateway.proc is not None
                        for c in args.connections:
                            # CPU per request: the steadiest measure on a shared machine (other load
                            # delays the gateway but does not add to the CPU it spends)
                            cpu = peers.cpu_seconds(gateway.proc.pid)
                            result = wrk(gateway.url, c, args.duration, headers)
                            spent = peers.cpu_seconds(gateway.proc.pid) - cpu
                            result["cpu_us"] = spent * 1e6 / max(1, result["requests"])
                            samples.setdefault((name, c), []).append(result)
                    finally:
                        gateway.stop()
        finally:
            mock.stop()
            client = redis.Redis.from_url(os.environ.get("GATEWAY_REDIS_URL", "redis://127.0.0.1:6379/0"))
            stale = list(client.scan_iter(match=f"{prefix}*", count=1000))
            if stale:
                client.delete(*stale)
            client.close()
    rows = [(name, c, _median(runs)) for (name, c), runs in samples.items()]
    base = {c: r["p50_ms"] for n, c, r in rows if n == "routing only"}
    head = f"{'peer':40} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'CPU us/req':>10}"
    print(head + f" {'errors':>6}")
    for name, c, r in rows:
        added = r["p50_ms"] - base[c]
        print(
            f"{name:40} {c:5d} {r['rps']:9.0f} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {added:+8.3f}"
            f" {r['cpu_us']:10.0f} {r['errors']:6d}"
        )


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0])
    for field in ("rps", "p50_ms", "p99_ms", "cpu_us"):
        out[field] = statistics.median(r[field] for r in runs)
    out["errors"] = sum(r["errors"] for r in runs)
    return out


if __name__ == "__main__":
    main()
