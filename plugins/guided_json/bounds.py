"""Numeric bounds pushed into the grammar, so the engine enforces them instead of a check afterwards.

outlines turns ``{"type": "integer", "minimum": 1000, "maximum": 1005}`` into a regex for *any*
integer: the bounds are ignored while decoding, so a small model answers ``5`` and the answer fails
validation, every time (a retry at temperature 0 repeats it). The gateway builds the regex itself:
before the schema goes to outlines, each bounded numeric node is replaced by a placeholder string
constant, and the placeholder (which outlines emits verbatim, quoted) is replaced in the finished
regex by a regex that matches exactly the numbers in range.

Enforced this way:

- ``integer`` with ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (numeric,
  or the draft-4 boolean forms), any sign, either side open. An empty range is refused (400).
- ``number`` whose bounds are whole numbers with a lower bound >= 0 (``ge=0``, ``gt=0``, ``le=100``,
  ``lt=1``...): digits with an optional fraction, no exponent. Other ``number`` bounds are validated
  after generation only.

``multipleOf``, nodes that also carry ``enum`` / ``const`` (already exact) and bounds so long that
their regex would outgrow ``MAX_RANGE_REGEX`` are left as they are (validated after generation).
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from plugins.guided_json.schemas import SchemaProblem

_FRAC_ANY = r"(\.[0-9]+)?"
_FRAC_POSITIVE = r"\.[0-9]*[1-9][0-9]*"
_FRAC_ZERO = r"(\.0+)?"
_CHILD_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_CHILD_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_CHILD_NODES = ("items", "additionalProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: A range regex longer than this (bounds with hundreds of digits) is not pushed: validated only.
MAX_RANGE_REGEX = 2_000


def _cls(a: int, b: int) -> str:
    return str(a) if a == b else f"[{a}-{b}]"


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives matching every digit string from ``lo`` to ``hi`` (same length, lo <= hi)."""
    if not lo:
        return [""]
    if lo == hi:
        return [lo]
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    n = len(lo) - 1
    out: list[str] = []
    start, end = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:
        out += [lo[0] + rest for rest in _same_length(lo[1:], "9" * n)]
        start += 1
    tail: list[str] = []
    if hi[1:] != "9" * n:
        tail = [hi[0] + rest for rest in _same_length("0" * n, hi[1:])]
        end -= 1
    if start <= end:
        out.append(_cls(start, end) + ("" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"))
    return out + tail


def _naturals(lo: int, hi: int | None) -> list[str]:
    """Alternatives matching the decimal integers in [lo, hi] (hi None: no upper end), lo >= 0, no
    leading zeros."""
    if hi is not None and lo > hi:
        return []
    width = len(str(lo))
    top = hi if hi is not None else 10**width - 1
    out: list[str] = []
    for length in range(width, len(str(top)) + 1):
        a = max(lo, 10 ** (length - 1) if length > 1 else 0)
        b = min(top, 10**length - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    if hi is None:
        out.append(f"[1-9][0-9]{{{width},}}")
    return out


def _group(alternatives: list[str]) -> str:
    return "(" + "|".join(alternatives) + ")"


def integer_regex(lo: int | None, hi: int | None) -> str:
    """A regex for the JSON integers in [lo, hi] (either side None: open)."""
    out: list[str] = []
    if lo is None or lo < 0:  # the negative part: -y with y in [max(1, -hi), -lo]
        smallest = 1 if hi is None or hi >= 0 else -hi
        naturals = _naturals(smallest, None if lo is None else -lo)
        if naturals:
            out.append("-" + _group(naturals))
    if hi is None or hi >= 0:
        out += _naturals(0 if lo is None else max(lo, 0), hi)
    return _group(out)


def number_regex(lo: int, lo_exclusive: bool, hi: int | None, hi_exclusive: bool) -> str | None:
    """A regex for the JSON numbers (no exponent) in the range, for whole bounds with ``lo`` >= 0;
    None when the range is empty."""
    out: list[str] = []
    if hi is None or lo < hi:
        out.append(str(lo) + (_FRAC_POSITIVE if lo_exclusive else _FRAC_ANY))
        middle = _naturals(lo + 1, None if hi is None else hi - 1)
        if middle:
            out.append(_group(middle) + _FRAC_ANY)
        if hi is not None and not hi_exclusive:
            out.append(str(hi) + _FRAC_ZERO)
    elif lo == hi and not lo_exclusive and not hi_exclusive:
        out.append(str(lo) + _FRAC_ZERO)
    return _group(out) if out else None


def _whole(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer_bounds(node: dict[str, Any], where: str) -> tuple[int | None, int | None]:
    lo: int | None = None
    hi: int | None = None

    def raise_lo(value: int) -> None:
        nonlocal lo
        lo = value if lo is None else max(lo, value)

    def lower_hi(value: int) -> None:
        nonlocal hi
        hi = value if hi is None else min(hi, value)

    minimum, maximum = node.get("minimum"), node.get("maximum")
    ex_min, ex_max = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    if _whole(minimum):
        raise_lo(math.floor(minimum) + 1 if ex_min is True and minimum == math.floor(minimum) else math.ceil(minimum))
    if _whole(maximum):
        lower_hi(math.ceil(maximum) - 1 if ex_max is True and maximum == math.ceil(maximum) else math.floor(maximum))
    if _whole(ex_min) and ex_min is not True:
        raise_lo(math.floor(ex_min) + 1)
    if _whole(ex_max) and ex_max is not True:
        lower_hi(math.ceil(ex_max) - 1)
    if lo is not None and hi is not None and lo > hi:
        raise SchemaProblem(f"no integer satisfies the bounds at {where}")
    return lo, hi


def _number_bounds(node: dict[str, Any]) -> tuple[int, bool, int | None, bool] | None:
    """(lo, lo exclusive, hi, hi exclusive) for whole bounds with a lower bound >= 0, else None."""
    lows: list[tuple[float, bool]] = []
    highs: list[tuple[float, bool]] = []
    minimum, maximum = node.get("minimum"), node.get("maximum")
    ex_min, ex_max = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    if _whole(minimum):
        lows.append((minimum, ex_min is True))
    if _whole(ex_min) and ex_min is not True:
        lows.append((ex_min, True))
    if _whole(maximum):
        highs.append((maximum, ex_max is True))
    if _whole(ex_max) and ex_max is not True:
        highs.append((ex_max, True))
    if not lows or any(v != int(v) for v, _ in lows + highs):
        return None
    lo, lo_ex = max(lows, key=lambda b: (b[0], b[1]))
    if lo < 0:
        return None
    if not highs:
        return int(lo), lo_ex, None, False
    hi, hi_ex = min(highs, key=lambda b: (b[0], not b[1]))
    return int(lo), lo_ex, int(hi), hi_ex


class BoundsPusher:
    """Replaces bounded numeric nodes by placeholders and remembers the regex of each."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.regexes: dict[str, str] = {}

    def _placeholder(self, regex: str) -> dict[str, Any] | None:
        if len(regex) > MAX_RANGE_REGEX:
            return None
        name = f"gwbound{len(self.regexes)}x{self.tag}"
        self.regexes[name] = regex
        return {"const": name}

    def rewrite(self, node: Any, where: str = "(top level)") -> Any:
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind in ("integer", "number") and any(k in node for k in _BOUNDS) and not ({"enum", "const"} & node.keys()):
            if kind == "integer":
                lo, hi = _integer_bounds(node, where)
                if lo is not None or hi is not None:
                    return self._placeholder(integer_regex(lo, hi)) or node
            else:
                bounds = _number_bounds(node)
                if bounds is not None:
                    regex = number_regex(*bounds)
                    if regex is None:
                        raise SchemaProblem(f"no number satisfies the bounds at {where}")
                    return self._placeholder(regex) or node
            return node
        out = dict(node)
        for key in _CHILD_MAPS:
            value = out.get(key)
            if isinstance(value, dict):
                out[key] = {name: self.rewrite(child, f"{where}/{name}") for name, child in value.items()}
        for key in _CHILD_LISTS:
            value = out.get(key)
            if isinstance(value, list):
                out[key] = [self.rewrite(child, f"{where}/{i}") for i, child in enumerate(value)]
        for key in _CHILD_NODES:
            value = out.get(key)
            if isinstance(value, dict):
                out[key] = self.rewrite(value, f"{where}/{key}")
        return out

    def fill(self, regex: str) -> str:
        """The finished regex with every placeholder (as outlines emitted it, quoted) replaced."""
        for name, sub in self.regexes.items():
            regex = regex.replace(f'"{name}"', sub)
        return regex
