"""What the safety plugin adds: its hook latency in-process, and gateway requests/s with and without it.

1. In-process: ``on_request`` of the plugin with the default rule set (the root config.yaml's:
   secrets and payment cards redacted, prompt injection blocked, size limits on) on a 2 KB and a
   32 KB prompt, clean and with a card number and an API key to redact; plus the full PII set (all
   detectors); p50/p99 over many runs. For comparison, detect-secrets' own ``scan_line`` over the
   same text, which is what the plugin avoids by running detect-secrets' patterns through one RE2 set.
2. Through the gateway (``gateway serve`` pinned to one core, the benchmark mock worker and ``wrk``
   on the other): a 2 KB prompt, routing only vs safety (default rules) + routing.

    .venv/bin/python bench/bench_safety.py            # both parts
    .venv/bin/python bench/bench_safety.py --no-gateway -n 5000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import load
import peers

from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.config import ModelConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import WorkerTable
from plugins.safety import SafetyConfig, SafetyPlugin

DEFAULT_RULES: dict[str, Any] = {
    "limits": {
        "max_body_bytes": 1048576,
        "max_messages": 256,
        "max_prompt_chars": 200000,
        "max_tokens": 2048,
        "max_n": 4,
        "max_tools": 64,
        "max_json_depth": 32,
    },
    "rules": [
        {"id": "secrets", "kind": "secrets", "action": "redact"},
        {"id": "payment-cards", "kind": "card", "action": "redact"},
        {"id": "prompt-injection", "kind": "injection", "action": "block"},
    ],
}
FULL_PII: dict[str, Any] = {
    **DEFAULT_RULES,
    "rules": [
        *DEFAULT_RULES["rules"],
        {"id": "email", "kind": "email", "action": "redact"},
        {"id": "phone", "kind": "phone", "action": "redact"},
        {"id": "iban", "kind": "iban", "action": "redact"},
        {"id": "ip", "kind": "ip", "action": "log"},
        {
            "id": "ssn",
            "kind": "gov_id",
            "action": "redact",
            "formats": [{"label": "SSN", "pattern": r"\b\d{3}-\d{2}-\d{4}\b"}],
        },
    ],
}
WORDS = [
    "the",
    "a",
    "model",
    "answer",
    "question",
    "data",
    "system",
    "user",
    "request",
    "time",
    "value",
    "result",
    "code",
    "function",
    "table",
    "report",
    "summary",
    "analysis",
    "review",
    "project",
    "team",
    "plan",
    "design",
    "test",
    "change",
    "version",
    "update",
    "release",
    "note",
    "example",
    "please",
    "explain",
    "describe",
    "compare",
    "write",
    "list",
    "show",
    "consider",
    "because",
    "however",
    "therefore",
    "while",
    "after",
]


def prose(size: int, seed: int) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    length = 0
    while length < size:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ". "
        out.append(sentence)
        length += len(sentence)
    return "".join(out)[:size]


def with_findings(text: str) -> str:
    middle = len(text) // 2
    return text[:middle] + " card 4111 1111 1111 1111 key AKIAIOSFODNN7EXAMPLE " + text[middle:]


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return samples[len(samples) // 2], samples[min(len(samples) - 1, int(len(samples) * 0.99))]


async def hook_latency(config: dict[str, Any], text: str, runs: int) -> tuple[float, float]:
    services = Services(Settings(), UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
    plugin = SafetyPlugin(SafetyConfig.model_validate(config), services)
    await plugin.start()
    model = ModelConfig(name="bench", workers=["http://127.0.0.1:1"])
    raw = orjson.dumps({"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": 64})
    samples: list[float] = []
    for i in range(runs + 50):
        ctx = RequestContext(
            request_id="r",
            endpoint="chat/completions",
            path="/v1/chat/completions",
            body=orjson.loads(raw),
            raw_body=raw,
            headers={},
            model=model,
            requested_model="bench",
            snapshot=None,  # type: ignore[arg-type]  # the hook does not use it
            stream=False,
            started=0.0,
        )
        started = time.perf_counter()
        await plugin.on_request(ctx)
        if i >= 50:  # warm-up first
            samples.append((time.perf_counter() - started) * 1000)
    await plugin.aclose()
    return percentiles(samples)


def detect_secrets_latency(text: str, runs: int) -> tuple[float, float]:
    from detect_secrets.core.scan import scan_line
    from detect_secrets.settings import default_settings

    samples: list[float] = []
    with default_settings():
        for _ in range(runs):
            started = time.perf_counter()
            for line in text.splitlines() or [text]:
                list(scan_line(line))
            samples.append((time.perf_counter() - started) * 1000)
    return percentiles(samples)


def in_process(runs: int) -> None:
    print(f"In-process on_request latency (ms), {runs} runs each")
    print(f"{'rule set':30} {'prompt':22} {'p50':>8} {'p99':>8}")
    for size, label in [(2048, "2 KB"), (32768, "32 KB")]:
        clean = prose(size, size)
        n = runs if size <= 2048 else max(200, runs // 8)
        for name, config in [("default", DEFAULT_RULES), ("full PII set", FULL_PII)]:
            for kind, text in [("clean", clean), ("card+key redacted", with_findings(clean))]:
                p50, p99 = asyncio.run(hook_latency(config, text, n))
                print(f"{name:30} {label + ' ' + kind:22} {p50:8.3f} {p99:8.3f}")
        # detect-secrets' own scan is slow: fewer runs, and a 32 KB prompt as lines of ~80 chars.
        lines = "\n".join(clean[i : i + 80] for i in range(0, len(clean), 80))
        p50, p99 = detect_secrets_latency(lines, max(5, n // 100))
        print(f"{'detect-secrets scan_line':30} {label + ' clean':22} {p50:8.3f} {p99:8.3f}")


LUA = """
local body = [==[{body}]==]
function init(args)
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  request_bytes = wrk.format("POST", "/v1/chat/completions", nil, body)
end
function request() return request_bytes end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{{"requests":%d,"duration_us":%d,"errors":%d,"non_2xx":%d,"p50_us":%d,"p99_us":%d}}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk(tmp: Path, url: str, text: str, connections: int, duration_s: float) -> dict[str, Any]:
    body = orjson.dumps(
        {"model": peers.GATEWAY_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    ).decode()
    script = tmp / f"safety-{uuid.uuid4().hex[:8]}.lua"
    script.write_text(LUA.format(body=body))
    cmd = ["taskset", "-c", peers.LOAD_CPU, "wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s"]
    cmd += ["--timeout", "10s", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60, check=True).stdout
    return load.parse_wrk(out)


def through_gateway(duration_s: float, connections: list[int]) -> None:
    text = prose(2048, 7)
    variants: dict[str, list[dict[str, Any]]] = {
        "routing only": [{"name": "routing"}],
        "safety (default) + routing": [{"name": "safety", "config": DEFAULT_RULES}, {"name": "routing"}],
        "safety (full PII) + routing": [{"name": "safety", "config": FULL_PII}, {"name": "routing"}],
    }
    rows: list[tuple[str, int, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        mock = peers.start_mock(tmp, 0.0, 16)
        try:
            for name, plugins in variants.items():
                gateway = peers.start_gateway(tmp, name.split()[0] + uuid.uuid4().hex[:4], mock.url, plugins)
                try:
                    wrk(tmp, gateway.url, text, 8, 1)  # warm-up
                    for c in connections:
                        rows.append((name, c, wrk(tmp, gateway.url, text, c, duration_s)))
                finally:
                    gateway.stop()
        finally:
            mock.stop()
    base = {c: r for n, c, r in rows if n == "routing only"}
    print("\nGateway, 2 KB prompt, non-stream, gateway on one core")
    print(
        f"{'peer':30} {'conns':>5} {'req/s':>9} {'vs base':>8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'errors':>6}"
    )
    for name, c, r in rows:
        ratio = r["rps"] / base[c]["rps"] if base[c]["rps"] else 0.0
        added = r["p50_ms"] - base[c]["p50_ms"]
        print(
            f"{name:30} {c:5d} {r['rps']:9.0f} {ratio:8.2f} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {added:+8.3f} "
            f"{r['errors']:6d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--runs", type=int, default=3000, help="in-process runs per case (2 KB)")
    parser.add_argument("-d", "--duration", type=float, default=5.0, help="seconds per gateway measurement")
    parser.add_argument("-c", "--connections", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--no-gateway", action="store_true", help="only the in-process part")
    args = parser.parse_args()
    in_process(args.runs)
    if not args.no_gateway:
        through_gateway(args.duration, args.connections)


if __name__ == "__main__":
    main()
