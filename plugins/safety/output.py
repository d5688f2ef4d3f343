"""Output checks on streams: a bounded hold-back per choice.

Text from the worker is kept unreleased until ``hold_back_chars`` newer characters follow it. Every
time a piece arrives the held text (with the last released characters before it, for regex context)
is scanned; so any match of at most ``hold_back_chars`` characters is seen whole before any of its
characters is released. On a ``block`` hit the text before the match is released and the stream ends
(``finish_reason: "content_filter"``); ``redact`` rewrites the held text; ``log`` reports once. The
chunk that carries ``finish_reason`` releases everything still held. Latency added: the text is late
by at most ``hold_back_chars`` characters, and not at all once the choice has finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from plugins.safety.rules import Hit, RuleSet, redact

Reporter = Callable[[Hit, bytes], None]


@dataclass(slots=True)
class _Held:
    context: str = ""  # the last released characters, scanned again for context only
    pending: str = ""  # not yet released
    released_bytes: int = 0  # UTF-8 bytes released so far (absolute offsets for de-duplication)
    reported: set[tuple[str, int]] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Release:
    text: str
    blocked: Hit | None = None


class StreamGuard:
    """Hold-back state for one stream (all its choices)."""

    def __init__(self, rules: RuleSet, hold_back_chars: int, report: Reporter) -> None:
        self._rules = rules
        self._hold = hold_back_chars
        self._report = report
        self._choices: dict[int, _Held] = {}

    def feed(self, index: int, piece: str, *, final: bool) -> Release:
        """Add ``piece`` to choice ``index``; returns what may be sent now (and the block hit, if any)."""
        held = self._choices.get(index)
        if held is None:
            held = self._choices[index] = _Held()
        held.pending += piece
        if not held.pending:
            return Release("")
        context_bytes = held.context.encode()
        data = context_bytes + held.pending.encode()
        base = len(context_bytes)
        hits = [h for h in self._rules.scan(data) if h.end > base]
        # A redact or log hit that touches the end of the text so far may still grow (an e-mail address
        # cut after "example.or"): act on it only once text follows it or the choice ends, and hold
        # everything from its start until then. A block acts at once: a prefix that matches is enough.
        growing = [] if final else [h for h in hits if h.end == len(data) and h.rule.action != "block"]
        if growing:
            hits = [h for h in hits if h not in growing]
        origin = held.released_bytes - base  # absolute offset of data[0]
        for hit in hits:
            key = (hit.rule.id, origin + hit.start)
            if key not in held.reported:
                held.reported.add(key)
                self._report(hit, data[hit.start : hit.end])
        blocked = next((h for h in hits if h.rule.action == "block"), None)
        cut = len(data) if blocked is None else max(blocked.start, base)
        redactions = [
            Hit(h.rule, max(h.start, base) - base, min(h.end, cut) - base, h.label)
            for h in hits
            if h.rule.action == "redact" and h.start < cut
        ]
        pending = redact(data[base:cut], redactions).decode()
        if blocked is not None or final:
            return self._release(held, pending, "", blocked)
        keep_from = len(pending) - self._hold
        if growing:
            # A growing hit is a suffix of the text, untouched by the redactions before it: hold it whole.
            start = max(base, min(h.start for h in growing))
            keep_from = min(keep_from, len(pending) - len(data[start:].decode()))
        if keep_from <= 0:
            held.pending = pending
            return Release("")
        return self._release(held, pending[:keep_from], pending[keep_from:], None)

    def _release(self, held: _Held, out: str, keep: str, blocked: Hit | None) -> Release:
        held.pending = keep
        if out:
            held.context = (held.context + out)[-self._hold :]
            held.released_bytes += len(out.encode())
        return Release(out, blocked)
