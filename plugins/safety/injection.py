"""Prompt-injection heuristics: weighted signals for the common families, a score and a threshold.

Each signal is an RE2 pattern with a weight. A text's score is the sum of the weights of the distinct
signals found in it; the rule fires at ``threshold`` or above (default 1.0: one strong signal, or two
or more weak ones). The families:

- ``override``: instructions to ignore, forget or replace the previous instructions;
- ``roleplay``: escapes into an unrestricted persona (DAN, "developer mode", "pretend you have no rules");
- ``extraction``: attempts to make the model reveal its system prompt or hidden instructions.

These are heuristics: they catch the common phrasings cheaply (one RE2 pass on a clean prompt) and
are meant to sit beside, not replace, a model-based check (``classifier``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plugins.safety.detectors import Span, compile_re2


@dataclass(frozen=True, slots=True)
class Signal:
    family: str
    weight: float
    pattern: str


_GAP = r"[^.\n]{0,40}"

SIGNALS: tuple[Signal, ...] = (
    Signal(
        "override",
        1.0,
        r"(?i)\b(?:ignore|disregard|forget|override|bypass)\b" + _GAP + r"\b(?:previous|prior|above|earlier|preceding|"
        r"all|any|your|the|these|those)\b" + _GAP + r"\b(?:instructions?|directions?|prompts?|rules|directives|"
        r"guidelines|commands)\b",
    ),
    Signal(
        "override",
        1.0,
        r"(?i)\b(?:do\s+not|don't|stop)\s+follow(?:ing)?\s+(?:your|the|any)\s+(?:previous\s+|prior\s+|original\s+)?"
        r"(?:instructions|rules|guidelines)",
    ),
    Signal(
        "override",
        1.0,
        r"(?i)\b(?:ignore|disregard|forget)\s+(?:everything|all)\s+(?:above|before|so\s+far|previously\s+said)\b",
    ),
    Signal("override", 0.5, r"(?i)\bnew\s+(?:instructions?|rules)\s*:"),
    Signal("override", 0.3, r"(?i)\bfrom\s+now\s+on\b"),
    Signal("roleplay", 1.0, r"\bDAN\b|(?i:\bdo\s+anything\s+now\b)"),
    Signal("roleplay", 1.0, r"(?i)\b(?:developer|god|jailbreak|unrestricted|unfiltered|evil)\s+mode\b"),
    Signal(
        "roleplay",
        1.0,
        r"(?i)\b(?:pretend|act|behave|role-?play|imagine)\b" + _GAP + r"\b(?:no|without|free\s+of|free\s+from)\s+"
        r"(?:any\s+)?(?:restrictions|limits|limitations|rules|filters|guidelines|censorship|ethics)",
    ),
    Signal("roleplay", 0.5, r"(?i)\byou\s+are\s+(?:now|no\s+longer)\b"),
    Signal("roleplay", 0.5, r"(?i)\bjailbr(?:eak|oken)\b"),
    Signal(
        "extraction",
        1.0,
        r"(?i)\b(?:reveal|show|print|repeat|output|display|tell\s+me|give\s+me|leak|dump|what\s+(?:is|are|was|were))\b"
        + _GAP
        + r"\b(?:system|initial|original|hidden|secret|developer)\s+(?:prompt|instructions?|message)",
    ),
    Signal("extraction", 1.0, r"(?i)\brepeat\s+(?:the\s+)?(?:text|words|everything)\s+(?:above|before)\b"),
    Signal("extraction", 0.3, r"(?i)\bsystem\s+prompt\b"),
)


class InjectionDetector:
    """Fires when the distinct signals found in a text add up to ``threshold``; the spans are every
    occurrence of the signals found (what ``redact`` would replace and the audit line hashes)."""

    def __init__(self, families: Sequence[str], threshold: float) -> None:
        self._signals = [s for s in SIGNALS if s.family in families]
        self.patterns = [s.pattern for s in self._signals]
        self._compiled = [compile_re2(p) for p in self.patterns]
        self.threshold = threshold

    def score(self, which: Sequence[int]) -> float:
        return sum(self._signals[i].weight for i in set(which))

    def find(self, data: bytes, which: Sequence[int]) -> list[Span]:
        if self.score(which) < self.threshold:
            return []
        return [Span(m.start(), m.end()) for i in sorted(set(which)) for m in self._compiled[i].finditer(data)]
