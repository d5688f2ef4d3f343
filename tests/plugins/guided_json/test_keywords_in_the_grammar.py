"""Which JSON Schema keywords the engine enforces (they are in the regex the worker decodes under),
which are only validated after generation, and which are refused up front. The table here is the one
in docs/plugins/guided_json.md: each row is checked against the compiled regex and the checker."""

from __future__ import annotations

import random
import re
from decimal import Decimal
from typing import Any

import pytest

from plugins.guided_json.bounds import integer_regex, number_regex
from plugins.guided_json.compile import Compiled, Compiler
from plugins.guided_json.config import GuidedJSONConfig
from plugins.guided_json.forms import Constraint
from plugins.guided_json.schemas import SchemaProblem


def _compile(schema: dict[str, Any]) -> Compiled:
    return Compiler(GuidedJSONConfig())(Constraint("json", schema, "response_format"))


def _obj(node: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"v": node}, "required": ["v"], **extra}


# keyword: (schema of the value "v", an answer within it, an answer outside it)
ENGINE = {
    "type": ({"type": "integer"}, "3", '"3"'),
    "enum": ({"enum": ["red", "blue"]}, '"red"', '"green"'),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', '"abcd"'),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, '"abc"', '"xyz"'),
    "format (date)": ({"type": "string", "format": "date"}, '"2024-02-03"', '"soon"'),
    "format (email)": ({"type": "string", "format": "email"}, '"a@b.co"', '"plain"'),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1]", "[]"),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    "additionalProperties: false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
        '{"a": 1}',
        '{"a": 1, "b": 2}',
    ),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "null", '"x"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"a"', "null"),
    "allOf": ({"allOf": [{"type": "integer"}]}, "1", '"a"'),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, '[1, "a"]', '["a", 1]'
    ),
    "format (time)": ({"type": "string", "format": "time"}, '"12:00:00"', '"noon"'),
    "format (date-time)": ({"type": "string", "format": "date-time"}, '"2020-01-01T12:00:00Z"', '"noon"'),
    "format (uuid)": ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"x"'),
    "integer minimum/maximum": ({"type": "integer", "minimum": 1000, "maximum": 1005}, "1003", "5"),
    "integer exclusiveMinimum/exclusiveMaximum": (
        {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}, "-2", "3"
    ),
    "number minimum/maximum (whole, >= 0)": ({"type": "number", "minimum": 0, "maximum": 1}, "0.25", "1.5"),
    "number exclusiveMinimum (whole, >= 0)": ({"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
}  # fmt: skip

VALIDATED = {
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "10", "7"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    "minProperties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, '{"a": 1}', "{}"
    ),
    "maxProperties": (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "maxProperties": 1},
        '{"a": 1}',
        '{"a": 1, "b": 2}',
    ),
    "dependentSchemas": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentSchemas": {"a": {"required": ["b"]}},
        },
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
    "dependentRequired": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
    "number bounds that are not whole": ({"type": "number", "minimum": 0.5, "maximum": 1.5}, "1", "2"),
    "number bounds below zero": ({"type": "number", "minimum": -1, "maximum": 1}, "0.5", "-2"),
}  # fmt: skip

REFUSED = {
    "not": {"not": {"type": "string"}},
    "if/then/else": {"if": {"type": "string"}, "then": {"minLength": 2}},
    "recursive $ref": {"$ref": "#"},
    "external $ref": {"$ref": "https://example.com/schema.json"},
    "an empty integer range": {"type": "integer", "minimum": 5, "maximum": 4},
    "an empty number range": {"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2},
}


def _answer(value: str) -> str:
    return '{"v": ' + value + "}"


@pytest.mark.parametrize("keyword", list(ENGINE))
def test_keywords_the_engine_enforces(keyword: str) -> None:
    node, inside, outside = ENGINE[keyword]
    compiled = _compile(_obj(node))
    regex = re.compile(compiled.upstream["regex"])
    assert regex.fullmatch(_answer(inside)), keyword
    assert compiled.check(_answer(inside)) is None
    assert not regex.fullmatch(_answer(outside)), f"{keyword}: the grammar lets {outside} through"


@pytest.mark.parametrize("keyword", list(VALIDATED))
def test_keywords_only_validated_after_generation(keyword: str) -> None:
    node, inside, outside = VALIDATED[keyword]
    compiled = _compile(_obj(node))
    regex = re.compile(compiled.upstream["regex"])
    assert regex.fullmatch(_answer(inside)) and compiled.check(_answer(inside)) is None
    assert regex.fullmatch(_answer(outside)), f"{keyword} is enforced now: move it to ENGINE (and the docs)"
    assert compiled.check(_answer(outside)) is not None


@pytest.mark.parametrize("keyword", list(REFUSED))
def test_schemas_refused_before_any_generation(keyword: str) -> None:
    with pytest.raises(SchemaProblem):
        _compile(_obj(REFUSED[keyword]))


def test_bounds_inside_defs_reached_by_ref_are_enforced() -> None:
    schema = {
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "required": ["item"],
        "$defs": {
            "Item": {"type": "object", "properties": {"n": {"type": "integer", "maximum": -10}}, "required": ["n"]}
        },
    }
    regex = re.compile(_compile(schema).upstream["regex"])
    assert regex.fullmatch('{"item": {"n": -10}}') and regex.fullmatch('{"item": {"n": -12345}}')
    assert not regex.fullmatch('{"item": {"n": -9}}') and not regex.fullmatch('{"item": {"n": 3}}')


def test_a_schema_naming_the_placeholder_cannot_smuggle_a_pattern() -> None:
    """A client string that looks like a placeholder stays a literal: only the gateway's own (random
    per compile) placeholders are replaced."""
    schema = {
        "type": "object",
        "properties": {"v": {"const": "gwbound0xdeadbeef"}, "n": {"type": "integer", "minimum": 1}},
        "required": ["v", "n"],
    }
    regex = re.compile(_compile(schema).upstream["regex"])
    assert regex.fullmatch('{"v": "gwbound0xdeadbeef", "n": 1}')
    assert not regex.fullmatch('{"v": "gwbound0xdeadbeef", "n": 0}')


def test_bounds_with_hundreds_of_digits_are_validated_rather_than_refused() -> None:
    compiled = _compile(_obj({"type": "integer", "minimum": 1.5e300}))  # JSON allows it; 301 digits
    assert len(compiled.upstream["regex"]) < 200  # the plain integer regex: not pushed
    assert compiled.check(_answer("5")) is not None


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(1000, 1005), (0, None), (None, 0), (-5, 3), (-100, -7), (None, -3), (7, None), (0, 0), (-1, -1),
     (1, 999_999), (123, 4567), (None, None), (-20, None), (10, 99), (19, 201), (-987_654, 123_456)],
)  # fmt: skip
def test_integer_ranges_match_exactly_the_integers_in_range(lo: int | None, hi: int | None) -> None:
    regex = re.compile(integer_regex(lo, hi))
    rng = random.Random(f"{lo}:{hi}")
    values = list(range(-1200, 1200)) + [rng.randrange(-(10**8), 10**8) for _ in range(2000)]
    for x in values:
        inside = (lo is None or x >= lo) and (hi is None or x <= hi)
        assert bool(regex.fullmatch(str(x))) == inside, (lo, hi, x)
    for never in ("-0", "01", "", "+1", "1.0", "1e3"):
        assert not regex.fullmatch(never)


@pytest.mark.parametrize(
    ("lo", "lo_ex", "hi", "hi_ex"),
    [(0, False, None, False), (0, True, None, False), (0, False, 1, False), (0, True, 1, True), (3, False, 7, True),
     (5, False, 5, False), (1000, False, 1005, False)],
)  # fmt: skip
def test_number_ranges_match_exactly_the_numbers_in_range(lo: int, lo_ex: bool, hi: int | None, hi_ex: bool) -> None:
    regex_text = number_regex(lo, lo_ex, hi, hi_ex)
    assert regex_text is not None
    regex = re.compile(regex_text)
    samples = ["0", "0.0", "0.5", "1", "1.0", "1.5", "2.25", "3", "6.999", "7", "7.0", "7.1", "5", "5.00", "5.01",
               "1000", "1004.9", "1005", "1005.0", "1005.1", "12", "0.000", "999.99", "4.9999"]  # fmt: skip
    for text in samples:
        value = Decimal(text)
        inside = (value > lo if lo_ex else value >= lo) and (hi is None or (value < hi if hi_ex else value <= hi))
        assert bool(regex.fullmatch(text)) == inside, (lo, lo_ex, hi, hi_ex, text)
    for never in ("-1", "-0.5", "00.5", ".5", "1e2"):
        assert not regex.fullmatch(never)
