"""Detectors: each finds typed spans in UTF-8 bytes.

Every detector names the RE2 patterns that can start a match (``patterns``). A ``RuleSet`` puts the
patterns of all its rules into one ``re2.Set`` so a clean text costs a single linear pass; a detector's
``find`` runs only when one of its own patterns fired, and is told which (``which``: local indices).
Spans are byte offsets into the text that was scanned. Validation that a regex cannot express (Luhn,
IBAN mod-97, a real IP address, a real phone number) happens in ``find``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import phonenumbers
import re2

from gateway.wire.linear_regex import DEFAULT_MAX_MEM, re2_options


@dataclass(frozen=True, slots=True)
class Span:
    start: int
    end: int
    label: str | None = None  # a placeholder label finer than the rule's (e.g. one per gov-ID format)


def compile_re2(pattern: str, *, max_mem: int = DEFAULT_MAX_MEM) -> Any:
    """Compile with RE2 (linear time; no backreferences or look-around) or raise ValueError."""
    try:
        return re2.compile(pattern, re2_options(max_mem=max_mem))
    except re2.error:
        raise ValueError(f"not a valid RE2 regular expression: {pattern[:200]!r}") from None


class Detector(Protocol):
    patterns: list[str]

    def find(self, data: bytes, which: Sequence[int]) -> list[Span]: ...


class RegexDetector:
    """Spans of one or more regexes, optionally confirmed by a check on the matched bytes."""

    def __init__(
        self,
        patterns: Sequence[str],
        check: Any = None,
        *,
        labels: Sequence[str | None] | None = None,
        max_mem: int = 8 << 20,
    ) -> None:
        self.patterns = list(patterns)
        self._compiled = [compile_re2(p, max_mem=max_mem) for p in self.patterns]
        self._check = check
        self._labels = list(labels) if labels is not None else [None] * len(self.patterns)

    def find(self, data: bytes, which: Sequence[int]) -> list[Span]:
        spans: list[Span] = []
        for i in which:
            for m in self._compiled[i].finditer(data):
                if self._check is None or self._check(data, m.start(), m.end()):
                    spans.append(Span(m.start(), m.end(), self._labels[i]))
        return spans


# -- checks beyond a regex ----------------------------------------------------------------------------


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_check(data: bytes, start: int, end: int) -> bool:
    digits = "".join(chr(b) for b in data[start:end] if 48 <= b <= 57)
    return 13 <= len(digits) <= 19 and luhn_ok(digits)


def iban_ok(text: str) -> bool:
    compact = text.replace(" ", "").upper()
    if not 15 <= len(compact) <= 34:
        return False
    rearranged = compact[4:] + compact[:4]
    number = "".join(str(int(ch, 36)) for ch in rearranged)
    return int(number) % 97 == 1


def _iban_check(data: bytes, start: int, end: int) -> bool:
    return iban_ok(data[start:end].decode("ascii"))


def _ip_check(data: bytes, start: int, end: int) -> bool:
    try:
        ipaddress.ip_address(data[start:end].decode("ascii"))
    except ValueError:
        return False
    return True


# -- the built-in detectors ----------------------------------------------------------------------------

EMAIL = r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}"
CARD = r"\b(?:\d[ -]?){12,18}\d\b"
IBAN = r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b"
IPV4 = r"\b(?:\d{1,3}\.){3}\d{1,3}\b"
IPV6 = r"(?i)(?:[0-9a-f]{1,4})?(?::[0-9a-f]{0,4}){2,7}(?:[0-9a-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?"
PHONE_CANDIDATE = r"\+?\(?\d[\d ().-]{5,18}\d"


def email_detector() -> RegexDetector:
    return RegexDetector([EMAIL])


def card_detector() -> RegexDetector:
    return RegexDetector([CARD], _card_check)


def iban_detector() -> RegexDetector:
    return RegexDetector([IBAN], _iban_check)


def ip_detector() -> RegexDetector:
    return RegexDetector([IPV4, IPV6], _ip_check)


def gov_id_detector(formats: Sequence[tuple[str, str]]) -> RegexDetector:
    """``formats``: (label, RE2 pattern) pairs; each match is redacted as ``[label]``."""
    return RegexDetector([p for _, p in formats], labels=[label for label, _ in formats])


class PhoneDetector:
    """Phone numbers confirmed by ``phonenumbers`` (libphonenumber's rules), run only on texts where a
    cheap digit-run candidate fired, because the parser is far slower than one RE2 pass."""

    def __init__(self, regions: Sequence[str]) -> None:
        self.patterns = [PHONE_CANDIDATE]
        self.regions: list[str | None] = [r.upper() for r in regions] or [None]

    def find(self, data: bytes, which: Sequence[int]) -> list[Span]:
        text = data.decode("utf-8", "replace")
        ascii_only = len(text) == len(data)
        found: dict[int, Span] = {}
        for region in self.regions:
            for match in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID):
                start, end = match.start, match.end
                if not ascii_only:
                    start, end = len(text[:start].encode()), len(text[:end].encode())
                found.setdefault(start, Span(start, end))
        return sorted(found.values(), key=lambda s: s.start)
