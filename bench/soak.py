"""Soak: minutes of mixed traffic through a real ``gateway serve`` process, watching it for leaks.

Traffic (a steady mix from ``--concurrency`` clients): plain chat requests, streams with usage, repeated
deterministic prompts (cache hits), prompts the safety plugin refuses (400), and guided JSON requests
(``response_format: json_schema``, answers validated by the guided_json plugin). Against the fake worker
(``tests.support.fakes.FakeUpstream`` in its own process, answering valid JSON) by default; with ``--engine-url``
against a real vLLM worker as well (same mix, fewer clients).

Sampled every ``--sample-s`` from outside the process: RSS (psutil), open file descriptors
(``/proc/<pid>/fd``) and asyncio tasks (``GET /admin/debug/tasks``, admin token). Pass criteria:
RSS growth <= 10% from the end of warm-up to the end; at idle after the load, no more fds and tasks
than at idle after warm-up (small slack for pooled connections); no request answered other than
expected.

Clients are ``httpx.AsyncClient`` with httpx's default pool settings (as the OpenAI SDK: idle connections
reused for up to 5 s). Besides the busy clients, ``--idle-clients`` each send a plain request, pause for
just under that 5 s expiry and send the next one on the connection they kept: the moment at which a
server whose keep-alive timeout is also 5 s (uvicorn's default) closes it. ``--keepalive-timeout-s`` sets
the gateway's (``GATEWAY_KEEPALIVE_TIMEOUT_S``), e.g. 5 to see that race.

    .venv/bin/python bench/soak.py --minutes 30
    .venv/bin/python bench/soak.py --minutes 30 --engine-url http://127.0.0.1:8100 --engine-model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.fakes import free_port  # noqa: E402
from tests.support.faults import WorkerProcess, gateway_env, wait_for  # noqa: E402

ANSWER = '{"answer": "ok"}'
# A closed set of answers, so that a real model's constrained answer fits in the soak's small max_tokens
# (an open string gets cut, and cut guided answers are a 400 by design).
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["ok", "yes", "no"]}}, "required": ["answer"]}
# Idle keep-alive connections (to the worker, to Redis) are bounded by the number of clients, not by
# time: a leak grows without bound over a run, while this slack only absorbs how full the pools are.
FD_SLACK_PER_CLIENT = 1
FD_SLACK = 8
TASK_SLACK = 4


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    tasks: int
    requests: int


@dataclass
class Tally:
    by_kind: dict[str, int] = field(default_factory=dict)
    by_model: dict[str, int] = field(default_factory=dict)  # answered as expected, per model (fake, engine)
    errors: list[str] = field(default_factory=list)
    error_counts: dict[str, int] = field(default_factory=dict)  # "kind: status or exception type" -> n
    idle_reuses: int = 0  # plain requests sent on a connection idle for just under 5 s

    def ok(self, kind: str, model: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.by_model[model] = self.by_model.get(model, 0) + 1

    def error(self, kind: str, what: str, detail: str) -> None:
        self.errors.append(f"{kind}: {what} {detail}")
        key = f"{kind.split()[0]}: {what}"
        self.error_counts[key] = self.error_counts.get(key, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.by_kind.values()) + len(self.errors)


def gateway_config(models: list[dict[str, Any]], namespace: str) -> dict[str, Any]:
    rules = [{"id": "soak-deny", "kind": "words", "words": ["forbiddenword"], "action": "block"}]
    return {
        "models": models,
        "plugins": [
            {"name": "safety", "config": {"rules": rules}},
            {"name": "cache", "config": {"namespace": namespace}},
            {"name": "guided_json", "config": {"probe": False}},
            {"name": "routing"},
        ],
        "upstream": {"health_interval_s": 1, "first_byte_timeout_s": 120, "idle_timeout_s": 60},
        "logging": {"level": "WARNING", "access_log": False},
    }


KINDS = ("plain", "stream", "cached", "refused", "guided", "cached_stream")
IDLE_S = (4.8, 4.99)  # pause of the idle clients: just under httpx's keepalive_expiry (5 s)


async def one_request(
    client: httpx.AsyncClient, model: str, kind: str, tally: Tally, max_tokens: int, note: str = ""
) -> None:
    """One request of the mix; anything but the expected answer is an error (``note`` says how it was sent)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    user = f"soak {uuid.uuid4().hex[:8]}: say something short"
    if kind in ("cached", "cached_stream"):
        body["temperature"] = 0
        user = "soak: a question asked again and again"
    elif kind == "refused":
        user = "please print the forbiddenword now"
    elif kind == "guided":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    body["messages"] = [{"role": "user", "content": user}]
    try:
        if kind in ("stream", "cached_stream"):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                text = "".join([part async for part in response.aiter_text()])
            if response.status_code != 200 or '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
                tally.error(kind + note, str(response.status_code), text[-300:])
                return
        else:
            response = await client.post("/v1/chat/completions", json=body)
            expected = 400 if kind == "refused" else 200
            if response.status_code != expected:
                tally.error(kind + note, str(response.status_code), response.text[:300])
                return
            if kind == "guided":
                json.loads(response.json()["choices"][0]["message"]["content"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        tally.error(kind + note, type(exc).__name__, repr(exc))
        return
    tally.ok(kind, model)


async def drive(url: str, model: str, clients: int, stop: asyncio.Event, tally: Tally, max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=180, limits=httpx.Limits(max_connections=clients)) as client:

        async def loop(n: int) -> None:
            i = n
            while not stop.is_set():
                await one_request(client, model, KINDS[i % len(KINDS)], tally, max_tokens)
                i += 1

        await asyncio.gather(*(loop(n) for n in range(clients)))


async def drive_idle(url: str, model: str, clients: int, stop: asyncio.Event, tally: Tally, max_tokens: int) -> None:
    """Clients that each keep one connection and reuse it after an idle pause drawn from ``IDLE_S``."""

    async def loop(n: int) -> None:
        pauses = random.Random(n)
        async with httpx.AsyncClient(base_url=url, timeout=180) as client:
            note = ""
            while not stop.is_set():
                await one_request(client, model, "plain", tally, max_tokens, note)
                pause = pauses.uniform(*IDLE_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause)
                tally.idle_reuses += not stop.is_set()
                note = f" after {pause:.3f} s idle"

    await asyncio.gather(*(loop(n) for n in range(clients)))


def sample(proc: psutil.Process, url: str, token: str, started: float, requests: int) -> Sample:
    tasks = httpx.get(url + "/admin/debug/tasks", headers={"authorization": f"Bearer {token}"}, timeout=10)
    return Sample(
        t=time.monotonic() - started,
        rss_mb=proc.memory_info().rss / 2**20,
        fds=len(os.listdir(f"/proc/{proc.pid}/fd")),
        tasks=int(tasks.json()["tasks"]),
        requests=requests,
    )


async def idle_sample(proc: psutil.Process, url: str, token: str, started: float, tally: Tally) -> Sample:
    await asyncio.sleep(2.0)  # let finished requests' tasks and background stores settle
    return await asyncio.to_thread(sample, proc, url, token, started, tally.total)


async def soak(args: argparse.Namespace, url: str, proc: psutil.Process, token: str) -> dict[str, Any]:
    targets = [("m1", args.concurrency, 16)]
    if args.engine_url:
        targets.append(("engine", max(1, args.concurrency // 4), 16))
    clients = sum(c for _, c, _ in targets) + args.idle_clients
    tally = Tally()
    started = time.monotonic()
    duration = args.minutes * 60
    warmup = max(10.0, duration * args.warmup_share)

    async def phase(seconds: float, samples: list[Sample]) -> None:
        stop = asyncio.Event()
        load = [asyncio.create_task(drive(url, m, c, stop, tally, t)) for m, c, t in targets]
        load.append(asyncio.create_task(drive_idle(url, "m1", args.idle_clients, stop, tally, 16)))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
            samples.append(await asyncio.to_thread(sample, proc, url, token, started, tally.total))
            last = samples[-1]
            print(
                f"t={last.t:7.1f}s rss={last.rss_mb:7.1f} MiB fds={last.fds:4d} tasks={last.tasks:4d} "
                f"requests={last.requests:7d} errors={len(tally.errors)}",
                flush=True,
            )
        stop.set()
        await asyncio.gather(*load)

    warm: list[Sample] = []
    await phase(warmup, warm)
    idle_warm = await idle_sample(proc, url, token, started, tally)
    steady: list[Sample] = []
    await phase(duration - warmup, steady)
    idle_end = await idle_sample(proc, url, token, started, tally)

    base_rss = statistics.median(s.rss_mb for s in warm[-3:])
    end_rss = statistics.median(s.rss_mb for s in steady[-3:]) if steady else base_rss
    growth = (end_rss - base_rss) / base_rss
    checks = {
        "rss_growth<=10%": growth <= 0.10,
        "no_fd_leak": idle_end.fds <= idle_warm.fds + FD_SLACK + FD_SLACK_PER_CLIENT * clients,
        "no_task_leak": idle_end.tasks <= idle_warm.tasks + TASK_SLACK,
        "no_errors": not tally.errors,
    }
    return {
        "minutes": args.minutes,
        "requests": tally.total,
        "by_kind": tally.by_kind,
        "by_model": tally.by_model,
        "idle_reuses": tally.idle_reuses,
        "error_counts": tally.error_counts,
        "errors": tally.errors[:20],
        "error_count": len(tally.errors),
        "rss_mb_after_warmup": round(base_rss, 1),
        "rss_mb_end": round(end_rss, 1),
        "rss_growth_pct": round(growth * 100, 2),
        "idle_fds": [idle_warm.fds, idle_end.fds],
        "idle_tasks": [idle_warm.tasks, idle_end.tasks],
        "checks": checks,
        "passed": all(checks.values()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    token = secrets.token_urlsafe(24)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with WorkerProcess(text=ANSWER, chunks=8, pace_s=args.pace_s) as worker, tempfile.TemporaryDirectory() as tmp:
        models: list[dict[str, Any]] = [{"name": "m1", "workers": [worker.url]}]
        if args.engine_url:
            models.append({"name": "engine", "served_name": args.engine_model, "workers": [args.engine_url]})
        namespace = "soak" + uuid.uuid4().hex[:10]
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(gateway_config(models, namespace)))
        env = gateway_env(
            GATEWAY_PORT=str(port),
            GATEWAY_CONFIG_PATH=str(path),
            GATEWAY_MANAGED_WORKERS="false",
            GATEWAY_CONFIG_WATCH_S="0",
            GATEWAY_ADMIN_TOKEN=token,
            **({"GATEWAY_KEEPALIVE_TIMEOUT_S": str(args.keepalive_timeout_s)} if args.keepalive_timeout_s else {}),
        )
        log = (Path(tmp) / "gateway.log").open("wb")
        gateway = subprocess.Popen([str(REPO / ".venv/bin/gateway"), "serve"], env=env, stdout=log, stderr=log)
        try:
            wait_for(lambda: _ready(url), 60, "the gateway to be ready", interval_s=0.1)
            result = asyncio.run(soak(args, url, psutil.Process(gateway.pid), token))
        finally:
            gateway.terminate()
            try:
                gateway.wait(timeout=40)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()
            _delete_cache(namespace)
        if not result["passed"]:
            result["gateway_log_tail"] = (Path(tmp) / "gateway.log").read_text(errors="replace")[-2000:]
    return result


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _delete_cache(namespace: str) -> None:
    import redis

    with redis.Redis() as client:
        names = list(client.scan_iter(match=f"*{namespace}*", count=1000))
        if names:
            client.delete(*names)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=16, help="clients against the fake worker")
    parser.add_argument("--idle-clients", type=int, default=2, help="clients that reuse a connection idle ~5 s")
    parser.add_argument("--keepalive-timeout-s", type=int, help="the gateway's GATEWAY_KEEPALIVE_TIMEOUT_S")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-share", type=float, default=0.2, help="share of the run that is warm-up")
    parser.add_argument("--pace-s", type=float, default=0.01, help="fake worker: gap between stream chunks")
    parser.add_argument("--engine-url", help="also drive a real vLLM worker at this URL")
    parser.add_argument("--engine-model", default="smollm2", help="the model name the real worker serves")
    parser.add_argument("--json", type=Path, help="write the result here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "gateway_log_tail"}, indent=2))
    if "gateway_log_tail" in result:
        print(result["gateway_log_tail"], file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
