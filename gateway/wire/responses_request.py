"""A Responses API request, checked, and the chat completions request it becomes.

``parse_request`` checks a Responses body and refuses what is not supported with a 400 naming it
(built-in tools, background, conversation, ...); ``gateway.wire.responses_chat`` builds the chat
completions body from it. Pure functions: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.wire.responses_items import bad, normalize_input, unsupported
from gateway.wire.responses_options import check_options

#: Fields of a Responses request the gateway understands (and forwards, translated, or echoes).
_ACCEPTED = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
        "tool_choice", "parallel_tool_calls", "store", "metadata", "previous_response_id", "stream", "user",
        "stream_options", "safety_identifier", "prompt_cache_key", "service_tier", "truncation", "include",
        "reasoning", "background", "top_logprobs", "max_tool_calls", "prompt_cache_retention",
    }
)  # fmt: skip
#: Fields refused outright, with the reason the client reads.
_UNSUPPORTED = {
    "conversation": "conversations are not supported; chain turns with 'previous_response_id'",
    "prompt": "stored prompt templates are not supported; send 'instructions' and 'input'",
    "context_management": "server-side context compaction is not supported",
}
_MAX_METADATA = 16


@dataclass(slots=True)
class ResponsesRequest:
    """A checked Responses request: what to send, what to store, and what to echo on the Response."""

    model: str
    stream: bool
    store: bool
    previous_response_id: str | None
    input_items: list[dict[str, Any]]  # this request's input, normalized, each with an id
    instructions: str | None
    sampling: dict[str, Any]  # chat fields: max_tokens, temperature, top_p, user, parallel_tool_calls
    tools: list[dict[str, Any]]  # as the client sent them (Responses shape)
    tool_choice: Any
    text_format: dict[str, Any]
    echo: dict[str, Any] = field(default_factory=dict)  # request fields shown on the Response object
    truncation: str = "disabled"  # "auto": the oldest turns may be dropped to fit the context


def parse_request(body: dict[str, Any]) -> ResponsesRequest:
    """Check a Responses request body; raise a 400 naming the first problem."""
    _check_arguments(body)
    model = body.get("model")
    if model is None:
        raise bad("You must provide a model parameter.", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad("'model' must be a non-empty string.", "model")
    stream = _flag(body, "stream", False)
    store = _flag(body, "store", True)
    if _flag(body, "background", False):
        raise unsupported(
            "'background' responses are not supported by this gateway; send the request without it "
            "(stream it if it is long).",
            "background",
        )
    options = check_options(body, stream)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad("'previous_response_id' must be a non-empty string.", "previous_response_id")
    if "input" not in body or body["input"] is None:
        raise bad("You must provide an 'input' parameter.", "input", "missing_required_parameter")
    items = normalize_input(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise unsupported(
            "'instructions' must be a string (input items as instructions are not supported).", "instructions"
        )
    sampling = _sampling(body)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    tools = _check_tools(body.get("tools"))
    tool_choice = _check_tool_choice(body.get("tool_choice"), tools)
    if tools and parallel is not None:
        sampling["parallel_tool_calls"] = parallel
    sampling.update(options.chat)
    text_format = _check_text(body.get("text"))
    metadata = _check_metadata(body.get("metadata"))
    echo = _echo(body, options.echo, text_format, metadata, parallel)
    return ResponsesRequest(
        model=model,
        stream=stream,
        store=store,
        previous_response_id=previous,
        input_items=items,
        instructions=instructions,
        sampling=sampling,
        tools=tools,
        tool_choice=tool_choice,
        text_format=text_format,
        echo=echo,
        truncation=options.truncation,
    )


def _echo(
    body: dict[str, Any], echoed: dict[str, Any], text_format: Any, metadata: Any, parallel: bool | None
) -> dict[str, Any]:
    """The request's fields as the response object repeats them (defaults filled in)."""
    verbosity = echoed.pop("verbosity")
    return {
        **echoed,
        "text": {"format": text_format, "verbosity": verbosity},
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata,
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "store": _flag(body, "store", True),
        # strings in the spec (not nullable): echoed when sent, left out otherwise
        **{k: body[k] for k in ("user", "safety_identifier", "prompt_cache_key") if body.get(k) is not None},
    }


def _check_arguments(body: dict[str, Any]) -> None:
    for name in body:
        if name in _UNSUPPORTED:
            raise unsupported(f"'{name}' is not supported by this gateway: {_UNSUPPORTED[name]}.", name)
        if name not in _ACCEPTED:
            raise unsupported(f"Unrecognized request argument supplied: {name}", name)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request's sampling fields from the Responses ones (checked)."""
    sampling: dict[str, Any] = {}
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 1:
            raise bad(f"'max_output_tokens' must be a positive integer (got {max_output!r}).", "max_output_tokens")
        sampling["max_tokens"] = max_output
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise bad(f"'{name}' must be a number.", name)
            sampling[name] = value
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise bad(f"'{name}' must be a string.", name)
        if value is not None and name != "safety_identifier":  # the cache key: routing places a lineage by it
            sampling[name] = value
    return sampling


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean.", name)
    return value


def _check_metadata(metadata: object) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or len(metadata) > _MAX_METADATA:
        raise bad(f"'metadata' must be an object of at most {_MAX_METADATA} string pairs.", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad(
                "'metadata' keys must be at most 64 characters and values strings of at most 512.", f"metadata.{key}"
            )
    return metadata


# -- tools and text format ---------------------------------------------------------------------------


def _check_tools(tools: object) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("'tools' must be an array.", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(
                f"Tools of type {kind!r} are not supported by this gateway: only 'function' tools (built-in tools "
                "such as web_search or file_search run on OpenAI's servers).",
                f"tools[{i}].type",
            )
        assert isinstance(tool, dict)
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad(f"'tools[{i}].name' must be a non-empty string.", f"tools[{i}].name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"'tools[{i}].parameters' must be a JSON schema object.", f"tools[{i}].parameters")
        out.append(
            {
                "type": "function",
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": params,
                "strict": tool.get("strict"),
            }
        )
    return out


def _check_tool_choice(choice: object, tools: list[dict[str, Any]]) -> Any:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if choice["name"] not in {t["name"] for t in tools}:
            raise bad(f"'tool_choice' names the function {choice['name']!r}, which is not in 'tools'.", "tool_choice")
        return {"type": "function", "name": choice["name"]}
    raise unsupported(
        "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...} on this gateway.",
        "tool_choice",
    )


def _check_text(text: object) -> dict[str, Any]:
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad("'text' must be an object with 'format' and 'verbosity'.", "text")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("schema"), dict):
            raise bad("'text.format.schema' must be a JSON schema object.", "text.format.schema")
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad("'text.format.name' must be a non-empty string.", "text.format.name")
        checked = {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"], "strict": fmt.get("strict")}
        if isinstance(fmt.get("description"), str):  # a string in the spec, not nullable
            checked["description"] = fmt["description"]
        return checked
    raise bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'.", "text.format.type")
