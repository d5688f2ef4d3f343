"""An Anthropic Messages API request, checked, and the chat completions request it becomes.

``parse_request`` checks a ``POST /v1/messages`` body (``count_tokens=True``: a ``/v1/messages/count_tokens``
body, which has no ``max_tokens`` and generates nothing) and refuses what it cannot honour with a 400
naming the field; ``chat_request`` builds the chat completions body every plugin and the worker read. The
mapping follows vLLM's own Anthropic entrypoint (``vllm/entrypoints/anthropic/serving.py``), so a prompt
reaches the model the same through the gateway as on a worker's ``/v1/messages`` (the conversation's
blocks are translated in ``gateway.wire.anthropic_turns``):

- ``system`` (a string or text blocks) becomes the first system message; text blocks are joined, except
  Claude Code's per-request attribution block (``x-anthropic-billing-header: ...``), dropped;
- a user turn's ``tool_result`` blocks become ``tool`` messages (before the turn's other content; a result's
  images follow its tool message as a user message, as vLLM's entrypoint sends them), an
  assistant turn's ``tool_use`` blocks its ``tool_calls``; ``thinking`` blocks a client echoes back are
  dropped (the served models do not read them); ``image`` blocks become ``image_url`` parts;
- ``tools`` become functions (``input_schema`` as ``parameters``); ``tool_choice`` auto / any / tool / none
  becomes auto / required / a named function / none, ``disable_parallel_tool_use`` ``parallel_tool_calls``;
- ``thinking`` ``enabled`` becomes ``thinking_token_budget``, ``disabled`` ``reasoning_effort: "none"``
  (vLLM's entrypoint probes the chat template for a model that cannot stop thinking; the gateway cannot),
  ``adaptive`` nothing; ``output_config.effort`` becomes ``reasoning_effort``;
- ``stop_sequences`` becomes ``stop``, ``metadata.user_id`` the chat ``user``; a stream asks for usage;
- a final assistant turn (Anthropic's prefill) is continued: ``continue_final_message`` without a
  generation prompt. vLLM's own entrypoint starts a new turn after it instead.

Pure functions: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.wire.anthropic_turns import bad, conversation

_ACCEPTED = frozenset(
    {
        "model", "messages", "max_tokens", "system", "stream", "stop_sequences", "temperature", "top_p",
        "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier", "cache_control", "output_config",
        "speed", "context_management",
    }
)  # fmt: skip
#: Fields refused outright, with the reason the client reads.
_UNSUPPORTED = {
    "container": "code execution containers are Anthropic's servers' own",
    "mcp_servers": "remote MCP servers are called by Anthropic's servers, not by this gateway",
    "inference_geo": "the region is where this gateway's workers run, not the client's choice",
    "diagnostics": "prompt-cache diagnostics are Anthropic's servers' own",
    "user_profile_id": "user profiles are Anthropic's servers' own",
    "workspace_id": "workspaces are Anthropic's servers' own; keys and tenants are this gateway's",
}
#: ``cache_control`` (top level or on a block) is accepted and needs nothing: vLLM caches prefixes by itself.
_COUNT_FIELDS = frozenset(
    {
        "model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control", "output_config", "speed",
        "context_management",
    }
)  # fmt: skip
#: ``output_config.effort`` values: Anthropic's, each also a chat ``reasoning_effort`` of vLLM's.
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_DISPLAYS = ("summarized", "omitted", "updates")
#: The one ``context_management`` edit the gateway honours: the prompt never holds earlier turns' thinking.
_CLEAR_THINKING = "clear_thinking_20251015"


@dataclass(slots=True)
class MessagesRequest:
    """A checked Messages request: the client's model name, the chat body's parts, and the stream flag."""

    model: str
    stream: bool
    messages: list[dict[str, Any]]  # chat messages, system first
    options: dict[str, Any] = field(default_factory=dict)  # chat fields: max_tokens, stop, tools, ...


def parse_request(body: dict[str, Any], *, count_tokens: bool = False) -> MessagesRequest:
    """Check a Messages (or count_tokens) body; raise a 400 naming the first problem."""
    accepted = _COUNT_FIELDS if count_tokens else _ACCEPTED
    for name, value in body.items():
        if value is None and name in _UNSUPPORTED:
            continue  # null asks for nothing: a client that sends every field it knows, unset ones as null
        if name in _UNSUPPORTED or (name in _ACCEPTED and name not in accepted):
            reason = _UNSUPPORTED.get(name, "it does not apply to counting tokens")
            raise bad(f"'{name}' is not supported by this gateway: {reason}.", name, "unsupported_parameter")
        if name not in accepted:
            raise bad(f"{name}: Extra inputs are not permitted", name, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model: Field required (a non-empty string)", "model", "missing_required_parameter")
    options: dict[str, Any] = {}
    stream = False
    if not count_tokens:
        options.update(_sampling(body))
        stream = body.get("stream") is True
        if body.get("stream") not in (None, True, False):
            raise bad("stream: Input should be a valid boolean", "stream")
    if body.get("speed") not in (None, "standard"):  # a Messages and a count_tokens field alike
        raise bad("speed: only 'standard' is supported by this gateway", "speed", "unsupported_parameter")
    _context_management(body.get("context_management"))
    options.update(_output_config(body.get("output_config")))
    options.update(_thinking(body.get("thinking"), options.get("max_tokens")))  # after: disabled wins over effort
    tools = _tools(body.get("tools"))
    if tools:
        options["tools"] = tools
    options.update(_tool_choice(body.get("tool_choice"), tools))
    messages, prefill = conversation(body.get("system"), _list(body.get("messages"), "messages", required=True))
    options.update(prefill)
    if stream:
        options["stream"] = True
        options["stream_options"] = {"include_usage": True}
    return MessagesRequest(model=model, stream=stream, messages=messages, options=options)


def chat_request(req: MessagesRequest, upstream_model: str) -> dict[str, Any]:
    """The chat completions body for a checked Messages request."""
    return {"model": upstream_model, "messages": req.messages, **req.options}


def _list(value: object, param: str, *, required: bool = False) -> list[Any]:
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise bad(f"{param}: Input should be a non-empty list", param, "missing_required_parameter")
    return value


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad("max_tokens: Field required (a positive integer)", "max_tokens", "missing_required_parameter")
    out["max_tokens"] = max_tokens
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None:
            if not _number(value) or not low <= value <= high:
                raise bad(f"{name}: Input should be a number from {low:g} to {high:g}", name)
            out[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise bad("top_k: Input should be a positive integer", "top_k")
        out["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop_sequences: Input should be a list of non-empty strings", "stop_sequences")
        if stops:
            out["stop"] = stops
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise bad("metadata: Input should be an object with at most 'user_id'", "metadata")
        user = metadata.get("user_id")
        if user is not None and (not isinstance(user, str) or len(user) > 256):
            raise bad("metadata.user_id: Input should be a string of at most 256 characters", "metadata.user_id")
        if user:
            out["user"] = user
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise bad("service_tier: Input should be 'auto' or 'standard_only'", "service_tier")
    return out


def _context_management(config: object) -> None:
    """``context_management`` (Claude Code sends it with thinking on) is accepted when its only edits clear
    earlier turns' thinking (``clear_thinking_20251015``, whatever it keeps): the prompt never holds that
    thinking anyway, since thinking blocks sent back are dropped. Other edits (clearing tool results,
    compaction) would change what the model reads, and Anthropic's servers do them: a 400 naming the edit."""
    if config is None:
        return
    edits = config.get("edits") if isinstance(config, dict) else None
    if not isinstance(config, dict) or set(config) - {"edits"} or not isinstance(edits, list | None):
        raise bad("context_management: Input should be an object with a list of 'edits'", "context_management")
    for i, edit in enumerate(edits or ()):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != _CLEAR_THINKING:
            raise bad(
                f"context_management.edits.{i}.type: only {_CLEAR_THINKING!r} is supported by this gateway "
                f"(not {kind!r}): other context edits are done by Anthropic's servers",
                f"context_management.edits.{i}.type",
                "unsupported_parameter",
            )


def _output_config(config: object) -> dict[str, Any]:
    """``output_config.format`` (a JSON schema) becomes the chat ``response_format``, which the guided JSON
    plugin and the worker enforce; ``effort`` the chat ``reasoning_effort``, which vLLM hands to the chat
    template (with ``enable_thinking`` true) as its own Anthropic entrypoint does."""
    if config is None:
        return {}
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise bad("output_config: Input should be an object with 'format' and/or 'effort'", "output_config")
    out: dict[str, Any] = {}
    effort = config.get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise bad(f"output_config.effort: Input should be one of {', '.join(_EFFORTS)}", "output_config.effort")
        out["reasoning_effort"] = effort
    fmt = config.get("format")
    if fmt is None:
        return out
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad(
            "output_config.format: Input should be {'type': 'json_schema', 'schema': {...}}", "output_config.format"
        )
    out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    return out


def _thinking(thinking: object, max_tokens: int | None) -> dict[str, Any]:
    """The chat fields for ``thinking``, as vLLM's own Anthropic entrypoint sets them.

    ``enabled`` becomes ``thinking_token_budget`` (the worker ends the thinking after that many tokens);
    Anthropic's bounds are kept: at least 1024 and, on a Messages request, below ``max_tokens``.
    ``disabled`` becomes ``reasoning_effort: "none"``, which vLLM renders with ``enable_thinking`` false, and
    overrides ``output_config.effort``. ``adaptive`` pins nothing: the model thinks as its template has it.
    ``display`` is accepted and ignored: thinking is always returned as ``thinking`` blocks."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'", "thinking.type")
    assert isinstance(thinking, dict)
    allowed = {"type"} if kind == "disabled" else {"type", "display", "budget_tokens"}
    if kind == "adaptive":
        allowed.discard("budget_tokens")
    extra = sorted(set(thinking) - allowed)
    if extra:
        raise bad(f"thinking.{kind}.{extra[0]}: Extra inputs are not permitted", f"thinking.{extra[0]}")
    if thinking.get("display") not in (None, *_DISPLAYS):
        raise bad(f"thinking.display: Input should be one of {', '.join(_DISPLAYS)}", "thinking.display")
    if kind == "disabled":
        return {"reasoning_effort": "none"}
    if kind == "adaptive":
        return {}
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise bad("thinking.enabled.budget_tokens: Field required (an integer)", "thinking.budget_tokens")
    if budget < 1024:
        raise bad(
            "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024", "thinking.budget_tokens"
        )
    if max_tokens is not None and budget >= max_tokens:
        raise bad("`max_tokens` must be greater than `thinking.budget_tokens`.", "thinking.budget_tokens")
    return {"thinking_token_budget": budget}


def template_kwargs(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat template arguments vLLM renders a chat body's ``reasoning_effort`` with (``reasoning_effort``
    and ``enable_thinking``), for a ``/tokenize`` body, which has no ``reasoning_effort`` of its own: so a
    count renders the prompt the generation will."""
    effort = chat.get("reasoning_effort")
    if effort is None:
        return {}
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


# -- tools ---------------------------------------------------------------------------------------------


def _tools(tools: object) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(_list(tools, "tools")):
        param = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad(f"{param}: Input should be an object", param)
        if tool.get("type") not in (None, "custom"):
            raise bad(
                f"{param}.type: server tools ({tool.get('type')!r}) run on Anthropic's servers; only client tools "
                "(name, description, input_schema) are supported by this gateway.",
                f"{param}.type",
                "unsupported_parameter",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise bad(f"{param}.name: Field required (a non-empty string)", f"{param}.name")
        if not isinstance(schema, dict):
            raise bad(f"{param}.input_schema: Field required (a JSON schema object)", f"{param}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": {"type": "object", **schema}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object, tools: list[dict[str, Any]]) -> dict[str, Any]:
    if choice is None:
        return {"tool_choice": "auto"} if tools else {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")
    assert isinstance(choice, dict)
    out: dict[str, Any] = {}
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise bad(f"tool_choice.name: {name!r} is not one of the request's tools", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if tools and choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out
