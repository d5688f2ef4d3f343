"""Supervision of worker processes, with a tiny fake worker (an HTTP server with /health) as the process edge."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from gateway.engine.launch import LaunchCommand
from gateway.engine.procgroup import group_members
from gateway.engine.spec import ManagedWorkerSpec
from gateway.engine.supervisor import EngineManager, EngineStartError, RestartPolicy, WorkerProcess, WorkerStartError
from tests.support.cancellation import CutAwait, stopped_when_cancelled

# Serves /health after --ready-after seconds; /crash exits with code 3; spawns a child in its group (like
# vLLM's EngineCore) and, like vLLM, takes that child down on SIGTERM unless --ignore-term.
FAKE_WORKER = textwrap.dedent(
    """
    import argparse, http.server, os, signal, subprocess, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--fail-if-exists", default="")
    p.add_argument("--ignore-term", action="store_true")
    args, _ = p.parse_known_args()
    print("fake worker booting", flush=True)
    if args.fail_if_exists and os.path.exists(args.fail_if_exists):
        print("boom: refusing to start", flush=True)
        sys.exit(2)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    def on_term(*_):
        if args.ignore_term:
            print("ignoring SIGTERM", flush=True)
            return
        child.terminate()
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/crash":
                os._exit(3)
            ok = self.path == "/health" and time.monotonic() - started >= args.ready_after
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(str(os.getpid()).encode())
        def log_message(self, *a):
            print("request", self.path, flush=True)
    http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
    """
)

FAST = RestartPolicy(initial_delay_s=0.2, max_delay_s=1.0, multiplier=2.0, stable_after_s=30.0)


@pytest.fixture
def fake_script(tmp_path: Path) -> Path:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_worker(script: Path, *args: str, events: list[tuple[str, str]] | None = None, **kw: object) -> WorkerProcess:
    port = free_port()
    command = LaunchCommand(argv=[sys.executable, str(script), "--port", str(port), *args])
    options: dict[str, object] = {"ready_timeout_s": 20.0, "stop_grace_s": 3.0, "restart": FAST, "poll_interval_s": 0.1}
    options.update(kw)
    on_event = (lambda name, event: events.append((name, event))) if events is not None else None
    return WorkerProcess("fake", command, host="127.0.0.1", port=port, on_event=on_event, **options)  # type: ignore[arg-type]


async def wait_for(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_start_ready_logs_and_stop_leave_nothing(fake_script: Path, caplog: pytest.LogCaptureFixture) -> None:
    events: list[tuple[str, str]] = []
    worker = make_worker(fake_script, "--ready-after", "0.5", events=events)
    with caplog.at_level(logging.INFO, logger="gateway.engine"):
        await worker.start()
        pid = worker.pid
        assert pid is not None and worker.state == "ready"
        assert len(group_members(pid)) == 2  # the worker and its child
        async with httpx.AsyncClient() as client:
            assert (await client.get(worker.url + "/health")).text == str(pid)
        await worker.stop()
    assert group_members(pid) == []
    assert worker.status() == {"name": "fake", "url": worker.url, "pid": None, "state": "stopped", "restarts": 0,
                               "last_exit_code": 0}  # fmt: skip
    assert "[worker fake] fake worker booting" in caplog.messages
    assert events == [("fake", "ready"), ("fake", "stopped")]
    await worker.stop()  # idempotent


async def test_crash_is_restarted_with_backoff_and_leftovers_killed(fake_script: Path) -> None:
    events: list[tuple[str, str]] = []
    worker = make_worker(fake_script, events=events)
    await worker.start()
    first = worker.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)  # the leader only: its child is left behind, as vLLM's EngineCore would be
    await wait_for(lambda: worker.state == "ready" and worker.pid not in (None, first))
    assert worker.restarts == 1 and worker.last_exit_code == -signal.SIGKILL
    assert group_members(first) == []  # the orphaned child of the crashed run was killed
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.HTTPError):
            await client.get(worker.url + "/crash")  # exits with code 3
    await wait_for(lambda: worker.restarts == 2 and worker.state == "ready")
    assert events[1:] == [("fake", e) for e in ("exited", "restarting", "ready", "restarted")] * 2
    await worker.stop()


async def test_failed_restarts_back_off_then_give_up(fake_script: Path, tmp_path: Path) -> None:
    flag = tmp_path / "broken"
    events: list[tuple[str, str]] = []
    policy = RestartPolicy(initial_delay_s=0.2, multiplier=2.0, max_delay_s=5.0, max_restarts=3)
    worker = make_worker(fake_script, "--fail-if-exists", str(flag), events=events, restart=policy)
    await worker.start()
    flag.touch()  # from now on every start fails
    started = time.monotonic()
    os.kill(worker.pid or 0, signal.SIGKILL)
    await wait_for(lambda: worker.state == "failed")
    elapsed = time.monotonic() - started
    assert 0.2 + 0.4 + 0.8 <= elapsed < 6  # delays 0.2, 0.4, 0.8 between attempts
    assert worker.restarts == 3
    assert [e for _, e in events].count("restart_failed") == 3
    assert events[-1] == ("fake", "failed")
    assert [policy.delay(n) for n in range(1, 7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0]
    await worker.stop()


async def test_port_in_use_is_refused_before_starting(fake_script: Path) -> None:
    worker = make_worker(fake_script)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", worker.port))
        squatter.listen()
        with pytest.raises(WorkerStartError, match=rf"port {worker.port} on 127.0.0.1 is already in use"):
            await worker.start()
    assert worker.pid is None and worker.state == "stopped"


async def test_exit_before_ready_reports_last_lines(fake_script: Path, tmp_path: Path) -> None:
    flag = tmp_path / "broken"
    flag.touch()
    worker = make_worker(fake_script, "--fail-if-exists", str(flag))
    with pytest.raises(WorkerStartError, match=r"exited with code 2 before it was ready(.|\n)*boom: refusing"):
        await worker.start()


async def test_ready_timeout_is_bounded_and_cleans_up(fake_script: Path) -> None:
    worker = make_worker(fake_script, "--ready-after", "60", ready_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(WorkerStartError, match=r"was not ready after 2s(.|\n)*fake worker booting"):
        await worker.start()
    assert time.monotonic() - started < 5
    assert worker._proc is not None and group_members(worker._proc.pid) == []


async def test_stop_escalates_to_sigkill(fake_script: Path) -> None:
    worker = make_worker(fake_script, "--ignore-term", stop_grace_s=1.0)
    await worker.start()
    pid = worker.pid
    started = time.monotonic()
    await worker.stop()
    assert 1.0 <= time.monotonic() - started < 5
    assert pid is not None and group_members(pid) == []
    assert worker.last_exit_code == -signal.SIGKILL


async def test_cancelled_start_leaves_nothing(fake_script: Path) -> None:
    worker = make_worker(fake_script, "--ready-after", "60")
    task = asyncio.create_task(worker.start())
    await wait_for(lambda: worker._proc is not None)
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert worker._proc is not None
    await wait_for(lambda: worker._proc is not None and group_members(worker._proc.pid) == [], 5)


def awaiting(task: asyncio.Task[None]) -> list[str]:
    """The coroutines ``task`` is suspended in, outermost first (where it waits now)."""
    names: list[str] = []
    coro: object = task.get_coro()
    while hasattr(coro, "cr_code"):
        names.append(coro.cr_code.co_name)  # type: ignore[attr-defined]
        coro = coro.cr_await  # type: ignore[attr-defined]
    return names


async def test_a_watcher_cancelled_inside_a_restart_health_probe_stops(
    fake_script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shut down while the watcher waits for a restarted worker, and the health probe it was in answers the
    cancellation with httpx's own error (a read that was cut): the readiness wait probes again after
    httpx's errors, and must stop instead of probing on with the cancellation swallowed."""
    worker = make_worker(fake_script)
    await worker.start()
    watcher = worker._watcher
    assert watcher is not None and worker.pid is not None
    cut_probe = CutAwait(lambda: httpx.ReadError("connection closed"))
    monkeypatch.setattr(httpx.AsyncClient, "get", cut_probe)
    try:
        os.kill(worker.pid, signal.SIGKILL)
        await asyncio.wait_for(cut_probe.entered.wait(), 10)  # the restart's readiness wait
        done = await stopped_when_cancelled(watcher, 3)  # what stop() does first, at shutdown
        assert cut_probe.converted, "the probe never saw the cancellation"
        assert done, "the watcher went on probing the restarted worker after it was cancelled"
    finally:
        await worker.stop()


async def test_a_watcher_cancelled_while_draining_a_crashed_run_s_output_stops(fake_script: Path) -> None:
    """Shut down while the watcher waits for a crashed run's output to be relayed: that wait takes a
    CancelledError for the output pump's own, and the watcher must not go on to restart the worker."""
    worker = make_worker(fake_script, restart=RestartPolicy(initial_delay_s=30))  # the restart would wait
    await worker.start()
    watcher, pump = worker._watcher, worker._pump
    assert watcher is not None and pump is not None and worker.pid is not None
    worker._pump = asyncio.create_task(asyncio.sleep(30))  # output that takes its time to be relayed
    try:
        os.kill(worker.pid, signal.SIGKILL)
        await wait_for(lambda: "_drain_output" in awaiting(watcher), 10)
        done = await stopped_when_cancelled(watcher, 2)  # what stop() does first, at shutdown
        assert done, "the watcher went on to restart the worker after it was cancelled"
    finally:
        await worker.stop()
        await asyncio.wait_for(pump, 5)  # the crashed run's own pump ends with its output


def test_workers_die_with_the_gateway(fake_script: Path, tmp_path: Path) -> None:
    """SIGKILL a process that supervises a worker: the kernel SIGTERMs the worker, which takes its child."""
    port = free_port()
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from gateway.engine.launch import LaunchCommand
        from gateway.engine.supervisor import WorkerProcess
        async def main():
            w = WorkerProcess("fake", LaunchCommand([sys.executable, {str(fake_script)!r}, "--port", "{port}"]),
                              host="127.0.0.1", port={port}, poll_interval_s=0.1)
            await w.start()
            print(w.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stdout is not None
            worker_pid = int(proc.stdout.readline())
            assert len(group_members(worker_pid)) == 2
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 10
            while group_members(worker_pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert group_members(worker_pid) == []
        finally:
            proc.kill()


def write_fake_model(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"0")
    (directory / "tokenizer.json").write_text("{}")
    return directory


def fake_python(tmp_path: Path, script: Path, *extra: str) -> str:
    """An 'interpreter' that runs the fake worker whatever vLLM argv it is given."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@" {" ".join(extra)}\n')
    python.chmod(0o755)
    return str(python)


async def test_engine_manager_starts_reports_and_stops(fake_script: Path, tmp_path: Path) -> None:
    model = write_fake_model(tmp_path / "my-model")
    python = fake_python(tmp_path, fake_script)
    specs = [
        ManagedWorkerSpec(name=f"w{i}", model=str(model), port=free_port(), python=python, served_model_name="m")
        for i in range(2)
    ]
    events: list[tuple[str, str]] = []
    engine = EngineManager(specs, tmp_path / "models", on_event=lambda n, e: events.append((n, e)), stop_grace_s=2)
    async with engine:
        status = engine.status()
        assert [(s["name"], s["state"], s["model"], s["restarts"]) for s in status] == [
            ("w0", "ready", "m", 0), ("w1", "ready", "m", 0),
        ]  # fmt: skip
        assert status[0]["url"] == specs[0].url
        pids = [int(str(s["pid"])) for s in status]
        command = engine.workers["w0"].command
        assert command.argv[command.argv.index("--model") + 1] == str(model)
        assert command.env["HF_HUB_OFFLINE"] == "1"
    assert all(group_members(pid) == [] for pid in pids)
    assert [s["state"] for s in engine.status()] == ["stopped", "stopped"]
    assert sorted(events) == sorted([(n, e) for n in ("w0", "w1") for e in ("ready", "stopped")])


async def test_engine_manager_failed_start_stops_the_others(fake_script: Path, tmp_path: Path) -> None:
    model = write_fake_model(tmp_path / "my-model")
    good = ManagedWorkerSpec(name="good", model=str(model), port=free_port(), python=fake_python(tmp_path, fake_script))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        busy = ManagedWorkerSpec(name="busy", model=str(model), port=squatter.getsockname()[1], python=good.python)
        engine = EngineManager([good, busy], tmp_path / "models", stop_grace_s=2)
        with pytest.raises(EngineStartError, match=r"1 of 2 managed workers did not start(.|\n)*already in use"):
            await engine.start()
    assert {s["name"]: s["state"] for s in engine.status()} == {"good": "stopped", "busy": "stopped"}
