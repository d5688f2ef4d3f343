"""The hand-written protocol clients against the libraries they replace, in one run, side by side.

Each pair is the same gateway (this tree's code, ``gateway serve``) under the same load against the
mock worker, differing only in one process setting:

- ``upstream``: routing only, ``GATEWAY_UPSTREAM_CLIENT=http1`` (asyncio + httptools) vs ``aiohttp``
  (a tuned ``aiohttp.ClientSession``: no tracing, no cookie jar, keep-alive pool);
- ``cache-hit`` / ``cache-miss``: the cache and routing plugins, the same prompt every time (one Lua
  lookup per request) or a new one (a lookup and a store), ``GATEWAY_REDIS_CLIENT=autopipe`` (hiredis
  auto-pipelining) vs ``redis-py`` (redis-py's pipeline on a dedicated connection).

Repetitions are interleaved (every peer runs each scenario before the next repetition) and the table
shows medians: req/s, p50/p99 latency (ms, wrk's) and the gateway's own CPU µs per request, for each
concurrency, and the library's req/s as a share of the hand-written client's.

    .venv/bin/python bench/bench_clients.py                      # all pairs, c=1,16,64, 3 reps of 5 s
    .venv/bin/python bench/bench_clients.py --pairs upstream --reps 5 --duration 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers
import report
import run

#: pair -> (plugins, wrk body mode, setting, own value, library value)
PAIRS: dict[str, tuple[list[str], str, str, str, str]] = {
    "upstream": (["routing"], "fixed", "GATEWAY_UPSTREAM_CLIENT", "http1", "aiohttp"),
    "cache-hit": (["cache", "routing"], "fixed", "GATEWAY_REDIS_CLIENT", "autopipe", "redis-py"),
    "cache-miss": (["cache", "routing"], "unique", "GATEWAY_REDIS_CLIENT", "autopipe", "redis-py"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma list of {', '.join(PAIRS)}")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--out", type=Path, default=peers.ROOT / "bench" / "results")
    args = parser.parse_args()
    args.pairs = [p for p in args.pairs.split(",") if p]
    unknown = set(args.pairs) - set(PAIRS)
    if unknown:
        raise SystemExit(f"unknown pairs {sorted(unknown)}; known: {', '.join(PAIRS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.scenarios = [f"c{c}" for c in args.concurrency]
    return args


def table(medians: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    rows = [["pair", "client"]]
    for c in args.concurrency:
        rows[0] += [f"req/s c={c}", f"p50 c={c}", f"p99 c={c}", f"CPU µs/req c={c}", f"lib/own req/s c={c}"]
    fmt = report._fmt
    for pair in args.pairs:
        *_, own, lib = PAIRS[pair]
        for client in (own, lib):
            row = [pair, client]
            for c in args.concurrency:
                m = medians[f"{pair}:{client}"][f"c{c}"]
                base = medians[f"{pair}:{own}"][f"c{c}"]
                share = f"{m['rps'] / base['rps']:.1%}" if client == lib and base.get("rps") else ""
                row += [fmt(m.get("rps"), 0), fmt(m.get("p50_ms"), 3), fmt(m.get("p99_ms"))]
                row += [fmt(m.get("cpu_us_per_req"), 1), share]
            rows.append(row)
    return report._markdown(rows)


def main() -> None:
    args = parse_args()
    os.sched_setaffinity(0, {int(peers.LOAD_CPU)})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="gateway-bench-clients-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        mock = peers.start_mock(tmp, 20.0, 32)
        stack.callback(mock.stop)
        running: list[peers.Peer] = []
        for pair in args.pairs:
            names, mode, setting, own, lib = PAIRS[pair]
            plugins, skipped = run.resolve_plugins(names, {})
            if skipped:
                raise SystemExit(f"{pair}: plugins not available: {skipped}")
            for client in (own, lib):
                name = f"{pair}:{client}"
                peer = peers.start_gateway(
                    tmp,
                    name.replace(":", "-"),
                    mock.url,
                    plugins,
                    mode=mode,
                    note=f"{'+'.join(names)}, {setting}={client}",
                    source=peers.ROOT,  # this tree's code, not whatever the venv's editable install points at
                    env={setting: client},
                )
                peer.name = name
                stack.callback(peer.stop)
                running.append(peer)
        for peer in running:
            run.warm_up(peer, args)
        for rep in range(args.reps):
            for scenario in args.scenarios:
                for peer in running:
                    result = run.measure(peer, scenario, args)
                    results.setdefault(peer.name, {}).setdefault(scenario, []).append(result)
                    print(f"rep {rep + 1} {scenario:>4} {peer.name:<20} {orjson.dumps(result).decode()}", flush=True)
    if any(p.startswith("cache") for p in args.pairs):
        deleted = run.delete_cache_entries(os.environ.get("GATEWAY_REDIS_URL", "redis://127.0.0.1:6379/0"))
        print(f"deleted {deleted} cache entries the run stored in Redis")
    medians = {peer: {s: report.median_of(runs) for s, runs in scen.items()} for peer, scen in results.items()}
    print()
    print(table(medians, args))
    for peer_name, scenarios in results.items():
        errors = sum(r.get("errors", 0) for runs in scenarios.values() for r in runs)
        if errors:
            print(f"warning: {peer_name}: {errors} errors or non-2xx answers")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"stamp": stamp, "command": " ".join(sys.argv), "medians": medians, "runs": results}
    (args.out / f"clients-{stamp}.json").write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2, default=str))
    print(f"\nsaved {args.out / f'clients-{stamp}.json'}")


if __name__ == "__main__":
    main()
