"""Secrets (API keys, tokens, private keys) found with detect-secrets' maintained patterns, run by RE2.

detect-secrets' own scan (``scan_line``) runs ~30 Python ``re`` patterns plus entropy and keyword
plugins on every line: far over the per-request budget (see bench/bench_safety.py). So the patterns
of its regex-based plugins are taken as data and compiled with RE2 instead. RE2 has no look-around,
so the two look-around forms those patterns use are rewritten into a check on the byte before or
after the match; a pattern that still does not compile is skipped (and listed by ``skipped``). The
entropy and keyword plugins are not used: they flag ordinary prose and code far too often for a
gateway that refuses or rewrites prompts.

A private key pattern matches only the ``BEGIN ... PRIVATE KEY`` line, so its span is extended to the
matching ``END`` line (or the end of the text) to cover the key itself; a JWT's span is extended over
its signature, which the lazy pattern leaves out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
from detect_secrets.plugins.base import RegexBasedDetector

from plugins.safety.detectors import Span, compile_re2

# detect-secrets types with better detectors elsewhere (ip) or no regex (entropy, keyword).
_EXCLUDED = frozenset({"Public IP (ipv4)"})
_LOOKBEHIND_NONWORD = "(?:(?<=\\W)|(?<=^))"
_LOOKAHEAD_NONWORD = "(?!\\w)"
_JWT_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.+/=")
_PRIVATE_KEY_END = compile_re2(r"-----END[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")


def _is_word(byte: int) -> bool:
    return byte == 95 or 48 <= byte <= 57 or 65 <= byte <= 90 or 97 <= byte <= 122


@dataclass(frozen=True, slots=True)
class SecretPattern:
    secret_type: str
    regex: Any
    source: str
    nonword_before: bool
    nonword_after: bool


def _rewrite(pattern: str) -> tuple[str, bool, bool]:
    before = pattern.startswith(_LOOKBEHIND_NONWORD)
    if before:
        pattern = pattern[len(_LOOKBEHIND_NONWORD) :]
    after = pattern.endswith(_LOOKAHEAD_NONWORD)
    if after:
        pattern = pattern[: -len(_LOOKAHEAD_NONWORD)]
    # RE2 caps counted repetition at 1000.
    pattern = re.sub(r"\{(\d+),(\d{4,})\}", lambda m: "{" + m.group(1) + ",1000}", pattern)
    return pattern, before, after


def load_secret_patterns() -> tuple[list[SecretPattern], list[str]]:
    """Every regex-based detect-secrets plugin's patterns as RE2, and the types that could not be used."""
    patterns: list[SecretPattern] = []
    skipped: list[str] = []
    mapping: dict[str, Any] = get_mapping_from_secret_type_to_class()  # its classes are typed as abstract
    for secret_type, cls in sorted(mapping.items()):
        if secret_type in _EXCLUDED or not issubclass(cls, RegexBasedDetector):
            continue
        plugin = cls()
        for compiled in plugin.denylist:
            source = compiled.pattern if isinstance(compiled.pattern, str) else compiled.pattern.decode()
            flags = "(?i)" if compiled.flags & re.IGNORECASE else ""
            rewritten, before, after = _rewrite(source)
            if compiled.flags & re.VERBOSE and re.search(r"\s|#", source):
                skipped.append(secret_type)  # a verbose pattern would need its comments stripped
                continue
            try:
                regex = compile_re2(flags + rewritten)
            except ValueError:
                skipped.append(secret_type)
                continue
            patterns.append(SecretPattern(secret_type, regex, flags + rewritten, before, after))
    return patterns, sorted(set(skipped))


class SecretDetector:
    """Spans of secrets; ``patterns`` feed the rule set's RE2 Set, ``find`` confirms and extends."""

    def __init__(self, patterns: Sequence[SecretPattern]) -> None:
        self._patterns = list(patterns)
        self.patterns = [p.source for p in self._patterns]

    def find(self, data: bytes, which: Sequence[int]) -> list[Span]:
        spans: list[Span] = []
        for i in which:
            pattern = self._patterns[i]
            for m in pattern.regex.finditer(data):
                start, end = m.start(), m.end()
                if pattern.nonword_before and start > 0 and _is_word(data[start - 1]):
                    continue
                if pattern.nonword_after and end < len(data) and _is_word(data[end]):
                    continue
                if pattern.secret_type == "Private Key":
                    while start > 0 and data[start - 1] == 45:  # the "-----" before BEGIN
                        start -= 1
                    tail = _PRIVATE_KEY_END.search(data, end)
                    end = tail.end() if tail is not None else len(data)
                elif pattern.secret_type == "JSON Web Token":
                    # Its pattern ends lazily (detect-secrets decodes the token afterwards): take the signature.
                    while end < len(data) and data[end] in _JWT_CHARS:
                        end += 1
                spans.append(Span(start, end))
        return spans
