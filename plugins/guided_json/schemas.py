"""Checking a JSON schema before it is compiled, and bounding its free-form parts.

Three things a schema must pass at the gateway: it is a valid JSON schema (checked against its
metaschema with ``jsonschema``), it is not recursive (a ``$ref`` cycle), and it is not huge (its size
after inlining local ``$ref``s is bounded, which also stops ``$ref`` fan-out bombs).

Free-form parts (``{"type": "object"}`` with no properties, ``{}``, arrays without ``items``, and
``json_object`` itself) turn into a regex that outlines cannot compile in reasonable time (vLLM answers
a 500 after ~5 s). They are replaced, for decoding only, by a bounded generic JSON shape: objects whose
values are primitives, flat arrays or flat objects. Every answer of that shape is valid against the
original schema, which is what answers are validated against.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for

_PRIMITIVE: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}
_FLAT_VALUE: dict[str, Any] = {
    "anyOf": [
        _PRIMITIVE,
        {"type": "array", "items": _PRIMITIVE},
        {"type": "object", "additionalProperties": _PRIMITIVE},
    ]
}
GENERIC_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": _FLAT_VALUE}
GENERIC_VALUE: dict[str, Any] = {"anyOf": [GENERIC_OBJECT, {"type": "array", "items": _FLAT_VALUE}, _PRIMITIVE]}

# Keywords that give a node its shape; a node with none of them is free-form.
_SHAPING = frozenset(
    {"properties", "patternProperties", "anyOf", "oneOf", "allOf", "$ref", "enum", "const", "items", "prefixItems"}
)
_CHILD_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_CHILD_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_CHILD_NODES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


class SchemaProblem(ValueError):
    """Why a schema is refused, in words a client can act on; ``code`` is the error code it gets."""

    code = "invalid_guided_request"


def checked_validator_class(schema: dict[str, Any]) -> type[Validator]:
    """The validator class of ``schema``'s ``$schema`` draft (2020-12 by default), once the schema has
    been checked against that draft's metaschema."""
    cls: type[Validator] = validator_for(schema, default=Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:  # check_schema already raises the most relevant error
        where = "/".join(str(p) for p in exc.path) or "(top level)"
        raise SchemaProblem(f"it is not a valid JSON schema at {where}: {exc.message}") from None
    return cls


def validator(schema: dict[str, Any]) -> Validator:
    """A validator for ``schema`` after checking the schema (for the gateway's own schemas: a client's
    goes through ``patterns.linear_validator``, whose patterns run on RE2)."""
    return checked_validator_class(schema)(schema)


def _resolve(root: dict[str, Any], ref: str) -> Any:
    if not ref.startswith("#"):
        raise SchemaProblem(f"$ref '{ref}' points outside the schema; only local references (#/...) are supported")
    node: Any = root
    for raw in ref[1:].split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaProblem(f"$ref '{ref}' does not resolve to anything in the schema")
    return node


def _children(node: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key in _CHILD_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            out.extend(value.values())
    for key in _CHILD_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            out.extend(value)
    for key in _CHILD_NODES:
        value = node.get(key)
        if isinstance(value, dict | list):
            out.append(value)
    return out


def check_structure(schema: dict[str, Any], max_nodes: int) -> None:
    """Refuse recursive schemas and schemas that are too large once local ``$ref``s are inlined."""
    count = 0
    # Iterative walk: (node, chain of $ref targets being expanded), so deep schemas cannot blow the stack.
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, chain = stack.pop()
        count += 1
        if count > max_nodes:
            raise SchemaProblem(f"it is too large: more than {max_nodes} nodes once its $refs are expanded")
        if isinstance(node, list):
            stack.extend((item, chain) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in chain or ref == "#":
                raise SchemaProblem(
                    f"it is recursive ($ref '{ref}' refers back to itself); recursive schemas cannot be enforced"
                )
            target = _resolve(schema, ref)
            if not isinstance(target, dict | bool):  # jsonschema would fail on it only when an answer is checked
                raise SchemaProblem(
                    f"$ref '{ref}' points at a {type(target).__name__}, not a schema; a $ref must point at a schema"
                )
            stack.append((target, (*chain, ref)))
        stack.extend((child, chain) for child in _children(node) if isinstance(child, dict | list))


def _is_free_object(node: dict[str, Any]) -> bool:
    if node.get("type") != "object" or _SHAPING & node.keys():
        return False
    extra = node.get("additionalProperties", True)
    return extra is True or extra == {}


def bound_free_form(node: Any) -> Any:
    """A copy of ``node`` with free-form parts replaced by the bounded generic shapes."""
    if node is True or node == {}:
        return GENERIC_VALUE
    if not isinstance(node, dict):
        return node
    if _is_free_object(node):
        return {**node, **GENERIC_OBJECT}
    out = dict(node)
    if out.get("type") == "array" and "items" not in out and "prefixItems" not in out:
        out["items"] = _FLAT_VALUE
    for key in _CHILD_MAPS:
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = {name: bound_free_form(child) for name, child in value.items()}
    for key in _CHILD_LISTS:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [bound_free_form(child) for child in value]
    for key in ("items", "additionalProperties"):
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = bound_free_form(value)
    return out
