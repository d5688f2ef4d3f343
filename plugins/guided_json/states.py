"""Counting a regex's automaton states in a child process that ends when it overruns its budget.

Building the automaton is not interruptible from Python and can grow exponentially: ``(a|b)*a(a|b){24}``
needs 2**24 states (outlines takes about 13 s for 2**18 and hours, and gigabytes, for 2**24). Run in
the gateway's compile thread, one such request pinned that thread and its memory long after the
request had been refused for taking too long, and every later constraint waited behind it. In a
child process the overrun is ended with the process: the budget holds for time and memory alike.

The budget is the child's own CPU time (``ITIMER_PROF``, whose signal ends the process), not the
wall-clock time it takes: on a busy machine (other requests, other processes on the core) a small
regex's count can take seconds of wall-clock time, and a refusal of it as "too complex" would be
remembered and given to every later request with that constraint. A count that still has no answer
after ``wall_s`` (the machine is that busy) is ``CompilerBusy``: no verdict on the regex.

Children come from a forkserver that preloads only ``outlines_core``, so starting one costs a few
milliseconds (compiled constraints are cached, so this is paid once per distinct constraint).
"""

from __future__ import annotations

import multiprocessing
import signal
from multiprocessing.connection import Connection
from typing import Any


class CompilerBusy(Exception):
    """The count got less CPU than its budget within its wall-clock bound: the machine is too busy to
    say whether the regex is too complex (a verdict not to remember)."""


def _count(regex: str, conn: Connection, cpu_s: float) -> None:
    """Child process: send the number of states, or ("error", message) when outlines refuses it; ended
    by SIGPROF (its default action) once it has used ``cpu_s`` of CPU."""
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    import outlines_core

    try:
        # Byte tokens 1..255 (0 is the end token): the index then has one state per automaton state.
        alphabet = outlines_core.Vocabulary(0, {bytes([i]): [i] for i in range(1, 256)})
        conn.send(len(outlines_core.Index(regex, alphabet).get_transitions()))
    except ValueError as exc:
        conn.send(("error", str(exc)[:300]))
    finally:
        conn.close()


def _context() -> Any:
    # multiprocessing keeps one forkserver per process; the preload list matters only before it starts.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["outlines_core", "plugins.guided_json.states"])
    return context


def start_server() -> None:
    """Start the forkserver (and its ``outlines_core`` import, about a second) ahead of the first
    compile, so that cost never counts against a request's budget. Blocking: call it in a thread."""
    _context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


def count_states(regex: str, cpu_s: float, wall_s: float) -> int | str:
    """The automaton's state count; a string (why) when outlines refuses the regex; TimeoutError when
    building it takes more than ``cpu_s`` of the child's CPU (the child ends itself); ``CompilerBusy``
    when it has no answer after ``wall_s`` (the child is killed). Blocking: call it in a thread."""
    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_count, args=(regex, sender, cpu_s), daemon=True)
    child.start()
    sender.close()
    try:
        if not receiver.poll(wall_s):
            raise CompilerBusy
        result = receiver.recv()
    except EOFError:
        result = None  # the child ended without an answer: its exit code says why
    finally:
        receiver.close()
        if child.is_alive():
            child.kill()
        child.join(timeout=5)
    if result is None:
        if child.exitcode == -signal.SIGPROF:
            raise TimeoutError
        return "outlines failed while compiling it"
    if isinstance(result, tuple):
        return str(result[1])
    return int(result)
