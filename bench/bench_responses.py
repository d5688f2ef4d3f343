"""What the Responses API and Anthropic's Messages API cost over chat completions, through the same gateway,
on the mock worker.

Starts the benchmark mock worker (``bench/mock_upstream.py``, instant answers) and one gateway
(``gateway serve``, routing only by default, pinned to its own core) and measures with wrk, interleaved
``--reps`` times (medians reported), on the same gateway process:

- ``chat``: ``POST /v1/chat/completions`` (a new prompt per request);
- ``responses, store=false``: ``POST /v1/responses``, translated to the same chat request and back;
- ``responses, store=true``: the same, also writing the response and its input to Redis (the default);
- ``messages``: ``POST /v1/messages`` (Anthropic's shape), translated to the same chat request and back.

Prints requests/s and p50/p99 per concurrency, the p50 added over ``chat`` (at c=1 that is the
per-request overhead of the translation, and of the Redis write with store=true), and the gateway
process's CPU time per request (user + system, from /proc): the number that moves least when other
work shares the machine.

    .venv/bin/python bench/bench_responses.py -d 5 -c 1 16 --reps 3
    .venv/bin/python bench/bench_responses.py -d 5 -c 1 16 --reps 3 --cases chat messages
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

CHAT_LUA = Path(__file__).with_name("wrk_post.lua")
RESPONSES_LUA = Path(__file__).with_name("wrk_responses.lua")
MESSAGES_LUA = Path(__file__).with_name("wrk_messages.lua")
CASES = ("chat", "responses, store=false", "responses, store=true", "messages")


def wrk(url: str, case: str, connections: int, duration_s: float) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    cmd = ["taskset", "-c", peers.LOAD_CPU, "wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--timeout", "10s"]
    if case == "chat":
        cmd += ["-s", str(CHAT_LUA), url, "--", peers.GATEWAY_MODEL, "unique", "/v1/chat/completions", tag]
    elif case == "messages":
        cmd += ["-s", str(MESSAGES_LUA), url, "--", peers.GATEWAY_MODEL, tag]
    else:
        store = "true" if case.endswith("store=true") else "false"
        cmd += ["-s", str(RESPONSES_LUA), url, "--", peers.GATEWAY_MODEL, store, tag]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60, check=True).stdout
    return load.parse_wrk(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-d", "--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("-c", "--connections", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians are reported)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="what to measure")
    parser.add_argument(
        "--plugins", choices=["routing", "default"], default="routing", help="routing only, or config.yaml's set"
    )
    args = parser.parse_args()
    if "chat" not in args.cases:  # the baseline every other case is compared with
        args.cases.insert(0, "chat")
    prefix = f"bench:responses:{uuid.uuid4().hex}"
    plugins: list[dict[str, Any]] = [{"name": "routing"}]
    if args.plugins == "default":
        plugins = [
            {"name": "safety", "config": {"rules": [{"id": "secrets", "kind": "secrets", "action": "redact"}]}},
            {"name": "cache", "config": {"namespace": prefix.replace(":", "-")}},
            {"name": "guided_json", "config": {"probe": False}},
            {"name": "routing"},
        ]
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        mock = peers.start_mock(tmp, 0.0, 16)
        try:
            gateway = peers.start_gateway(
                tmp, "gateway", mock.url, plugins, extra={"responses": {"redis_prefix": prefix, "ttl_s": 600}}
            )
            try:
                for case in args.cases:
                    wrk(gateway.url, case, 8, 1)  # warm-up: pools, code paths
                assert gateway.proc is not None
                pid = gateway.proc.pid
                for _ in range(args.reps):
                    for c in args.connections:
                        for case in args.cases:
                            cpu_before = peers.cpu_seconds(pid)
                            result = wrk(gateway.url, case, c, args.duration)
                            cpu = peers.cpu_seconds(pid) - cpu_before
                            result["cpu_us"] = cpu * 1e6 / result["requests"] if result["requests"] else 0.0
                            results.setdefault((case, c), []).append(result)
            finally:
                gateway.stop()
        finally:
            mock.stop()
            client = redis.Redis.from_url(os.environ.get("GATEWAY_REDIS_URL", "redis://127.0.0.1:6379/0"))
            stale = list(client.scan_iter(match=f"{prefix}*", count=1000))
            for start in range(0, len(stale), 1000):
                client.delete(*stale[start : start + 1000])
            client.close()

    def median(case: str, c: int, name: str) -> float:
        return statistics.median(r[name] for r in results[(case, c)])

    print(f"plugins: {args.plugins}; {args.reps} interleaved reps of {args.duration:g} s, medians")
    print(
        f"{'case':26} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8}"
        f" {'CPU us/req':>10} {'errors':>6}"
    )
    for c in args.connections:
        base = median("chat", c, "p50_ms")
        for case in args.cases:
            p50 = median(case, c, "p50_ms")
            errors = sum(r["errors"] for r in results[(case, c)])
            print(
                f"{case:26} {c:5d} {median(case, c, 'rps'):9.0f} {p50:8.3f} {median(case, c, 'p99_ms'):8.3f}"
                f" {p50 - base:+8.3f} {median(case, c, 'cpu_us'):10.0f} {errors:6d}"
            )


if __name__ == "__main__":
    main()
