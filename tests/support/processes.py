"""Finding and killing the processes behind workers (no tests here): the pid listening on a worker's
port, read from /proc (Linux), so a test can SIGKILL a real vLLM worker whether the gateway's engine
supervisor started it or a person did."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from urllib.parse import urlsplit


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    return inodes


def listening_pid(url: str) -> int | None:
    """The pid of the process listening on ``url``'s port, or None."""
    port = urlsplit(url).port
    if port is None:
        return None
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        return int(proc.name)
    return None


def kill_worker(url: str) -> int:
    """SIGKILL the worker serving ``url``, with its process group when it leads one (a vLLM worker's
    engine core is its child): the kernel resets every connection it held. Returns the pid."""
    pid = listening_pid(url)
    if pid is None:
        raise RuntimeError(f"no process listens on {url}")
    if os.getpgid(pid) == pid:
        os.killpg(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)
    return pid
