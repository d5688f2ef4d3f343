"""Compiling constraints with outlines at the gateway, under a time and size budget, with a bounded LRU.

A JSON schema becomes a regex with ``outlines_core.json_schema.build_regex_from_schema`` (the same
function vLLM's outlines backend uses, but with bounded whitespace and free-form parts bounded), and
every regex is compiled into an ``outlines_core.Index`` over a byte alphabet. That index is the part
that explodes (the regex-to-automaton step; the worker then multiplies it by its vocabulary), so its
state count and build time are what the budgets bound. An explosive constraint is refused here with a
400 instead of stalling or crashing a worker.

Compiles run in one dedicated thread (outlines releases the GIL) so the event loop never blocks. The
budget (``compile_timeout_ms``) is CPU time, spent by the automaton's count in a child process
(``plugins.guided_json.states``): a constraint that overruns it is refused as too complex, whatever
else the machine is doing. Wall-clock time only bounds how long a request waits (``WALL_FACTOR`` times
the budget, for its turn and for its compile): past that it gets 503 ``guided_compiler_busy`` with a
retry-after, and the compile goes on, its result kept for the retry. A busy machine is no verdict on a
constraint: a refusal for wall-clock time, once remembered, refused a small schema to every later
request. Results, refusals included, are kept in an LRU keyed by the constraint's hash: a repeated
schema costs one hash and one dict lookup.

With tenancy, a tenant has at most ``max_compiles_per_tenant`` new constraints compiling or queued at
once; a further new one is refused at once with the same 503, not queued: one client's stream of
distinct slow schemas used to fill the thread's queue, and another tenant's harmless schema waited its
5x budget behind them and got the 503. A tenant's slot is held by the compile itself (not by the waiting
request, which may give up or disconnect while the compile goes on) and freed when that compile ends,
however it ends. Joining a compile already under way, or a cached constraint, needs no slot.
"""

from __future__ import annotations

import asyncio
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from re import _constants as sre_c  # type: ignore[attr-defined,unused-ignore]  # typed by newer typesheds
from re import _parser as sre_parse  # type: ignore[attr-defined,unused-ignore]
from typing import Any

import orjson
from outlines_core.json_schema import build_regex_from_schema

from gateway.wire.errors import InvalidRequest, ServiceUnavailable
from plugins.guided_json.bounds import BoundsPusher
from plugins.guided_json.config import GuidedJSONConfig
from plugins.guided_json.forms import Constraint
from plugins.guided_json.patterns import compile_pattern, linear_validator, utf8
from plugins.guided_json.schemas import GENERIC_OBJECT, SchemaProblem, bound_free_form, check_structure, validator
from plugins.guided_json.states import CompilerBusy, count_states, start_server

#: How many times its CPU budget a request waits for a compile, in wall-clock time (for its turn, then
#: for the compile): a count of a few CPU seconds still has its answer with the core shared five ways.
WALL_FACTOR = 5

#: Checks one answer's text; returns what is wrong with it, or None when it satisfies the constraint.
Checker = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class Compiled:
    """A constraint ready to send (``upstream`` is the ``structured_outputs`` value) and to check."""

    kind: str
    upstream: dict[str, Any]
    check: Checker
    states: int
    compile_ms: float


def _expanded_size(items: Any) -> int:
    """An upper estimate of the automaton a regex needs, counting repetitions (``a{100000}``) at full
    size: computed in microseconds, it refuses counted-repetition bombs before outlines sees them."""
    total = 0
    for op, av in items:
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            low, high, sub = av
            total += max(1, high if high != sre_c.MAXREPEAT else low + 1) * _expanded_size(sub)
        elif op is sre_c.SUBPATTERN:
            total += _expanded_size(av[-1])
        elif op is sre_c.BRANCH:
            total += sum(_expanded_size(branch) for branch in av[1])
        else:
            total += 1
    return total


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a constraint cannot be enforced, and the error code that says so; remembered like a result."""

    reason: str
    code: str = "invalid_guided_request"


class Compiler:
    """Turns a ``Constraint`` into a ``Compiled`` synchronously (call it in a worker thread)."""

    def __init__(self, config: GuidedJSONConfig) -> None:
        self.config = config

    def __call__(self, constraint: Constraint) -> Compiled:
        started = time.perf_counter()
        if constraint.kind == "json":
            regex, check = self._json(constraint)
            upstream: dict[str, Any] = {"regex": regex}
        elif constraint.kind == "regex":
            regex, check = self._regex(constraint.value)
            upstream = {"regex": regex}
        elif constraint.kind == "choice":
            regex, check = self._choice(constraint.value)
            upstream = {"choice": constraint.value}
        else:
            raise SchemaProblem(
                "grammar constraints are not supported by the workers' outlines backend;"
                " ask for a JSON schema, a regex or a list of choices instead"
            )
        states = self._states(regex)
        return Compiled(constraint.kind, upstream, check, states, (time.perf_counter() - started) * 1000)

    def _json(self, constraint: Constraint) -> tuple[str, Checker]:
        cfg = self.config
        schema = constraint.value
        if schema is None:  # json_object: any JSON object
            checker = validator({"type": "object"})
            decoding: dict[str, Any] = GENERIC_OBJECT
        else:
            size = len(orjson.dumps(schema))
            if size > cfg.max_schema_bytes:
                raise SchemaProblem(f"it is too large: {size} bytes (the limit is {cfg.max_schema_bytes})")
            checker = linear_validator(schema)
            check_structure(schema, cfg.max_schema_nodes)
            decoding = bound_free_form(schema)
        whitespace = constraint.whitespace if constraint.whitespace is not None else cfg.whitespace_pattern
        bounds = BoundsPusher(secrets.token_hex(4))
        pushed = bounds.rewrite(decoding)
        try:
            regex = build_regex_from_schema(orjson.dumps(pushed).decode(), whitespace)
        except Exception as exc:  # outlines raises plain ValueErrors naming the unsupported part
            raise SchemaProblem(f"outlines cannot turn it into a constraint: {exc}") from None
        regex = bounds.fill(regex)
        if any(name in regex for name in bounds.regexes):  # not emitted verbatim: bounds validated only
            regex = build_regex_from_schema(orjson.dumps(decoding).decode(), whitespace)
        self._check_regex_size(regex)

        def check(text: str) -> str | None:
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                return f"the answer is not valid JSON ({exc})"
            errors = sorted(checker.iter_errors(value), key=lambda e: len(e.path))
            if errors:
                err = errors[0]
                where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
                return f"the answer does not match the schema at {where}: {err.message}"
            return None

        return regex, check

    def _regex(self, pattern: str) -> tuple[str, Checker]:
        compiled = compile_pattern(pattern, "it")  # RE2: an answer is checked in linear time
        self._check_regex_size(pattern)

        def check(text: str) -> str | None:
            if compiled.fullmatch(utf8(text)) is None:
                return "the answer does not match the regular expression"
            return None

        return pattern, check

    def _choice(self, choices: list[str]) -> tuple[str, Checker]:
        if len(choices) > self.config.max_choices:
            raise SchemaProblem(f"it has {len(choices)} choices (the limit is {self.config.max_choices})")
        allowed = frozenset(choices)
        regex = "(" + "|".join(re.escape(c) for c in choices) + ")"
        self._check_regex_size(regex)

        def check(text: str) -> str | None:
            return None if text in allowed else "the answer is not one of the choices"

        return regex, check

    def _check_regex_size(self, regex: str) -> None:
        cfg = self.config
        if len(regex) > cfg.max_regex_chars:
            raise SchemaProblem(f"it compiles to a {len(regex)}-character regex (the limit is {cfg.max_regex_chars})")
        try:
            size = _expanded_size(sre_parse.parse(regex))
        except (re.error, RecursionError, OverflowError):
            return  # outlines' own parser has the final word below
        if size > cfg.max_states * 4:
            raise SchemaProblem(f"it needs an automaton of about {size} states (the limit is {cfg.max_states})")

    def _states(self, regex: str) -> int:
        # In a child process: an automaton that explodes is ended with it (plugins.guided_json.states).
        budget_s = self.config.compile_budget_s
        try:
            states = count_states(regex, budget_s, WALL_FACTOR * budget_s)
        except TimeoutError:
            raise SchemaProblem(
                f"it is too complex: compiling it needs more than {self.config.compile_timeout_ms:g} ms of CPU"
            ) from None
        if isinstance(states, str):
            raise SchemaProblem(f"outlines cannot compile it: {states}")
        if states > self.config.max_states:
            raise SchemaProblem(f"it compiles to {states} automaton states (the limit is {self.config.max_states})")
        return states


class CompileCache:
    """Compiled constraints and refusals by hash (bounded LRU), and the thread that compiles new ones.

    Lives in ``services.shared`` so it survives config reloads; a reload with different budgets starts
    it afresh (a schema refused under old budgets may pass new ones).
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[str, Compiled | Refusal] = OrderedDict()
        self._pending: dict[str, asyncio.Task[Compiled | Refusal]] = {}
        # tenant -> the wait deadlines (loop time) of its compiles queued or running; a tenant is removed
        # at none, so this holds no more entries than there are compiles in flight
        self._per_tenant: dict[str, list[float]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guided-json-compile")
        self._config: GuidedJSONConfig | None = None
        self._compiler: Compiler | None = None

    def configure(self, config: GuidedJSONConfig) -> None:
        if self._config is None:
            self._executor.submit(start_server)  # in the compile thread: the event loop never waits
        if config != self._config:
            self._config = config
            self._compiler = Compiler(config)
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> Compiled | Refusal | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    async def get(self, constraint: Constraint, tenant: str | None = None) -> tuple[Compiled, bool]:
        """The compiled constraint and whether it came from the cache; ``InvalidRequest`` if refused.

        ``tenant`` (None without tenancy) is charged a slot only when a new compile must start; at its
        ``max_compiles_per_tenant`` that is refused at once with ``ServiceUnavailable`` (guided_compiler_busy).
        """
        config, compiler = self._config, self._compiler
        assert config is not None and compiler is not None, "configure() first"
        key = constraint.key(config.whitespace_pattern)
        entry = self.lookup(key)
        hit = entry is not None
        if entry is None:
            task = self._pending.get(key)
            if task is None:
                task = self._start(compiler, constraint, key, tenant)
            try:
                entry = await asyncio.wait_for(asyncio.shield(task), WALL_FACTOR * config.compile_budget_s)
            except TimeoutError:  # the compile goes on (shielded), and its result is kept for the retry
                raise _busy(config.compile_budget_s) from None
        if isinstance(entry, Refusal):
            what = "regular expression" if constraint.kind == "regex" else f"{constraint.kind} constraint"
            if constraint.kind == "json":
                what = "JSON schema"
            raise InvalidRequest(
                f"The {what} in '{constraint.param}' cannot be enforced: {entry.reason}.",
                param=constraint.field,
                code=entry.code,
            )
        return entry, hit

    def _start(
        self, compiler: Compiler, constraint: Constraint, key: str, tenant: str | None
    ) -> asyncio.Task[Compiled | Refusal]:
        """Start compiling ``constraint`` under ``key``, holding one of ``tenant``'s slots until it ends.

        A tenant refused a slot is told to retry when its oldest compile's waiting request gives up
        (``WALL_FACTOR`` x budget from its start), by which time that compile has usually ended: a
        retry after 1 s, while the compile holding the slot may run 5x a budget of seconds, only
        spends the client's retries on more refusals."""
        budget_s = compiler.config.compile_budget_s
        now = asyncio.get_running_loop().time()
        deadline = now + WALL_FACTOR * budget_s
        if tenant is not None:
            deadlines = self._per_tenant.get(tenant, [])
            if len(deadlines) >= compiler.config.max_compiles_per_tenant:
                left = min(deadlines) - now
                raise _busy(
                    left if left > 0 else budget_s, "Another new output constraint of yours is still being compiled"
                )
            self._per_tenant[tenant] = [*deadlines, deadline]
        task = asyncio.create_task(self._compile(compiler, constraint, key))
        self._pending[key] = task
        # A done callback, not a finally in _compile: it runs however the task ends, even when it is
        # cancelled before its first step (a finally would not run then, and the slot would leak).
        task.add_done_callback(lambda _t: self._ended(key, tenant, deadline))
        return task

    def _ended(self, key: str, tenant: str | None, deadline: float) -> None:
        self._pending.pop(key, None)
        if tenant is not None:
            deadlines = self._per_tenant.pop(tenant, [])
            deadlines.remove(deadline)
            if deadlines:
                self._per_tenant[tenant] = deadlines

    async def _compile(self, compiler: Compiler, constraint: Constraint, key: str) -> Compiled | Refusal:
        """Compile in the thread and remember the outcome; ``ServiceUnavailable`` (not remembered) when
        the thread does not take it up in time, or the machine is too busy for a verdict."""
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def job() -> Compiled:
            loop.call_soon_threadsafe(started.set)
            return compiler(constraint)

        future = asyncio.wrap_future(self._executor.submit(job))
        budget_s = compiler.config.compile_budget_s
        try:
            # Waiting behind another compile does not count against this schema's budget
            async with asyncio.timeout(WALL_FACTOR * budget_s):
                await started.wait()
        except TimeoutError:
            future.cancel()
            raise _busy(budget_s) from None
        try:
            result: Compiled | Refusal = await future
        except SchemaProblem as problem:
            result = Refusal(str(problem), problem.code)
        except CompilerBusy:
            raise _busy(budget_s) from None
        self._remember(key, result)
        return result

    def _remember(self, key: str, entry: Compiled | Refusal) -> None:
        assert self._config is not None
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self._config.cache_size:
            self._entries.popitem(last=False)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _busy(retry_after_s: float, why: str = "The gateway is busy compiling output constraints") -> ServiceUnavailable:
    """The 503 ``guided_compiler_busy``, with ``retry-after`` in whole seconds (at least 1)."""
    return ServiceUnavailable(
        f"{why}; try again shortly.",
        code="guided_compiler_busy",
        headers={"retry-after": str(max(1, math.ceil(retry_after_s)))},
    )
