"""Output checks on streams: a bounded hold-back per choice.

Text from the worker is kept unreleased until ``hold_back_chars`` newer characters follow it. Every
time a piece arrives the held text (with the last released characters before it, for regex context)
is normalised like input (``normalize.py``: a secret spelled with fullwidth digits or zero-width
characters is still found) and scanned, and the hits are mapped back onto the original characters;
so any match of at most ``hold_back_chars`` characters is seen whole before any of its characters is
released. On a ``block`` hit the text before the match is released and the stream ends
(``finish_reason: "content_filter"``); ``redact`` rewrites the held text; ``log`` reports once. The
chunk that carries ``finish_reason`` releases everything still held, and the plugin releases a text
early (``final``) once the part of the answer after it begins. Latency added: the text is late by at
most ``hold_back_chars`` characters, and not at all once the choice has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from plugins.safety.normalize import leet_view, normalize
from plugins.safety.rules import Hit, RuleSet

Reporter = Callable[[Hit, bytes], None]


@dataclass(slots=True)
class _Held:
    context: str = ""  # the last released characters, scanned again for context only
    pending: str = ""  # not yet released
    released_chars: int = 0  # characters released so far (absolute offsets for de-duplication)
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
        self._choices: dict[Hashable, _Held] = {}

    def feed(self, index: Hashable, piece: str, *, final: bool) -> Release:
        """Add ``piece`` to the text ``index`` (a choice's index for its content, ``(choice, field)`` for its
        reasoning or refusal, ``(choice, tool call)`` for a tool call's arguments); returns what may be sent now
        (and the block hit, if any)."""
        held = self._choices.get(index)
        if held is None:
            held = self._choices[index] = _Held()
        held.pending += piece
        if not held.pending:
            return Release("")
        text = held.context + held.pending
        base = len(held.context)
        hits = [h for h in self._scan(text) if h.end > base]
        # A redact or log hit that touches the end of the text so far may still grow (an e-mail address
        # cut after "example.or"): act on it only once text follows it or the choice ends, and hold
        # everything from its start until then. A block acts at once: a prefix that matches is enough.
        growing = [] if final else [h for h in hits if h.end == len(text) and h.rule.action != "block"]
        if growing:
            hits = [h for h in hits if h not in growing]
        origin = held.released_chars - base  # absolute offset of text[0]
        for hit in hits:
            key = (hit.rule.id, origin + hit.start)
            if key not in held.reported:
                held.reported.add(key)
                self._report(hit, normalize(text[hit.start : hit.end])[0].encode())
        blocked = next((h for h in hits if h.rule.action == "block"), None)
        cut = len(text) if blocked is None else max(blocked.start, base)
        redactions = [
            Hit(h.rule, max(h.start, base) - base, min(h.end, cut) - base, h.label)
            for h in hits
            if h.rule.action == "redact" and h.start < cut
        ]
        pending = _redact(text[base:cut], redactions)
        if blocked is not None or final:
            return self._release(held, pending, "", blocked)
        keep_from = len(pending) - self._hold
        if growing:
            # A growing hit is a suffix of the text, untouched by the redactions before it: hold it whole.
            start = max(base, min(h.start for h in growing))
            keep_from = min(keep_from, len(pending) - (len(text) - start))
        if keep_from <= 0:
            held.pending = pending
            return Release("")
        return self._release(held, pending[:keep_from], pending[keep_from:], None)

    def _scan(self, text: str) -> list[Hit]:
        """The hits of the rules on the normalised ``text``, in character offsets of ``text`` itself."""
        norm, offsets = normalize(text)
        data = norm.encode()
        found = self._rules.scan(data)
        leet = leet_view(data) if self._rules.wording else data
        if leet is not data:  # leetspeak undone, for the wording rules (same offsets)
            found += self._rules.wording.scan(leet)
        hits: list[Hit] = []
        for hit in found:
            if len(data) == len(norm):
                start, end = hit.start, hit.end
            else:
                start = len(data[: hit.start].decode("utf-8", "ignore"))
                end = len(data[: hit.end].decode("utf-8", "ignore"))
            # A match that reaches the end of the normalised text reaches the end of the original too
            # (invisible characters after it may yet be followed by more of it).
            orig_end = len(text) if end == len(norm) else offsets.end(end)
            hits.append(Hit(hit.rule, offsets.start(start), orig_end, hit.label))
        return hits

    def _release(self, held: _Held, out: str, keep: str, blocked: Hit | None) -> Release:
        held.pending = keep
        if out:
            held.context = (held.context + out)[-self._hold :]
            held.released_chars += len(out)
        return Release(out, blocked)


def _redact(text: str, hits: list[Hit]) -> str:
    """``text`` with every span of ``hits`` (character offsets) replaced by its placeholder (overlaps
    merged, first wins)."""
    out: list[str] = []
    cursor = 0
    for hit in sorted(hits, key=lambda h: (h.start, -h.end)):
        if hit.start < cursor:
            cursor = max(cursor, hit.end)
            continue
        out.append(text[cursor : hit.start])
        out.append(hit.placeholder)
        cursor = hit.end
    out.append(text[cursor:])
    return "".join(out)
