"""Operator-written deny lists: regular expressions (RE2 syntax) and word lists.

RE2 runs in time linear in the input and refuses constructs that could backtrack (backreferences,
look-around), so neither a pattern nor a prompt can hang the worker thread. A word list becomes one
case-insensitive alternation; ``\\b`` is added only at word-character edges, so entries such as
``c++`` or ``.env`` work too.
"""

from __future__ import annotations

from collections.abc import Sequence

from plugins.safety.detectors import RegexDetector

# A word list of a few thousand entries compiles to a large automaton: give it room.
WORDS_MAX_MEM = 64 << 20


def _word_edge(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch == "_")


def words_pattern(words: Sequence[str]) -> str:
    alternatives = []
    for word in sorted({w.strip() for w in words if w.strip()}, key=len, reverse=True):
        escaped = _escape(word)
        prefix = r"\b" if _word_edge(word[0]) else ""
        suffix = r"\b" if _word_edge(word[-1]) else ""
        alternatives.append(prefix + escaped + suffix)
    if not alternatives:
        raise ValueError("a word list needs at least one non-empty word")
    return "(?i)(?:" + "|".join(alternatives) + ")"


def _escape(word: str) -> str:
    # Every ASCII punctuation character may be backslash-escaped in RE2; a run of spaces matches any.
    parts = []
    for piece in word.split():
        parts.append("".join("\\" + ch if ch.isascii() and not ch.isalnum() else ch for ch in piece))
    return r"\s+".join(parts)


def deny_pattern_detector(patterns: Sequence[str]) -> RegexDetector:
    return RegexDetector(patterns)


def words_detector(words: Sequence[str]) -> RegexDetector:
    return RegexDetector([words_pattern(words)], max_mem=WORDS_MAX_MEM)
