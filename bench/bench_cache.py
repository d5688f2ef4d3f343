"""The response cache through the gateway: hits vs misses, streamed or not, and with Redis paused.

Starts the benchmark mock worker (or uses ``--worker-url``, e.g. a real vLLM worker), a private
redis-server (so pausing it disturbs nobody), and one gateway process (``gateway serve``, one core)
with the cache and routing plugins. Load comes from ``wrk`` on the other core with a generated Lua
script: a fixed body (a hit after the first request) or a new prompt per request (a miss). Prints one
table, side by side: latency p50/p99/max and requests/s for

- hits, non-stream and stream, at 1 connection (latency) and at ``-c`` connections (throughput);
- misses, non-stream and stream (new prompts: the engine answers every one);
- the fixed body while Redis is paused (``CLIENT PAUSE``): every would-be hit goes to the engine, and
  the added latency per request stays within the cache's Redis timeout (the breaker then skips Redis).

    .venv/bin/python bench/bench_cache.py -d 5 -c 16
    .venv/bin/python bench/bench_cache.py --worker-url http://127.0.0.1:8001 --served-name smollm2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load
import peers

LUA = """
local body = [==[{body}]==]
local unique = {unique}
local counter = 0
function init(args)
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end
function request()
  if unique then
    counter = counter + 1
    return wrk.format("POST", "/v1/chat/completions", nil, string.gsub(body, "PROMPT", "{tag}-" .. counter))
  end
  return wrk.format("POST", "/v1/chat/completions", nil, string.gsub(body, "PROMPT", "fixed"))
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{{"requests":%d,"duration_us":%d,"errors":%d,"non_2xx":%d,"p50_us":%d,"p99_us":%d,"max_us":%d}}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""


def body(stream: bool, max_tokens: int) -> str:
    payload: dict[str, Any] = {
        "model": "bench",
        "messages": [{"role": "user", "content": "Say hello to PROMPT."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        payload["stream"] = True
    return orjson.dumps(payload).decode()


def wrk(
    tmp: Path, url: str, *, stream: bool, unique: bool, connections: int, duration_s: float, max_tokens: int
) -> dict[str, Any]:
    script = tmp / f"cache-{uuid.uuid4().hex[:8]}.lua"
    tag = uuid.uuid4().hex[:8]
    script.write_text(LUA.format(body=body(stream, max_tokens), unique="true" if unique else "false", tag=tag))
    cmd = ["taskset", "-c", peers.LOAD_CPU, "wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s"]
    cmd += ["--timeout", "30s", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 120, check=True).stdout
    return load.parse_wrk(out)


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = peers.free_port()
    binary = shutil.which("redis-server") or "redis-server"
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(cmd, stdout=(tmp / "redis.log").open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis(port=port, socket_timeout=1) as client:
                client.ping()
            return proc, port
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start_gateway(tmp: Path, worker_url: str, served_name: str, redis_port: int, cache: dict[str, Any]) -> peers.Peer:
    port = peers.free_port()
    config = {
        "models": [{"name": "bench", "served_name": served_name, "workers": [worker_url]}],
        "plugins": [{"name": "cache", "config": cache}, {"name": "routing"}],
        "upstream": {"connect_timeout_s": 3, "first_byte_timeout_s": 120, "idle_timeout_s": 60},
        "logging": {"level": "WARNING", "access_log": False},
    }
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = tmp / "gateway.log"
    env = {
        "GATEWAY_PORT": str(port),
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
    }
    cmd = [str(peers.VENV_BIN / "gateway"), "serve", "--config", str(path), "--no-managed-workers"]
    proc = peers._spawn(cmd, peers.PROXY_CPU, log, env=env)
    gateway = peers.Peer("gateway", f"http://127.0.0.1:{port}", "bench", proc, log=log)
    peers.wait_ready(gateway.url + "/ready", proc, log)
    return gateway


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-d", "--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("-c", "--connections", type=int, default=16, help="connections for the throughput rows")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (stream chunks on the mock)")
    parser.add_argument("--interval-ms", type=float, default=12.0, help="mock pace per streamed token (~85 tok/s)")
    parser.add_argument("--worker-url", help="a running worker (e.g. vLLM) instead of the mock")
    parser.add_argument("--served-name", default="mock", help="the model name the worker serves")
    parser.add_argument("--timeout-ms", type=float, default=50.0, help="the cache's Redis timeout")
    args = parser.parse_args()
    cache = {"namespace": "bench" + uuid.uuid4().hex[:8], "timeout_ms": args.timeout_ms}
    rows: list[tuple[str, int, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        mock = None if args.worker_url else peers.start_mock(tmp, args.interval_ms, args.max_tokens)
        worker_url = args.worker_url or (mock.url if mock else "")
        redis_proc, redis_port = start_redis(tmp)
        gateway = None
        try:
            gateway = start_gateway(tmp, worker_url, args.served_name, redis_port, cache)
            run = lambda stream, unique, c, d=args.duration: wrk(  # noqa: E731
                tmp, gateway.url, stream=stream, unique=unique, connections=c, duration_s=d, max_tokens=args.max_tokens
            )
            for stream in (False, True):
                kind = "stream" if stream else "non-stream"
                rows.append((f"miss, {kind} (new prompt each request)", 1, run(stream, True, 1)))
                run(stream, False, 1, 1)  # store the fixed answer
                rows.append((f"hit, {kind}", 1, run(stream, False, 1)))
                rows.append((f"hit, {kind}", args.connections, run(stream, False, args.connections)))
            with redis.Redis(port=redis_port) as control:
                pause_ms = int((args.duration * 2 + 5) * 1000)
                control.execute_command("CLIENT", "PAUSE", pause_ms, "ALL")
                for stream in (False, True):
                    kind = "stream" if stream else "non-stream"
                    rows.append((f"Redis paused, {kind} (fixed prompt)", 1, run(stream, False, 1)))
        finally:
            if gateway is not None:
                gateway.stop()
            redis_proc.kill()
            redis_proc.wait()
            if mock is not None:
                mock.stop()
    engine = args.worker_url or f"mock worker, {args.interval_ms:g} ms/token streamed"
    print(
        f"\ncache benchmark: {args.max_tokens} tokens per answer, engine: {engine},"
        f" Redis timeout {args.timeout_ms:g} ms"
    )
    print(f"{'case':44} {'conns':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>6}")
    for name, conns, r in rows:
        print(
            f"{name:44} {conns:5d} {r['rps']:9.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}"
            f" {r['max_ms']:8.2f} {r['errors']:6d}"
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
