"""What the batch runner costs a replica per line as the number of running batches grows.

Each finished line starts the runner's next step. If that step is a whole round over every batch not
final (each batch's record and pending count read from Redis), the cost of a line grows with the number
of running batches, and that CPU is taken from the replica's live traffic. This bench runs the same
number of lines as one batch and as ``--batches`` batches, through ``gateway serve`` (routing only, the
real Redis, bench/mock_upstream.py answering at once), and prints the gateway's CPU per line and the
wall time of each, side by side; ``--baseline-src DIR`` adds the same runs of another tree.

Lines run ``--max-in-flight`` at a time (default 1): with the mock answering at once, that is how lines
of real generations finish, one at a time, each starting a step of its own. The batches' statuses are
read from Redis, not through the gateway, so that polling costs the gateway nothing; the CPU counted
includes creating, validating and finalizing the batches (the same in both trees).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_batch_runner.py [--lines 2000] [--batches 100] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import openai
import orjson
import peers
import redis

PREFIX = "bench:batchrunner:" + uuid.uuid4().hex[:8]


def lines_file(count: int, tag: str) -> bytes:
    body = {"model": peers.GATEWAY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    lines = [
        {"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(count)
    ]
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def run_once(gateway: peers.Peer, prefix: str, lines: int, batches: int) -> tuple[float, float]:
    """(gateway CPU ms per line, wall seconds) for ``lines`` lines split over ``batches`` batches, all
    created before the first is done."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="bench", max_retries=0)
    per = lines // batches
    sources = [
        client.files.create(file=("in.jsonl", lines_file(per, f"b{b}")), purpose="batch") for b in range(batches)
    ]
    cpu0, wall0 = peers.cpu_seconds(gateway.proc.pid), time.monotonic()
    ids = [
        client.batches.create(input_file_id=s.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for s in sources
    ]
    final = {b'"completed"', b'"failed"', b'"expired"', b'"cancelled"'}
    pending = set(ids)
    store = redis.Redis()
    while pending:
        time.sleep(0.1)
        for batch_id in list(pending):
            if store.hget(f"{prefix}:batch:{batch_id}", "status") in final:
                pending.discard(batch_id)
    store.close()
    wall = time.monotonic() - wall0
    cpu = peers.cpu_seconds(gateway.proc.pid) - cpu0
    return cpu * 1000 / (per * batches), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--max-in-flight", type=int, default=1, help="batch lines a replica runs at once")
    parser.add_argument("--baseline-src", type=Path)
    args = parser.parse_args()
    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.baseline_src is not None:
        trees.append(("base", args.baseline_src))
    rows: list[tuple[str, int, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        mock = peers.start_mock(tmp, 0.0, 4)
        try:
            for name, source in trees:
                prefix = f"{PREFIX}:{len(rows)}"
                extra: dict[str, Any] = {
                    "batches": {
                        "files_dir": str(tmp / f"files-{len(rows)}"),
                        "redis_prefix": prefix,
                        "max_active_batches": max(100, args.batches),
                        "max_in_flight": args.max_in_flight,
                    }
                }
                gateway = peers.start_gateway(tmp, f"gw{len(rows)}", mock.url, [{"name": "routing"}],
                                              source=source, extra=extra)  # fmt: skip
                try:
                    for count in (1, args.batches):
                        cpu_ms, wall = run_once(gateway, prefix, args.lines, count)
                        rows.append((name, count, cpu_ms, wall))
                        print(f"{name}: {count} batches: {cpu_ms:.2f} CPU ms/line, {wall:.1f} s", flush=True)
                finally:
                    gateway.stop()
        finally:
            mock.stop()
            client = redis.Redis()
            keys = list(client.scan_iter(match=f"{PREFIX}*", count=1000))
            if keys:
                client.delete(*keys)
            client.close()
    print()
    print(f"| tree | batches running | gateway CPU ms per line | wall s for {args.lines} lines |")
    print("|---|--:|--:|--:|")
    for name, count, cpu_ms, wall in rows:
        print(f"| {name} | {count} | {cpu_ms:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
