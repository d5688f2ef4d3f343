"""What a time bound costs per bounded await: ``asyncio.timeout`` against ``gateway.infra.deadlines``, on
uvloop (what ``gateway serve`` runs) or asyncio's loop.

Each run awaits ``--awaits`` futures that another callback completes a loop turn later (as a Redis reply
or a worker's first byte arrives), bare or inside a bound that never fires (60 s: under valgrind a loop
turn can outlast the cache's 50 ms, and what a bound costs does not depend on its length). The peers'
repetitions interleave and the medians are printed, the bare run's cost taken off. ``--instructions``
counts instructions per await under valgrind instead (the run of N subtracted from the run of 2N).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_deadlines.py [--loop asyncio] [--instructions]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from pathlib import Path
from typing import Any

PEERS = ("bare", "asyncio.timeout", "Deadlines")
SECONDS = 60.0


def _reply(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    future = loop.create_future()
    loop.call_soon(future.set_result, None)
    return future


async def run(peer: str, awaits: int) -> float:
    """CPU seconds for ``awaits`` bounded (or bare) awaits."""
    from gateway.infra.deadlines import Deadlines

    loop = asyncio.get_running_loop()
    deadlines = Deadlines(SECONDS)
    timeout: Callable[[float], AbstractAsyncContextManager[Any]] = asyncio.timeout
    bound: Callable[[], AbstractContextManager[Any]] = deadlines.bound
    started = time.process_time()
    if peer == "bare":
        for _ in range(awaits):
            await _reply(loop)
    elif peer == "asyncio.timeout":
        for _ in range(awaits):
            async with timeout(SECONDS):
                await _reply(loop)
    else:
        for _ in range(awaits):
            with bound():
                await _reply(loop)
    return time.process_time() - started


def child(peer: str, awaits: int, loop: str) -> float:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(run(peer, awaits))
    return asyncio.run(run(peer, awaits))


def instructions(peer: str, awaits: int, loop: str) -> float:
    counts = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (awaits, 2 * awaits):
            log = Path(tmp) / f"{n}.log"
            cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", f"--log-file={log}"]
            cmd += [sys.executable, __file__, "--child", peer, "--awaits", str(n), "--loop", loop]
            subprocess.run(cmd, check=True)
            match = re.search(r"Collected : (\d+)", log.read_text())
            assert match is not None, f"no instruction count in {log}"
            counts.append(int(match.group(1)))
    return (counts[1] - counts[0]) / awaits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--awaits", type=int, help="awaits per run (200,000; 20,000 with --instructions)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (1 with --instructions)")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--instructions", action="store_true", help="count instructions under valgrind")
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    awaits = args.awaits or (20_000 if args.instructions else 200_000)
    if args.child:
        child(args.child, awaits, args.loop)
        return
    reps = 1 if args.instructions else args.reps
    unit = "instructions/await" if args.instructions else "CPU µs/await"
    results: dict[str, list[float]] = {peer: [] for peer in PEERS}
    for rep in range(reps):
        for peer in PEERS:
            if args.instructions:
                value = instructions(peer, awaits, args.loop)
            else:
                value = child(peer, awaits, args.loop) / awaits * 1e6
            results[peer].append(value)
            print(f"rep {rep + 1} {peer:16s} {value:12,.3f} {unit}", flush=True)
    bare = statistics.median(results["bare"])
    print(f"\n{args.loop}, {awaits:,} awaits a run\n")
    print(f"| peer | {unit} (median of {reps}) | the bound's own cost |")
    print("|---|--:|--:|")
    for peer, values in results.items():
        median = statistics.median(values)
        own = "-" if peer == "bare" else f"{median - bare:,.3f}"
        print(f"| {peer} | {median:,.3f} | {own} |")


if __name__ == "__main__":
    main()
