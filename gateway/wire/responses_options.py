"""The options of a Responses request that shape generation rather than the conversation, checked, and
what each becomes: a chat completions field for the worker, a value echoed on the Response, or a
refusal naming the field and why (the table in docs/responses.md).

- ``reasoning.effort`` -> chat ``reasoning_effort`` (vLLM hands it to the chat template; templates of
  models that do not reason ignore it); ``reasoning.summary`` is refused: no worker writes summaries.
- ``text.verbosity`` -> chat ``verbosity`` (passed on; vLLM's chat endpoint accepts it, and models that
  do not read it ignore it).
- ``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` -> chat ``logprobs`` /
  ``top_logprobs``; the answer's logprobs come back on the ``output_text`` parts and deltas.
- ``max_tool_calls``: bounds calls to built-in tools (OpenAI's meaning), of which there are none here;
  echoed. ``truncation``: ``auto`` drops the oldest turns to fit the context (``gateway.proxy.responses_fit``).
- ``prompt_cache_retention``: echoed; vLLM's prefix cache keeps what memory allows, whatever is asked.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.wire.responses_items import bad, unsupported

LOGPROBS = "message.output_text.logprobs"
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_VERBOSITY = ("low", "medium", "high")
#: ``include`` values refused, with the reason the client reads.
_INCLUDE_REFUSED = {
    "reasoning.encrypted_content": "the served models return no encrypted reasoning",
    "message.input_image.image_url": "image input is not supported",
    "computer_call_output.output.image_url": "built-in tools are not supported",
    "file_search_call.results": "built-in tools are not supported",
    "web_search_call.results": "built-in tools are not supported",
    "web_search_call.action.sources": "built-in tools are not supported",
    "code_interpreter_call.outputs": "built-in tools are not supported",
}


@dataclass(slots=True)
class Options:
    """What the options become: chat fields, Response fields, and the context strategy."""

    chat: dict[str, Any] = field(default_factory=dict)
    echo: dict[str, Any] = field(default_factory=dict)
    truncation: str = "disabled"


def check_options(body: dict[str, Any], stream: bool) -> Options:
    """Check the generation options of a Responses body; raise a 400 naming the first problem."""
    out = Options()
    _stream_options(body, stream)
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise unsupported(f"'service_tier' {tier!r} is not supported; use 'auto' or 'default'.", "service_tier")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled", "auto"):
        raise bad("'truncation' must be 'auto' or 'disabled'.", "truncation")
    out.truncation = truncation or "disabled"
    out.echo["truncation"] = out.truncation
    _reasoning(body.get("reasoning"), out)
    _verbosity(body.get("text"), out)
    _logprobs(body, out)
    _echoed(body, out)
    return out


def _stream_options(body: dict[str, Any], stream: bool) -> None:
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise bad("'stream_options' may only hold 'include_obfuscation'.", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true.", "stream_options")


def _reasoning(reasoning: object, out: Options) -> None:
    out.echo["reasoning"] = {"effort": None, "summary": None}
    if reasoning is None:
        return
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise bad("'reasoning' must be an object with 'effort'.", "reasoning")
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise unsupported(
                f"'reasoning.{name}' is not supported: the workers return no reasoning summaries.", f"reasoning.{name}"
            )
    effort = reasoning.get("effort")
    if effort is None:
        return
    if effort not in _EFFORTS:
        raise bad(f"'reasoning.effort' must be one of {', '.join(_EFFORTS)} (got {effort!r}).", "reasoning.effort")
    out.chat["reasoning_effort"] = effort
    out.echo["reasoning"] = {"effort": effort, "summary": None}


def _verbosity(text: object, out: Options) -> None:
    verbosity = text.get("verbosity") if isinstance(text, dict) else None
    out.echo["verbosity"] = verbosity or "medium"
    if verbosity is None:
        return
    if verbosity not in _VERBOSITY:
        raise bad(f"'text.verbosity' must be one of {', '.join(_VERBOSITY)} (got {verbosity!r}).", "text.verbosity")
    out.chat["verbosity"] = verbosity


def _logprobs(body: dict[str, Any], out: Options) -> None:
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(v, str) for v in include)):
        raise bad("'include' must be an array of strings.", "include")
    for value in include or ():
        if value != LOGPROBS:
            reason = _INCLUDE_REFUSED.get(value, "it is not an include value of the Responses API")
            raise unsupported(f"'include' value {value!r} is not supported: {reason}.", "include")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise bad("'top_logprobs' must be an integer from 0 to 20.", "top_logprobs")
    out.echo["top_logprobs"] = top or 0
    if include or top:
        out.chat["logprobs"] = True
        if top:
            out.chat["top_logprobs"] = top


def _echoed(body: dict[str, Any], out: Options) -> None:
    calls = body.get("max_tool_calls")
    if calls is not None and (not isinstance(calls, int) or isinstance(calls, bool) or calls < 1):
        raise bad("'max_tool_calls' must be a positive integer.", "max_tool_calls")
    out.echo["max_tool_calls"] = calls
    retention = body.get("prompt_cache_retention")
    if retention not in (None, "in_memory", "in-memory", "24h"):
        raise bad("'prompt_cache_retention' must be 'in_memory' or '24h'.", "prompt_cache_retention")
    out.echo["prompt_cache_retention"] = "in_memory" if retention == "in-memory" else retention
