"""Checking every answer against its constraint, and what an invalid answer turns into.

Guided decoding makes every *prefix* valid, not the whole answer: output cut by ``max_tokens`` is not
valid JSON even when decoding was guided. So every choice of every answer (non-streamed, or assembled
from a stream) is checked. What an invalid one becomes:

- cut by ``max_tokens`` (finish_reason ``length``): a 400 naming ``max_tokens`` (the client's budget was
  too small), after one retry with a larger budget under the ``retry`` policy;
- anything else: a 502, since a worker that enforces the constraint cannot produce it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.wire.errors import BadGateway, GatewayError, InvalidRequest
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


def find_problem(compiled: Compiled, response: dict[str, Any]) -> Problem | None:
    """The first choice whose text does not satisfy ``compiled``, or None when all do."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return Problem(0, None, "the worker's answer has no choices")
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            return Problem(position, None, "the worker's answer has a malformed choice")
        index = choice.get("index", position)
        finish = choice.get("finish_reason")
        text = _text(choice)
        if text is None:
            return Problem(index, finish, "the answer has no text")
        problem = compiled.check(text)
        if problem is not None:
            return Problem(index, finish, problem)
    return None


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def retry_budget(body: dict[str, Any], usage: Any, *, max_model_len: int | None, cap: int) -> int | None:
    """A larger ``max_tokens`` for one more try (double, within ``cap`` and the model's context), or None
    when there is no room to grow (no explicit budget means vLLM already used all the context)."""
    current = requested_max_tokens(body)
    if current is None:
        return None
    limit = cap
    if max_model_len is not None:
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        limit = min(limit, max_model_len - (prompt if isinstance(prompt, int) else 0))
    budget = min(max(current * 2, current + 64), limit)
    return budget if budget > current else None


def with_budget(body: dict[str, Any], budget: int) -> dict[str, Any]:
    out = dict(body)
    out["max_completion_tokens" if "max_completion_tokens" in out else "max_tokens"] = budget
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def error_for(problem: Problem, body: dict[str, Any], *, retried_with: int | None = None) -> GatewayError:
    where = f"choice {problem.index}" if problem.index else "the answer"
    finish = problem.finish_reason or "none"
    if problem.truncated:
        budget = requested_max_tokens(body)
        tried = f" (a retry with max_tokens={retried_with} was cut too)" if retried_with else ""
        return InvalidRequest(
            f"The output constraint could not be met: {where} was cut by max_tokens"
            f"{'=' + str(budget) if budget is not None else ''} before it was complete"
            f" (finish_reason: length){tried}: {problem.message}. Raise max_tokens.",
            param="max_tokens",
            code="guided_output_truncated",
        )
    return BadGateway(
        f"The model's output did not satisfy the requested constraint (finish_reason: {finish}): {problem.message}.",
        code="guided_output_invalid",
    )
