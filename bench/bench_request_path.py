"""The gateway's own CPU per request on the request path, without client or worker sockets: a steadier
measure of the plugins' and the core's Python than ``bench/run.py``'s, whose CPU per request moves by up
to 10% between repetitions (wrk, the mock and Redis share the other core).

Each peer runs in a process of its own, pinned to one core, as ``gateway serve`` runs it (the app built
by ``create_app``, its lifespan, uvloop, the front door ``GatewayHttpProtocol``), with these changes:
  - clients are in-process: ``--concurrency`` keep-alive connections, each writing the bytes of a
    request (as ``bench/wrk_post.lua`` sends them, a new prompt each time) into the protocol and the
    next one once the answer is complete; what the gateway writes back is dropped;
  - the worker is in-process: the HTTP client to workers answers every POST with the mock's answer
    (``bench/mock_upstream.py``'s bytes), after one turn of the event loop; with ``--stream`` every
    request streams (32 tokens and the usage event, as ``bench/run.py --streams`` asks) and the worker
    sends the mock's events one read each, a loop turn apart (unpaced: the CPU per stream is the measure);
  - Redis is the real one (``GATEWAY_REDIS_URL``, default 127.0.0.1:6379): the production set's scripts
    are part of its cost. Keys are written under the bench's prefix and deleted after.
The CPU is the process's (every thread: the access log, Redis), over ``--requests`` requests after a
warm-up, per request; repetitions interleave the peers, medians are printed. On a shared VM that CPU
time still moves by 5-25% from run to run; ``--instructions`` counts the instructions per request under
valgrind instead: within about 1% from run to run for both peers (the production set's wall-clock Redis
bounds are raised so that valgrind's slowness does not trip them: ``REDIS_BOUNDS``). About 3 minutes a peer.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py [--baseline-src DIR] [--reps 5]
    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py --instructions [--baseline-src DIR]
    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py --stream [--instructions] [--baseline-src DIR]
    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py --instructions --callgrind-out /tmp/cg  # then:
    .venv/bin/python bench/callgrind_diff.py /tmp/cg production routing  # instructions per request by C function
    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py --reps 1 --requests 1000 --opcodes /tmp/opc
    .venv/bin/python bench/opcode_count.py /tmp/opc production routing  # bytecodes per request by Python function

Peers: ``routing`` (the ``gateway`` peer of bench/run.py) and ``production`` (``gateway-production``:
tenancy with a key, safety, the cache on a miss, guided JSON, routing). ``production-without-P`` is the
production set without plugin P (``production-without-safety+cache``: without both); ``--by-plugin``
adds one such peer per plugin but routing, and the table then says what each plugin costs (production
minus the peer without it). ``--baseline-src`` adds each peer again running the ``gateway``/``plugins``
packages of DIR (a copy taken before a change).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_request_path.py --instructions --by-plugin
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from bench_front_door import Transport
from mock_upstream import CHAT_ANSWER, stream_events
from opcode_count import OpcodeCounter

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("routing", "production")
#: ``production-without-tenancy+cache``: the production set without those plugins (``--by-plugin``).
WITHOUT = "production-without-"
STREAM_TOKENS = 32  # bench/run.py's --tokens default
RUN_LIMIT_S = 3600  # a run fails rather than hang when an answer never completes (valgrind is slow)
#: The production set's bounds on each Redis call, at their maxima here. They are wall-clock bounds: under
#: valgrind (about 50 times slower) the cache's 50 ms ran out, its breaker opened and requests went past the
#: cache for as long as timing decided, so the set was counted partly without its cache, differently from
#: run to run. ``drive`` checks that the cache saw every request.
REDIS_BOUNDS: dict[str, dict[str, float]] = {"cache": {"timeout_ms": 5000}, "tenancy": {"redis_timeout_ms": 5000}}


class _Answer:
    """The worker's answer to one POST (``gateway.infra.http_api.HttpResponse``): the mock's JSON answer,
    or its stream's events, each in a read of its own (a loop turn before each)."""

    status = 200

    def __init__(self, pieces: list[bytes], content_type: str) -> None:
        self._pieces = iter(pieces)
        self._content_type = content_type

    def header(self, name: str) -> str | None:
        return self._content_type if name == "content-type" else None

    async def read(self, idle_s: float | None) -> bytes:
        return b"".join(self._pieces)

    async def chunk(self, idle_s: float | None) -> bytes:
        await asyncio.sleep(0)
        return next(self._pieces, b"")

    async def relay(
        self, sink: Callable[[bytes], bool], drained: Callable[[], Awaitable[None]], idle_s: float | None
    ) -> None:
        """As ``gateway/infra/http1.py`` relays: each read handed to ``sink`` from a loop callback (there,
        the connection's ``data_received``), a loop turn apart, while the relaying task sleeps until the
        end, a failure of the sink, or a full sink; not one wake-up of the whole request's task per read."""
        loop = asyncio.get_running_loop()
        while True:
            paused = loop.create_future()  # True: the sink is full; False: the body ended

            def push(paused: asyncio.Future[bool] = paused) -> None:
                if paused.done():  # the relay was cancelled (the client went away)
                    return
                piece = next(self._pieces, b"")
                if not piece:
                    paused.set_result(False)
                    return
                try:
                    room = sink(piece)
                except Exception as exc:  # as the connection does: the sink's failure ends the relay
                    paused.set_exception(exc)
                    return
                if room:
                    loop.call_soon(push)
                else:
                    paused.set_result(True)

            loop.call_soon(push)
            if not await paused:
                return
            await drained()

    def close(self) -> None:
        return None


class InProcessWorker:
    """``gateway.infra.http_api.HttpClient`` answering every POST after one loop turn (a read): with the
    mock's answer, or for a streaming request its ``tokens`` content events (plus the usage event when
    asked for it), one read each."""

    def __init__(self, tokens: int) -> None:
        self._streams = {usage: stream_events(True, tokens, usage) for usage in (False, True)}

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str] | None, *, connect_timeout_s: float
    ) -> _Answer:
        await asyncio.sleep(0)
        if b'"stream":true' not in body:
            return _Answer([CHAT_ANSWER], "application/json")
        return _Answer(self._streams[b'"include_usage":true' in body], "text/event-stream")

    def set_limits(self, *, limit: int, limit_per_host: int, keepalive_s: float) -> None:
        return None

    async def aclose(self) -> None:
        return None


class ClientTransport(Transport):
    """The client's side of one connection (bench/bench_front_door.py's), counting the answers' status
    codes, and the streams that ended with ``[DONE]`` (under ``b"[DONE]"``)."""

    def __init__(self, statuses: dict[bytes, int]) -> None:
        super().__init__()
        self.statuses = statuses

    def write(self, data: Any) -> None:
        if data[:9] == b"HTTP/1.1 ":
            status = bytes(data[9:12])
            self.statuses[status] = self.statuses.get(status, 0) + 1
        if b"data: [DONE]" in data:
            self.statuses[b"[DONE]"] = self.statuses.get(b"[DONE]", 0) + 1


def request_bytes(model: str, tag: str, n: int, token: str, stream: bool = False) -> bytes:
    """What ``bench/wrk_post.lua`` sends in ``unique`` mode (a new prompt: a cache miss); ``stream``: a
    streaming request for ``STREAM_TOKENS`` tokens with their usage, as bench/load.py's stream client
    asks (``bench/run.py --streams``)."""
    content = f"Say hello to request {tag}-{n}."
    streamed = ',"stream":true,"stream_options":{"include_usage":true}' if stream else ""
    body = (
        f'{{"model":"{model}","messages":[{{"role":"user","content":"{content}"}}],'
        f'"max_tokens":{STREAM_TOKENS if stream else 16},"temperature":0{streamed}}}'
    ).encode()
    auth = b"Authorization: Bearer %s\r\n" % token.encode() if token else b""
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
        + auth
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def optional_plugins() -> list[str]:
    """The production set's plugins a peer may leave out: all but routing, the terminal one."""
    import run

    return ["tenancy", *(name for name in run.DEFAULT_PLUGINS if name != "routing")]


def left_out(peer: str) -> frozenset[str]:
    """The plugins a peer runs the production set without (none for ``production``); SystemExit for a
    name that is no peer or no plugin of the set other than routing (the terminal one)."""
    if peer in PEERS:
        return frozenset()
    names = peer.removeprefix(WITHOUT).split("+") if peer.startswith(WITHOUT) else []
    optional = optional_plugins()
    if not names or not set(names) <= set(optional):
        raise SystemExit(f"unknown peer {peer}: {', '.join(PEERS)} or {WITHOUT}P[+P...], P of {', '.join(optional)}")
    return frozenset(names)


def plugins_for(peer: str) -> tuple[list[dict[str, Any]], str]:
    """The plugin entries and bearer token of a bench/run.py peer (or the production set without some)."""
    import run

    if peer == "routing":
        return [{"name": "routing"}], ""
    full, skipped = run.resolve_plugins(run.DEFAULT_PLUGINS, {})
    if skipped:
        raise SystemExit("plugins skipped: " + "; ".join(skipped))
    os.environ["GATEWAY_TENANCY_PEPPER"] = run.PRODUCTION_PEPPER
    dropped = left_out(peer)
    entries = [entry for entry in run.production_plugins(full) if entry["name"] not in dropped]
    for entry in entries:
        entry["config"] = {**entry.get("config", {}), **REDIS_BOUNDS.get(entry["name"], {})}
    return entries, run.PRODUCTION_KEY if "tenancy" not in dropped else ""


def cache_misses(app: Any) -> tuple[float, float]:
    """(requests the cache counted as misses, its Redis errors) so far, from the app's metrics."""
    import run

    totals = run.counter_totals(app.state.services.metrics.collect(), "gateway_cache_misses", "gateway_cache_errors")
    return totals["gateway_cache_misses"], totals["gateway_cache_errors"]


async def drive(
    peer: str,
    health_url: str,
    requests: int,
    warmup: int,
    concurrency: int,
    profile: str | None = None,
    stream: bool = False,
    tasks_file: str | None = None,
    opcodes: str | None = None,
) -> dict[str, float]:
    """One peer's CPU per request and requests per second (``profile``: a cProfile of the measured
    requests is written there; ``opcodes``: their bytecodes by function, ``opcode_count.OpcodeCounter``;
    ``stream``: every request streams its answer; ``tasks_file``: where SIGUSR1 writes every task's stack)."""
    import peers
    import uvicorn

    from gateway.ops.logs import configure_logging
    from gateway.ops.settings import Settings
    from gateway.pipeline.config import GatewayConfig
    from gateway.server import app as app_module
    from gateway.server.front_door import FrontDoorLimits, GatewayHttpProtocol

    plugins, token = plugins_for(peer)
    # Health checks once an hour: under valgrind a probe could run past its bound and eject the worker.
    config = GatewayConfig.model_validate(peers.gateway_config(health_url, plugins, {"health_interval_s": 3600}))
    configure_logging("INFO", access_log=True)
    # The console's sampler once a minute: its work comes with time, not with requests, and under valgrind
    # (about 50 times slower) it would run 50 times as often per request, more so on a busy machine.
    os.environ["GATEWAY_CONSOLE_SAMPLE_S"] = "60"  # the longest allowed
    # The worker, in-process. Patched here, not passed in: a --baseline-src tree builds its app this way too.
    app_module.make_http_client = lambda kind, upstream: InProcessWorker(STREAM_TOKENS)
    settings = Settings()
    app = app_module.create_app(settings, config=config, engine_factory=None)
    # As ``gateway serve`` configures uvicorn (gateway/cli.py), less what only a socket needs.
    # (A --baseline-src tree from before server_options has only the proxy options.)
    options = getattr(settings, "server_options", settings.proxy_options)()
    # The keep-alive bound is an hour: under valgrind a connection's next request may come seconds later.
    server_config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="on", timeout_keep_alive=3600, **options
    )
    server_config.load()
    lifespan = server_config.lifespan_class(server_config)
    await lifespan.startup()
    if lifespan.should_exit:
        raise SystemExit("the app did not start")
    server_state = uvicorn.server.ServerState()
    statuses: dict[bytes, int] = {}
    tag = os.urandom(6).hex()
    counter = iter(range(10**9))

    async def connection(count: int) -> None:
        done = asyncio.Event()
        proto = GatewayHttpProtocol(
            limits=FrontDoorLimits(), config=server_config, server_state=server_state, app_state={}
        )
        complete = proto.on_response_complete

        def on_complete() -> None:
            complete()
            done.set()

        proto.on_response_complete = on_complete  # type: ignore[method-assign]
        transport = ClientTransport(statuses)
        proto.connection_made(transport)
        for _ in range(count):
            if transport.closing:
                raise SystemExit("the gateway closed a keep-alive connection")
            done.clear()
            proto.data_received(request_bytes(peers.GATEWAY_MODEL, tag, next(counter), token, stream))
            await done.wait()
        proto.connection_lost(None)

    async def load(total: int) -> None:
        # One bound for the whole load, not one per answer: the clients' own work counts in this process.
        async with asyncio.timeout(RUN_LIMIT_S):
            await asyncio.gather(*(connection(total // concurrency) for _ in range(concurrency)))

    if tasks_file is not None:  # a run that hangs (an answer that never completes): where does each task wait?
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks, tasks_file, statuses)
    await load(warmup)
    profiler = cProfile.Profile() if profile else None
    bytecodes = OpcodeCounter() if opcodes else None
    started_cpu, started = time.process_time(), time.perf_counter()
    for tool in (profiler, bytecodes):
        if tool is not None:
            tool.enable()
    await load(requests)
    cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started
    done = requests // concurrency * concurrency
    for tool in (profiler, bytecodes):
        if tool is not None:
            tool.disable()
    if profiler is not None:
        profiler.dump_stats(profile)
    if bytecodes is not None:
        bytecodes.dump(opcodes, done)
    misses, errors = cache_misses(app)
    await lifespan.shutdown()
    ended = statuses.pop(b"[DONE]", 0)
    if set(statuses) != {b"200"}:
        raise SystemExit(f"answers other than 200: {statuses}")
    if stream and ended != statuses[b"200"]:
        raise SystemExit(f"{statuses[b'200'] - ended} of {statuses[b'200']} streams did not end with [DONE]")
    answered = warmup // concurrency * concurrency + done
    if peer != "routing" and "cache" not in left_out(peer) and (misses != answered or errors):
        raise SystemExit(f"the cache missed {misses:.0f} of {answered} requests ({errors:.0f} Redis errors)")
    return {"cpu_us_per_req": cpu / done * 1e6, "req_per_s": done / wall}


def dump_tasks(path: str, statuses: dict[bytes, int]) -> None:
    """Every task's stack, and the answers so far, appended to ``path`` (``kill -USR1`` a hung child)."""
    with open(path, "a") as out:
        out.write(f"=== answers so far: {statuses}\n")
        for task in asyncio.all_tasks():
            out.write(f"--- {task!r}\n")
            task.print_stack(file=out)


def child(args: argparse.Namespace) -> None:
    import uvloop

    with open(os.devnull, "w") as null:  # the access log goes nowhere, as to a file nobody reads
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
    run = drive(
        args.child,
        args.health_url,
        args.requests,
        args.warmup,
        args.concurrency,
        args.profile,
        args.stream,
        tasks_file=f"{args.out}.tasks",
        opcodes=args.opcodes,
    )
    try:
        result = uvloop.run(run)
    except SystemExit as failed:  # the parent reports it: this process's output goes nowhere
        Path(args.out).write_text(json.dumps({"error": str(failed.code)}))
        raise SystemExit(1) from None
    except Exception:
        Path(args.out).write_text(json.dumps({"error": traceback.format_exc()}))
        raise SystemExit(1) from None
    Path(args.out).write_text(json.dumps(result))


def child_result(peer: str, out: Path, returncode: int, log: str = "") -> dict[str, float]:
    """What a child wrote to ``out``; a failed child's reason (and ``log``'s end) as a SystemExit."""
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() and out.stat().st_size else {}
    if returncode != 0 or "error" in result:
        reason = result.get("error", f"exit status {returncode}")
        raise SystemExit(f"{peer}: {reason}" + (f"\n{log}" if log else ""))
    return result


def run_name(peer: str, source: Path | None) -> str:
    """What a run is called in the table and in its kept profiles: ``peer``, or ``peer@base`` for the
    copy of the tree in ``--baseline-src``."""
    return f"{peer}@base" if source is not None else peer


def child_command(peer: str, out: str, requests: int, args: argparse.Namespace, health_url: str) -> list[str]:
    cmd = [sys.executable, __file__, "--child", peer, "--out", out, "--health-url", health_url]
    cmd += ["--requests", str(requests), "--warmup", str(args.warmup), "--concurrency", str(args.concurrency)]
    return [*cmd, "--stream"] if args.stream else cmd


def run_child(peer: str, source: Path | None, args: argparse.Namespace, health_url: str) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str((source or ROOT).resolve())}
        cmd = ["taskset", "-c", "0", *child_command(peer, out.name, args.requests, args, health_url)]
        if args.profile:
            cmd += ["--profile", f"{args.profile}.{run_name(peer, source)}.pstats"]
        if args.opcodes:
            cmd += ["--opcodes", f"{args.opcodes}.{run_name(peer, source)}.json"]
        done = subprocess.run(cmd, env=env, cwd=ROOT, timeout=600)
        return child_result(peer, Path(out.name), done.returncode)


def count_instructions(peer: str, source: Path | None, args: argparse.Namespace, health_url: str) -> dict[str, Any]:
    """Instructions per request, counted by valgrind (callgrind): the same peer run for ``--requests``
    and for twice as many, both under valgrind at once; the difference over the extra requests leaves
    out start-up. User space only: the kernel's share of socket calls (Redis's, here) is not counted."""
    env = {**os.environ, "PYTHONPATH": str((source or ROOT).resolve())}
    profiles = f"{args.callgrind_out}.{run_name(peer, source)}"
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for requests in (args.requests, 2 * args.requests):
            log = f"{tmp}/valgrind-{requests}.log"
            kept = f"{profiles}.{requests}.out" if args.callgrind_out else "/dev/null"
            valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={kept}", f"--log-file={log}"]
            cmd = valgrind + child_command(peer, f"{tmp}/{requests}.json", requests, args, health_url)
            runs.append((log, subprocess.Popen(cmd, env=env, cwd=ROOT)))
        counts: list[int] = []
        for (log, proc), requests in zip(runs, (args.requests, 2 * args.requests), strict=True):
            returncode = proc.wait(timeout=3600)
            text = Path(log).read_text()
            child_result(peer, Path(f"{tmp}/{requests}.json"), returncode, "" if returncode == 0 else text[-2000:])
            match = re.search(r"Collected : (\d+)", text)
            assert match is not None, f"no instruction count in {log}"
            counts.append(int(match.group(1)))
    return {"instructions_per_req": (counts[1] - counts[0]) / args.requests, "runs": counts}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, help="measured requests per run (20,000; 1,000 with --instructions)")
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, help="interleaved repetitions (5; 1 with --instructions)")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--baseline-src", type=Path, help="a copy of gateway/ and plugins/ taken before a change")
    parser.add_argument("--instructions", action="store_true", help="count instructions under valgrind instead")
    parser.add_argument(
        "--stream", action="store_true", help=f"streamed answers ({STREAM_TOKENS} tokens and the usage, one read each)"
    )
    parser.add_argument("--profile", help="write a cProfile of each peer's measured requests to PREFIX.<peer>.pstats")
    parser.add_argument(
        "--opcodes",
        metavar="PREFIX",
        help="count each peer's bytecodes by Python function into PREFIX.<peer>.json (bench/opcode_count.py)",
    )
    parser.add_argument(
        "--callgrind-out",
        metavar="PREFIX",
        help="with --instructions, keep the last repetition's profiles as PREFIX.<peer>.<requests>.out "
        "(bench/callgrind_diff.py reads them)",
    )
    parser.add_argument(
        "--by-plugin",
        action="store_true",
        help=f"add a {WITHOUT}P peer per plugin P of the production set (but routing): what each costs",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--health-url", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requests is None:
        args.requests = 1_000 if args.instructions else 20_000
    if args.reps is None:
        args.reps = 1 if args.instructions else 5
    if args.instructions:
        args.warmup = min(args.warmup, 200)
    peers = args.peers.split(",")
    if args.by_plugin:
        peers += [f"{WITHOUT}{name}" for name in optional_plugins() if f"{WITHOUT}{name}" not in peers]
    for peer in [*peers, *([args.child] if args.child else [])]:
        left_out(peer)
    args.peers = ",".join(peers)
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    import peers
    import run

    measure, metric, unit = (
        (count_instructions, "instructions_per_req", "instructions/req")
        if args.instructions
        else (run_child, "cpu_us_per_req", "CPU µs/req")
    )
    if args.stream:
        unit = unit.replace("/req", "/stream")
    runs: list[tuple[str, str, Path | None]] = []
    for peer in args.peers.split(","):
        runs.append((peer, peer, None))
        if args.baseline_src is not None:
            runs.append((run_name(peer, args.baseline_src), peer, args.baseline_src))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in runs}
    redis_url = os.environ.get("GATEWAY_REDIS_URL", "redis://127.0.0.1:6379")
    with tempfile.TemporaryDirectory() as tmp:
        mock = peers.start_mock(Path(tmp), 0.0, 16)  # answers the gateway's health checks only
        try:
            for rep in range(args.reps):  # interleaved
                for name, peer, source in runs:
                    result = measure(peer, source, args, mock.url)
                    run.delete_cache_entries(redis_url)  # each run starts from the same Redis
                    results[name].append(result)
                    totals = "".join(
                        f", {count:,} in the run of {n:,}"
                        for count, n in zip(result.get("runs", ()), (args.requests, 2 * args.requests), strict=False)
                    )
                    print(f"rep {rep + 1} {name:16s} {result[metric]:12,.1f} {unit}{totals}", flush=True)
        finally:
            mock.stop()
            run.delete_cache_entries(redis_url)
    print_table(results, metric, unit, args.reps)


def print_table(results: dict[str, list[dict[str, float]]], metric: str, unit: str, reps: int) -> None:
    """Each run's median, its repetitions and its ratio to routing only's; with peers without some
    plugins, also what those plugins cost: the production set's median minus the peer's (a run of the
    ``--baseline-src`` copy against the copy's production set)."""
    medians = {name: statistics.median(r[metric] for r in rows) for name, rows in results.items()}
    base = medians.get("routing", 0.0)
    without = any(name.startswith(WITHOUT) for name in results)
    print(
        f"\n| peer | {unit} (median of {reps}) | each repetition | x routing |" + (" left-out plugins cost |" * without)
    )
    print("|---|--:|---|--:|" + ("--:|" * without))
    for name, rows in results.items():
        ratio = f"{medians[name] / base:.2f}" if base else "-"
        each = ", ".join(f"{r[metric]:,.1f}" for r in rows)
        row = f"| {name} | {medians[name]:,.1f} | {each} | {ratio} |"
        if without:
            peer, at, source = name.partition("@")
            production = medians.get("production" + at + source)
            cost = production - medians[name] if peer.startswith(WITHOUT) and production is not None else None
            row += f" {cost:,.1f} |" if cost is not None else " - |"
        print(row)


if __name__ == "__main__":
    main()
