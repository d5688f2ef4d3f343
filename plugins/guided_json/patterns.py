"""Clients' regular expressions, checked against answers in linear time with RE2.

A guided ``regex`` and a JSON schema's ``pattern`` / ``patternProperties`` come from the client, and
every answer is checked against them on the event loop. Python's ``re`` backtracks: a 36-character
answer against ``(a|aa)*c`` held the loop for about 3 s, and every other client's request with it.
RE2 (``google-re2``) runs in time linear in the answer, whatever the pattern. What it cannot run
(backreferences, look-around, repeat counts over 1000) is refused with a 400 ``unsupported_regex``
when the request comes in, before anything reaches a worker.

Patterns are compiled once, in the compile thread, with the rest of the constraint, and kept with it
(``Compiled`` in the LRU): checking an answer costs a dict lookup per pattern and an RE2 search.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from re import _parser as sre_parse  # type: ignore[attr-defined,unused-ignore]  # typed by newer typesheds
from typing import Any

import re2
from jsonschema import ValidationError, validators
from jsonschema.protocols import Validator

from gateway.wire.linear_regex import re2_options
from plugins.guided_json.schemas import SchemaProblem, checked_validator_class

#: Keywords whose value is a map of names to subschemas / a list of subschemas / one subschema, in any
#: draft; what lies under the others (``enum``, ``const``, ``default``, ``examples``) is data, not schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items", "extends")
_SCHEMA_NODES = (
    "items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "contains",
    "propertyNames", "not", "if", "then", "else", "contentSchema", "extends",
)  # fmt: skip

Search = Callable[[str, str], bool]


class UnsupportedRegex(SchemaProblem):
    """A pattern that RE2 cannot run (Python's ``re`` reads it); refused with its own error code."""

    code = "unsupported_regex"


def utf8(text: str) -> bytes:
    """``text`` as RE2 matches it. Given a str, RE2's wrapper encodes it and then maps every offset back
    to characters, twice the time of a match on the bytes (16 us against 7 for a short answer); the
    pattern, compiled from a str, still reads them as UTF-8 characters."""
    return text.encode("utf-8", "surrogatepass")


def compile_pattern(pattern: str, where: str) -> Any:
    """``pattern`` compiled by RE2. ``SchemaProblem`` when it is no regular expression at all,
    ``UnsupportedRegex`` when it uses what RE2 does not run. ``where`` names it in the message."""
    try:
        sre_parse.parse(pattern)  # parsing only, linear: is it a regular expression at all?
    except (sre_parse.error, RecursionError, OverflowError) as exc:
        raise SchemaProblem(f"{where} is not a valid regular expression: {exc}") from None
    try:
        return re2.compile(pattern, re2_options())
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise UnsupportedRegex(
            f"{where} uses what the gateway's linear-time regex engine (RE2) does not run ({reason});"
            " backreferences, look-around and repeat counts over 1000 are not supported"
        ) from None


def _subschemas(node: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, node) of the schema and of every subschema, through the keywords that hold
    subschemas only (a ``pattern`` inside an ``enum`` value is data, not a pattern)."""
    if not isinstance(node, dict):
        return
    yield where, node
    for key in _SCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            for name, child in value.items():
                yield from _subschemas(child, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            for i, child in enumerate(value):
                yield from _subschemas(child, f"{where}/{key}/{i}")
    for key in _SCHEMA_NODES:
        yield from _subschemas(node.get(key), f"{where}/{key}")


def compile_schema_patterns(schema: dict[str, Any]) -> dict[str, Any]:
    """Every pattern of ``schema`` (``pattern`` values, ``patternProperties`` names) compiled by RE2,
    by its text; refused as ``compile_pattern`` says.

    ``unevaluatedProperties`` in a schema with ``patternProperties`` is refused too: jsonschema matches
    property names against them with Python's ``re`` deep in its own code for that keyword."""
    table: dict[str, Any] = {}
    pattern_properties = unevaluated = False
    for where, node in _subschemas(schema):
        found = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        names = node.get("patternProperties")
        if isinstance(names, dict):
            found += list(names)
            pattern_properties = True
        unevaluated = unevaluated or "unevaluatedProperties" in node
        for pattern in found:
            if pattern not in table:
                where_text = f"the pattern {pattern[:80]!r} at {where[1:] or '(top level)'}"
                table[pattern] = compile_pattern(pattern, where_text)
    if pattern_properties and unevaluated:
        raise UnsupportedRegex("unevaluatedProperties together with patternProperties is not supported")
    return table


def linear_validator(schema: dict[str, Any]) -> Validator:
    """A validator for ``schema`` (checked as ``schemas.checked_validator_class`` does) whose
    ``pattern``, ``patternProperties`` and ``additionalProperties`` match with RE2."""
    cls = checked_validator_class(schema)
    table = compile_schema_patterns(schema)

    def search(pattern: str, text: str) -> bool:
        regex = table.get(pattern)
        if regex is None:  # a keyword of some draft that _subschemas does not know: still RE2, never re
            try:
                regex = table[pattern] = re2.compile(pattern, re2_options())
            except re2.error:
                return False
        return regex.search(utf8(text)) is not None

    keywords = {
        "pattern": _pattern(search),
        "patternProperties": _pattern_properties(search),
        "additionalProperties": _additional_properties(search),
    }
    extended: type[Validator] = validators.extend(cls, keywords)
    return extended(schema)


def _pattern(search: Search) -> Callable[..., Iterator[ValidationError]]:
    def pattern(validator: Validator, patrn: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
        if validator.is_type(instance, "string") and not search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    return pattern


def _pattern_properties(search: Search) -> Callable[..., Iterator[ValidationError]]:
    def pattern_properties(validator: Validator, patterns: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for key, value in instance.items():
                if search(patrn, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    return pattern_properties


def _additional_properties(search: Search) -> Callable[..., Iterator[ValidationError]]:
    """jsonschema's ``additionalProperties``, its names matched against ``patternProperties`` by RE2."""

    def additional_properties(validator: Validator, allowed: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        known, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
        extras = [k for k in instance if k not in known and not any(search(p, k) for p in patterns)]
        if validator.is_type(allowed, "object"):
            for extra in extras:
                yield from validator.descend(instance[extra], allowed, path=extra)
        elif not allowed and extras:
            names, one = ", ".join(repr(each) for each in sorted(extras, key=str)), len(extras) == 1
            if patterns:
                regexes = ", ".join(repr(each) for each in sorted(patterns))
                yield ValidationError(f"{names} {'does' if one else 'do'} not match any of the regexes: {regexes}")
            else:
                verb = "was" if one else "were"
                yield ValidationError(f"Additional properties are not allowed ({names} {verb} unexpected)")

    return additional_properties
