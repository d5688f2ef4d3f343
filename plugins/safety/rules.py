"""Rules and rule sets: what to look for (a detector), what to do (block, redact, log), and the scan.

A ``RuleSet`` is compiled once (in the plugin's ``start()``) for one direction of one model. All its
detectors' patterns go into one ``re2.Set``: scanning a clean text is a single linear pass, and only
the detectors whose patterns fired run their own (also linear) search and validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import re2

from gateway.wire.linear_regex import re2_options
from plugins.safety.config import Action, RuleConfig
from plugins.safety.detectors import (
    Detector,
    PhoneDetector,
    Span,
    card_detector,
    email_detector,
    gov_id_detector,
    iban_detector,
    ip_detector,
)
from plugins.safety.injection import InjectionDetector
from plugins.safety.normalize import normalize
from plugins.safety.patterns import WORDS_MAX_MEM, deny_pattern_detector, words_detector
from plugins.safety.secret_keys import SecretDetector, SecretPattern

_PLACEHOLDERS = {
    "email": "[EMAIL]",
    "phone": "[PHONE]",
    "card": "[CARD]",
    "iban": "[IBAN]",
    "ip": "[IP_ADDRESS]",
    "secrets": "[SECRET]",
    "gov_id": "[GOV_ID]",
}


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    kind: str
    action: Action
    placeholder: str
    detector: Detector


@dataclass(frozen=True, slots=True)
class Hit:
    rule: Rule
    start: int  # byte offsets into the scanned UTF-8 text
    end: int
    label: str | None = None

    @property
    def placeholder(self) -> str:
        return f"[{self.label}]" if self.label else self.rule.placeholder


def build_rule(config: RuleConfig, secret_patterns: Sequence[SecretPattern]) -> Rule:
    """A compiled rule, or ValueError naming the rule and what is wrong."""
    detector: Detector
    try:
        match config.kind:
            case "pattern":
                detector = deny_pattern_detector(config.patterns)
            case "words":
                # Matched against normalised text: normalise the words the same way (a Cyrillic word
                # list would otherwise miss its own letters folded to Latin look-alikes).
                detector = words_detector([normalize(word)[0] for word in config.words])
            case "email":
                detector = email_detector()
            case "phone":
                detector = PhoneDetector(config.regions)
            case "card":
                detector = card_detector()
            case "iban":
                detector = iban_detector()
            case "gov_id":
                detector = gov_id_detector([(f.label, f.pattern) for f in config.formats])
            case "ip":
                detector = ip_detector()
            case "secrets":
                detector = SecretDetector(secret_patterns)
            case "injection":
                detector = InjectionDetector(config.families, config.threshold)
    except ValueError as exc:
        raise ValueError(f"rule '{config.id}': {exc}") from None
    placeholder = config.placeholder or _PLACEHOLDERS.get(config.kind, "[REDACTED]")
    return Rule(config.id, config.kind, config.action, placeholder, detector)


#: The rules about wording, which also read the leetspeak view of a text (``normalize.leet_view``);
#: the detectors of values (keys, cards, addresses) read digits as digits only.
WORDING_KINDS = frozenset({"injection", "words", "pattern"})


class RuleSet:
    """The rules of one direction of one model, scanned together."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = list(rules)
        wording = [rule for rule in self.rules if rule.kind in WORDING_KINDS]
        #: The wording rules alone (``self`` when there are no others).
        self.wording: RuleSet = self if len(wording) == len(self.rules) else RuleSet(wording)
        #: Whether a hit of any rule changes the request (block or redact), not only logs it.
        self.acts = any(rule.action != "log" for rule in self.rules)
        self._owners: list[tuple[int, int]] = []  # Set index -> (rule index, detector-local pattern index)
        self._set: Any = None
        if not self.rules:
            return
        prefilter = re2.Set.SearchSet(re2_options(max_mem=WORDS_MAX_MEM * 2))
        for r, rule in enumerate(self.rules):
            for local, pattern in enumerate(rule.detector.patterns):
                try:
                    prefilter.Add(pattern)
                except re2.error:
                    raise ValueError(f"rule '{rule.id}': pattern cannot be compiled: {pattern[:200]!r}") from None
                self._owners.append((r, local))
        try:
            prefilter.Compile()
        except re2.error:
            raise ValueError("the rules' patterns are together too large to compile; shorten the word lists") from None
        self._set = prefilter

    def __bool__(self) -> bool:
        return bool(self.rules)

    def scan(self, data: bytes) -> list[Hit]:
        """Every hit of every rule in ``data``, ordered by position."""
        if self._set is None or not data:
            return []
        fired = self._set.Match(data)
        if not fired:
            return []
        which: dict[int, list[int]] = {}
        for index in fired:
            rule_index, local = self._owners[index]
            which.setdefault(rule_index, []).append(local)
        hits: list[Hit] = []
        for rule_index, locals_ in which.items():
            rule = self.rules[rule_index]
            spans: list[Span] = rule.detector.find(data, sorted(locals_))
            hits.extend(Hit(rule, s.start, s.end, s.label) for s in spans)
        hits.sort(key=lambda h: (h.start, -h.end))
        return hits


def redact(data: bytes, hits: Sequence[Hit]) -> bytes:
    """``data`` with every span of ``hits`` replaced by its placeholder (overlaps merged, first wins)."""
    out: list[bytes] = []
    cursor = 0
    pending: Hit | None = None
    pending_end = 0
    for hit in sorted(hits, key=lambda h: (h.start, -h.end)):
        if pending is not None and hit.start < pending_end:
            pending_end = max(pending_end, hit.end)
            continue
        if pending is not None:
            out.append(pending.placeholder.encode())
            cursor = pending_end
        out.append(data[cursor : hit.start])
        pending, pending_end = hit, hit.end
    if pending is None:
        return data
    out.append(pending.placeholder.encode())
    out.append(data[pending_end:])
    return b"".join(out)
