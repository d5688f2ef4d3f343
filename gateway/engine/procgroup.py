"""Process-group plumbing for workers: no orphans, whatever happens to the gateway or the worker.

A vLLM server is a tree (API server, EngineCore, CPU worker, multiprocessing resource tracker). When only
the API server is killed the others keep running and keep the memory, so a worker is always handled as
its process group:

- it is started in a new session, so its group id is its pid and it holds no terminal signals of ours;
- ``die_with_parent`` wraps its argv so that, before ``exec``-ing vLLM, the process asks the kernel
  (``prctl(PR_SET_PDEATHSIG, SIGTERM)``) to be sent SIGTERM when the gateway dies, even by SIGKILL; vLLM
  then shuts down its own children. The setting survives ``exec`` and ``setsid``. It fires when the
  *thread* that forked the worker ends, so start workers from the event loop's thread (as asyncio does);
- ``terminate_group`` stops the whole group: SIGTERM, a grace period, then SIGKILL to what is left.

Linux only (``prctl`` and ``/proc``), like vLLM's CPU and GPU builds.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1

# Runs in the worker's own process, then replaces itself with the worker (same pid, same group).
_DEATHSIG_EXEC = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]), 0, 0, 0) != 0:\n"
    "    sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit('the gateway exited before the worker started')\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def die_with_parent(argv: Sequence[str], sig: int = signal.SIGTERM, *, python: str = sys.executable) -> list[str]:
    """``argv`` wrapped so the process receives ``sig`` when the calling process dies."""
    return [python, "-c", _DEATHSIG_EXEC, str(int(sig)), str(os.getpid()), *argv]


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``host:port`` (a socket only in TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids in process group ``pgid``, read from ``/proc``."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when it no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left, or the pgid was reused by someone else's group
        return False
    return True


async def wait_group_gone(pgid: int, timeout_s: float, interval_s: float = 0.1) -> bool:
    """Wait until no live process is left in ``pgid``; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


async def wait_exit(proc: asyncio.subprocess.Process, timeout_s: float | None = None, interval_s: float = 0.1) -> bool:
    """Wait until ``proc`` has exited; False on timeout.

    Not ``proc.wait()``: asyncio resolves that only once the output pipe is closed too, and children left
    behind by a crashed worker keep it open.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while proc.returncode is None:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


async def terminate_group(pgid: int, leader: asyncio.subprocess.Process | None, grace_s: float) -> None:
    """SIGTERM the group, wait up to ``grace_s`` for it to exit, then SIGKILL whatever is left.

    ``leader`` (the group's first process, our child) is reaped so it leaves no zombie.
    """
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    if leader is not None:
        await wait_exit(leader, grace_s)
    if not await wait_group_gone(pgid, max(0.0, deadline - time.monotonic())):
        signal_group(pgid, signal.SIGKILL)
        await wait_group_gone(pgid, 5.0)
    if leader is not None:
        await wait_exit(leader, 5.0)


def kill_group_now(pgid: int) -> None:
    """SIGKILL the group without waiting: for clean-up paths that cannot await (a cancelled start)."""
    signal_group(pgid, signal.SIGKILL)
