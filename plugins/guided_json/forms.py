"""Every way a client asks for constrained output, normalised into one ``Constraint``, and the one form
sent to the worker.

Accepted (one per request):

- OpenAI ``response_format``: ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (what ``client.chat.completions.parse(response_format=Model)`` sends) and ``{"type": "json_object"}``.
- vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`` plus
  its whitespace options.
- The legacy ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields, which
  vLLM >= 0.12 silently ignores (so they would go unenforced if passed through).

Sent upstream: every one of those fields is removed and replaced by ``structured_outputs`` with a
``regex`` (JSON schemas, compiled at the gateway with bounded whitespace and free-form parts bounded)
or a ``choice``: the forms vLLM 0.32's outlines backend enforces.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.wire.errors import InvalidRequest

Kind = Literal["json", "regex", "choice", "grammar"]

LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
#: Legacy companions that only tuned the fields above; removed with them.
LEGACY_OPTIONS = ("guided_decoding_backend", "guided_whitespace_pattern")
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the client asked for. ``value``: a schema dict (None = any JSON object), a regex, a list of
    choices or a grammar. ``param`` names where in the request it came from, for error messages."""

    kind: Kind
    value: Any
    param: str
    whitespace: str | None = None  # the client's own whitespace pattern, if it gave one
    error_param: str | None = None  # a refusal's ``param``; None: the top-level field, param's first part

    @property
    def field(self) -> str:
        """What a refusal names as its ``param``."""
        return self.error_param or self.param.split(".")[0]

    def key(self, default_whitespace: str) -> str:
        """A stable hash of everything that changes the compiled result (key order does not)."""
        ws = self.whitespace if self.whitespace is not None else default_whitespace
        canonical = orjson.dumps([self.kind, self.value, ws], option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(canonical).hexdigest()


def _refuse(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_guided_request")


def _schema_value(raw: Any, param: str) -> dict[str, Any] | None:
    """A schema given as an object or as JSON text; ``True`` (any value) is kept as ``{}``."""
    if isinstance(raw, str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _refuse(f"'{param}' is not valid JSON: {exc}.", param) from None
    if raw is True:
        return {}
    if not isinstance(raw, dict):
        raise _refuse(f"'{param}' must be a JSON schema object, not {type(raw).__name__}.", param)
    return raw


def _typed(kind: str, raw: Any, param: str, whitespace: str | None = None) -> Constraint:
    if kind == "json":
        return Constraint("json", _schema_value(raw, param), param, whitespace)
    if kind == "json_object":
        return Constraint("json", None, param, whitespace)
    if kind == "regex":
        if not isinstance(raw, str) or not raw:
            raise _refuse(f"'{param}' must be a non-empty regular expression string.", param)
        return Constraint("regex", raw, param)
    if kind == "choice":
        if not isinstance(raw, list) or not raw or not all(isinstance(c, str) and c for c in raw):
            raise _refuse(f"'{param}' must be a non-empty list of non-empty strings.", param)
        return Constraint("choice", list(dict.fromkeys(raw)), param)
    if not isinstance(raw, str) or not raw.strip():
        raise _refuse(f"'{param}' must be a non-empty grammar string.", param)
    return Constraint("grammar", raw, param)


def _from_response_format(rf: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(rf, dict):
        raise _refuse('\'response_format\' must be an object such as {"type": "json_schema", ...}.', param)
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json", None, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise _refuse("'response_format.json_schema' must be an object with 'name' and 'schema'.", param)
        schema = spec.get("schema")
        return Constraint("json", None if schema is None else _schema_value(schema, param), param)
    raise _refuse(
        f"'response_format.type' {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'.",
        "response_format",
    )


def _from_structured_outputs(so: Any) -> Constraint:
    if not isinstance(so, dict):
        raise _refuse("'structured_outputs' must be an object such as {\"json\": {...}}.", "structured_outputs")
    given = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise _refuse(
            "'structured_outputs' needs exactly one of json, regex, choice, grammar, json_object"
            f" (got {', '.join(given) or 'none'}).",
            "structured_outputs",
        )
    whitespace = so.get("whitespace_pattern")
    if so.get("disable_any_whitespace"):
        whitespace = ""
    if whitespace is not None and not isinstance(whitespace, str):
        raise _refuse("'structured_outputs.whitespace_pattern' must be a string.", "structured_outputs")
    kind = given[0]
    param = f"structured_outputs.{kind}" if kind != "json_object" else "structured_outputs"
    return _typed(kind, so[kind], param, whitespace)


def normalise(body: dict[str, Any]) -> Constraint | None:
    """The one constraint a request asks for, or None. Two different constraints are refused."""
    found: list[Constraint] = []
    if body.get("response_format") is not None:
        c = _from_response_format(body["response_format"])
        if c is not None:
            found.append(c)
    if body.get("structured_outputs") is not None:
        found.append(_from_structured_outputs(body["structured_outputs"]))
    for name, kind in LEGACY_FIELDS.items():
        if body.get(name) is not None:
            whitespace = body.get("guided_whitespace_pattern")
            found.append(_typed(kind, body[name], name, whitespace if isinstance(whitespace, str) else None))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise _refuse(f"Only one output constraint may be given per request (got {names}).", found[1].param)
    return found[0] if found else None


@dataclass(frozen=True, slots=True)
class ForcedTool:
    """A function a forcing ``tool_choice`` lets the model call: its name and its ``parameters`` schema
    (None when the tool gives none: any arguments)."""

    name: str
    constraint: Constraint | None


def forced_tools(body: dict[str, Any]) -> list[ForcedTool] | None:
    """The functions a forcing ``tool_choice`` lets the model call: every definition of the function it
    names, or every function tool with ``tool_choice: "required"``; None when it forces no call (absent,
    ``"auto"``, ``"none"``, or no ``tools`` list). An empty list: it names a function the request does
    not offer, so no call can be right.

    The worker decodes a forced call under those schemas as guided output (vLLM compiles them as it would
    a ``response_format`` schema; for "required", under one schema built from all the tools' schemas), so
    each goes through the same compile budgets at the gateway, and each call that comes back is checked
    against its function's. The body is left as it is: the worker needs the tools, and its answer is a
    tool call."""
    choice = body.get("tool_choice")
    tools = body.get("tools")
    if choice is None or not isinstance(tools, list):
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name is None and choice != "required":
        return None
    found = []
    for i, tool in enumerate(tools):
        spec = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            continue
        if name is not None and spec["name"] != name:
            continue  # every definition of that name: which one the worker takes is its own choice
        param = f"tools[{i}].function.parameters"
        raw = spec.get("parameters")
        constraint = None if raw is None else Constraint("json", _schema_value(raw, param), param, error_param=param)
        found.append(ForcedTool(spec["name"], constraint))
    return found


def rewrite(body: dict[str, Any], upstream: dict[str, Any]) -> None:
    """Replace whatever form the client used by ``structured_outputs=upstream``, in place."""
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        del body["response_format"]
    for name in (*LEGACY_FIELDS, *LEGACY_OPTIONS):
        body.pop(name, None)
    body["structured_outputs"] = upstream
