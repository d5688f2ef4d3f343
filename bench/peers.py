"""The processes a benchmark run starts: the mock upstream and the peers measured against it.

Every peer is a real process pinned with ``taskset`` (proxies on ``PROXY_CPU``, the mock and the load
on ``LOAD_CPU``), listening on a free loopback port, with its logs in the run's temp directory. The
gateway runs exactly as a user runs it: ``gateway serve --config <generated yaml> --no-managed-workers``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PROXY_CPU = "0"
LOAD_CPU = "1"
LITELLM = Path("/tmp/litellm-venv/bin/litellm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    """Resident set size of one process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children (nginx's worker, uvicorn's server).

    On a shared machine this is the steadiest measure of a proxy's cost: other load can delay the
    proxy (latency, req/s) but does not add to the CPU time it spends per request."""
    user, system = cpu_split(pid)
    return user + system


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its children: the system part is the kernel's work for
    the process's sockets (on loopback it includes the receiving side's), the user part its own code."""
    ticks = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        pids += [int(c) for c in task.read_text().split()]
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        user += int(fields[11]) / ticks
        system += int(fields[12]) / ticks
    return user, system


@dataclass
class Peer:
    """A running process the load is pointed at. ``mode`` is the request body mode for wrk/streams:
    ``unique`` (a new prompt each time: a cache miss) or ``fixed`` (the same prompt: a cache hit)."""

    name: str
    url: str
    model: str
    proc: subprocess.Popen[bytes] | None
    mode: str = "fixed"
    note: str = ""
    token: str = ""  # a bearer token the load must send
    log: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def _spawn(cmd: list[str], cpu: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            ["taskset", "-c", cpu, *cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120.0) -> None:
    """Poll ``url`` until it answers 200; fail early (with the log's tail) if the process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not ready within {timeout_s:g} s:\n{log.read_text()[-3000:]}")


def start_mock(tmp: Path, interval_ms: float, tokens: int, name: str = "direct") -> Peer:
    port = free_port()
    log = tmp / f"{name}.log"
    cmd = [sys.executable, str(ROOT / "bench" / "mock_upstream.py"), "--port", str(port)]
    cmd += ["--interval-ms", str(interval_ms), "--chunks", str(tokens)]
    proc = _spawn(cmd, LOAD_CPU, log)
    peer = Peer(name, f"http://127.0.0.1:{port}", "mock", proc, log=log)
    wait_ready(peer.url + "/health", proc, log)
    return peer


def start_nginx(tmp: Path, upstream_url: str) -> Peer | None:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        return None
    port = free_port()
    home = tmp / "nginx"
    home.mkdir()
    user = "user root;\n" if os.geteuid() == 0 else ""
    upstream = upstream_url.removeprefix("http://")
    (home / "nginx.conf").write_text(
        f"""{user}worker_processes 1;
daemon off;
error_log {home}/error.log warn;
pid {home}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {home}/body;
  proxy_temp_path {home}/proxy;
  fastcgi_temp_path {home}/fastcgi;
  uwsgi_temp_path {home}/uwsgi;
  scgi_temp_path {home}/scgi;
  upstream mock {{ server {upstream}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""
    )
    log = home / "stdout.log"
    proc = _spawn([binary, "-p", str(home), "-c", str(home / "nginx.conf")], PROXY_CPU, log)
    peer = Peer("nginx", f"http://127.0.0.1:{port}", "mock", proc, log=log)
    wait_ready(peer.url + "/health", proc, log)
    return peer


#: The gateway serves the mock under the default model's name, so the root config.yaml's plugin sections
#: (which name that model: routing admission, safety's tokenizer) apply as a user meets them.
GATEWAY_MODEL = "smollm2"


def gateway_config(
    upstream_url: str,
    plugins: list[dict[str, Any]],
    upstream: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "models": [{"name": GATEWAY_MODEL, "workers": [upstream_url]}],
        "plugins": plugins,
        "upstream": {"connect_timeout_s": 3, "first_byte_timeout_s": 30, "idle_timeout_s": 30, **(upstream or {})},
        "logging": {"level": "INFO", "access_log": True},
        **(extra or {}),
    }


def start_gateway(
    tmp: Path,
    name: str,
    upstream_url: str,
    plugins: list[dict[str, Any]],
    *,
    mode: str = "fixed",
    note: str = "",
    source: Path | None = None,
    upstream: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Peer:
    """``source``: run the ``gateway``/``plugins`` packages from another tree (a copy made before a
    change), so a change is measured against its baseline in the same run. ``env``: more ``GATEWAY_*``
    settings for this process. ``extra``: more top-level config sections (e.g. ``responses``)."""
    port = free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(gateway_config(upstream_url, plugins, upstream, extra), sort_keys=False))
    log = tmp / f"{name}.log"
    cmd = [str(VENV_BIN / "gateway"), "serve", "--config", str(config), "--no-managed-workers"]
    env = {**(env or {}), "GATEWAY_PORT": str(port), "GATEWAY_HOST": "127.0.0.1"}
    if source is not None:
        env["PYTHONPATH"] = str(source.resolve())
    proc = _spawn(cmd, PROXY_CPU, log, env=env)
    peer = Peer(name, f"http://127.0.0.1:{port}", GATEWAY_MODEL, proc, mode=mode, note=note, log=log)
    wait_ready(peer.url + "/ready", proc, log)
    return peer


def start_minimal_hop(tmp: Path, upstream_url: str) -> Peer:
    """uvicorn + aiohttp and nothing else (bench/minimal_hop.py): the floor for a Python hop."""
    port = free_port()
    log = tmp / "minimal-hop.log"
    cmd = [str(VENV_BIN / "uvicorn"), "--factory", "bench.minimal_hop:create_app", "--port", str(port)]
    cmd += ["--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"]
    proc = _spawn(cmd, PROXY_CPU, log, env={"UPSTREAM": upstream_url})
    peer = Peer("python-hop", f"http://127.0.0.1:{port}", "mock", proc, note="uvicorn + aiohttp", log=log)
    wait_ready(peer.url + "/health", proc, log)
    return peer


def start_litellm(tmp: Path, upstream_url: str) -> Peer | None:
    """LiteLLM's proxy from its own venv (never the project's), if it was installed there."""
    if not LITELLM.exists():
        return None
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_list": [
                    {
                        "model_name": "mock",
                        "litellm_params": {"model": "openai/mock", "api_base": upstream_url + "/v1", "api_key": "x"},
                    }
                ],
                "litellm_settings": {"drop_params": True, "telemetry": False},
            }
        )
    )
    log = tmp / "litellm.log"
    cmd = [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    token = "sk-bench-" + os.urandom(8).hex()  # LiteLLM refuses to start without a master key
    env = {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = _spawn(cmd, PROXY_CPU, log, env={**env, "LITELLM_MASTER_KEY": token})
    peer = Peer("litellm", f"http://127.0.0.1:{port}", "mock", proc, token=token, log=log)
    try:
        wait_ready(peer.url + "/health/liveliness", proc, log, timeout_s=180)
    except RuntimeError as exc:
        print(f"litellm did not start, skipping it: {str(exc)[:500]}", file=sys.stderr)
        peer.stop()
        return None
    return peer
