"""Checking the tool calls of an answer whose ``tool_choice`` forced one, against the called function's
``parameters`` schema.

A forcing ``tool_choice`` (a named function, or ``"required"``) makes the worker decode each call's
arguments under the function's schema, as guided output; a worker that ignores it (or a model served
without guided decoding) would hand the client arguments its code then fails on. So every choice of such
an answer (non-streamed, or assembled from a stream, where a call's arguments arrive in pieces per
tool-call index) must carry at least one tool call, each naming a function the ``tool_choice`` allows,
its ``arguments`` JSON that the function's ``parameters`` schema accepts: the same checker a
``response_format`` answer goes through (``Compiled.check``). A function defined more than once (the
worker takes one of them) accepts what any of its definitions accepts; one with no ``parameters``, any
JSON.

A choice cut by the token limit (finish_reason ``length``) is reported as truncated: it is returned as it
is, as a cut ``response_format`` answer is. ``tool_choice: "auto"`` is not checked at all: the model may
answer in text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from plugins.guided_json.compile import Checker
from plugins.guided_json.validate import MALFORMED_CHOICE, Problem, choice_problems


def _any_json(text: str) -> str | None:
    """The check of a function with no ``parameters`` schema."""
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return f"the answer is not valid JSON ({exc})"
    return None


@dataclass(frozen=True, slots=True)
class ForcedCalls:
    """The functions a forced call may name, each with the checks of its definitions (one per definition;
    None: no ``parameters`` schema)."""

    allowed: dict[str, tuple[Checker | None, ...]]

    def call_problem(self, position: int, call: Any) -> str | None:
        """What is wrong with one tool call of an answer, or None."""
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        where = f"tool call {position}"
        if not isinstance(name, str) or name not in self.allowed:
            shown = orjson.dumps(name).decode()[:100] if name is not None else "no function"
            return f"{where} names {shown}, which is not a function the request's tool_choice allows"
        assert isinstance(function, dict)
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            return f"{where} ({name}) has no arguments string"
        first = None
        for check in self.allowed[name]:
            problem = (check or _any_json)(arguments)
            if problem is None:
                return None
            first = first or problem
        return f"{where} ({name}), its arguments: {first}"


def find_call_problems(calls: ForcedCalls, response: dict[str, Any]) -> list[Problem]:
    """Every choice whose tool calls do not satisfy ``calls`` (empty when all do); one problem a choice."""

    def problem_of(choice: dict[str, Any]) -> str | None:
        message = choice.get("message")
        if not isinstance(message, dict):
            return MALFORMED_CHOICE
        made = message.get("tool_calls")
        if not isinstance(made, list) or not made:
            return "the answer has no tool call, though tool_choice forces one"
        return next((p for p in (calls.call_problem(i, call) for i, call in enumerate(made)) if p), None)

    return choice_problems(response, problem_of)
