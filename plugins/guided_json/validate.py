"""Checking every answer against its constraint, and what an invalid answer turns into.

Guided decoding makes every *prefix* valid, not the whole answer: output cut by ``max_tokens`` is not
valid JSON even when decoding was guided. So every choice of every answer (non-streamed, or assembled
from a stream) is checked. What an invalid one becomes:

- cut by the token limit (finish_reason ``length``): returned as it is, as OpenAI does (the partial
  text, ``finish_reason: "length"``; the SDK's ``parse()`` raises ``LengthFinishReasonError``). The
  client's ``max_tokens`` / ``max_completion_tokens`` is never exceeded; only when the client set no
  limit, under the ``retry`` policy, is a non-streamed answer asked for once more with a budget that
  still fits the model's context (``retry_budget``);
- complete but not valid (a keyword the engine does not enforce, such as ``multipleOf``; a forced tool
  call whose arguments its function's schema refuses, see ``tool_calls``): a 422 ``guided_output_invalid``.
  Not a 5xx: the same request would get the same answer, and the SDKs retry 5xx answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.wire.errors import GatewayError, UnprocessableEntity
from plugins.guided_json.compile import Compiled


@dataclass(frozen=True, slots=True)
class Problem:
    index: int
    finish_reason: str | None
    message: str

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def _text(choice: dict[str, Any]) -> str | None:
    message = choice.get("message")
    if isinstance(message, dict):
        content = message.get("content")
        return content if isinstance(content, str) else None
    text = choice.get("text")
    return text if isinstance(text, str) else None


#: A choice of the worker's answer that is not an object.
MALFORMED_CHOICE = "the worker's answer has a malformed choice"


def choice_problems(response: dict[str, Any], problem_of: Callable[[dict[str, Any]], str | None]) -> list[Problem]:
    """Every choice of ``response`` that ``problem_of`` finds fault with (empty when none), one problem a
    choice: the loop the output constraint's check and the forced tool calls' check share."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return [Problem(0, None, "the worker's answer has no choices")]
    problems: list[Problem] = []
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            problems.append(Problem(position, None, MALFORMED_CHOICE))
            continue
        problem = problem_of(choice)
        if problem is not None:
            problems.append(Problem(choice.get("index", position), choice.get("finish_reason"), problem))
    return problems


def find_problems(compiled: Compiled, response: dict[str, Any]) -> list[Problem]:
    """Every choice whose text does not satisfy ``compiled`` (empty when all do)."""

    def problem_of(choice: dict[str, Any]) -> str | None:
        text = _text(choice)
        return "the answer has no text" if text is None else compiled.check(text)

    return choice_problems(response, problem_of)


def find_problem(compiled: Compiled, response: dict[str, Any]) -> Problem | None:
    """The first choice whose text does not satisfy ``compiled``, or None when all do."""
    problems = find_problems(compiled, response)
    return problems[0] if problems else None


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def retry_budget(body: dict[str, Any], usage: Any, *, max_model_len: int | None, cap: int) -> int | None:
    """A ``max_tokens`` for one more try of an answer cut without a client limit, or None.

    Never when the client set a limit (it is a hard cap, as at OpenAI). Otherwise the budget is
    ``cap`` within the model's context (``max_model_len`` minus the prompt), and only worth a try when
    it is larger than what the cut answer already used (vLLM's own default is the rest of the
    context, so an answer cut there has no room to grow)."""
    if requested_max_tokens(body) is not None:
        return None
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    used = usage.get("completion_tokens") if isinstance(usage, dict) else None
    limit = cap
    if max_model_len is not None:
        if not isinstance(prompt, int):
            return None  # the room left in the context is unknown
        limit = min(limit, max_model_len - prompt)
    if not isinstance(used, int) or limit <= used:
        return None
    return limit


def with_budget(body: dict[str, Any], budget: int) -> dict[str, Any]:
    out = dict(body)
    out["max_tokens"] = budget
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def error_for(problem: Problem, kind: str = "json") -> GatewayError:
    """A complete answer that fails validation (``kind``: the constraint's, or "tools" for a forced tool
    call's arguments). Under a JSON schema the engine enforced its structure,
    so what failed is a keyword only checked afterwards; a regex or a choice list is enforced whole, so
    the worker did not enforce it. Either way the same request would most likely fail the same way."""
    where = f"choice {problem.index}" if problem.index else "the answer"
    finish = problem.finish_reason or "none"
    if kind == "json":
        why = (
            "The engine enforces the schema's structure, types, enums, string lengths and patterns and numeric"
            " bounds while decoding; other keywords are only checked afterwards, so this request would fail"
            " the same way again. Loosen the schema or ask for the value in the prompt."
        )
    elif kind == "tools":
        why = (
            "With tool_choice forcing a function, the worker decodes each call's arguments under the function's"
            " parameters schema; a call that fails it was not so decoded, or fails a keyword only checked"
            " afterwards, so this request would most likely fail the same way again."
        )
    else:
        why = f"The worker did not enforce the {kind} constraint; sending it again will not help."
    return UnprocessableEntity(
        f"The model's output did not satisfy the requested constraint (finish_reason: {finish}): {where}:"
        f" {problem.message}. {why}",
        code="guided_output_invalid",
        headers={"x-should-retry": "false"},
    )
