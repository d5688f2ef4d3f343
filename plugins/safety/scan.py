"""Running a rule set over all the texts of a request (or of one answer) at once, on normalised text,
and redacting the originals.

The texts are normalised (``normalize.py``) and joined with a space into one document, so a match may
run across message and part boundaries ("Ignore all previous" in one part, "instructions" in the
next) and a rule's score (the injection heuristics) counts the whole prompt. The wording rules
(injection, words, patterns) also read that document with leetspeak undone (``normalize.leet_view``).
The texts are also scanned glued together with nothing between them, which finds a token split in two (``AKIAIOSF`` +
``ODNN7EXAMPLE``); there only matches that cross a junction count. Runs of base64 of at least
``BASE64_MIN`` characters that decode to readable UTF-8 are decoded, normalised and scanned too; a
match inside one counts for the whole run. Every match maps back to the original characters of each slot it touches; a
redaction replaces exactly those (the placeholder in the first slot, nothing in the others).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, pairwise

import re2

from plugins.safety.normalize import OffsetMap, leet_view, normalize
from plugins.safety.rules import Hit, Rule, RuleSet

BASE64_MIN = 16
#: Prompts of at most this many characters (all their texts together) are scanned on the event loop,
#: longer ones on the plugin's thread. A thread hop (tens of microseconds) costs more than a short
#: prompt's whole scan (0.02 ms at 2 KB of ASCII, 0.15 ms at 32 KB); a prompt of a few megabytes holds
#: the loop for about a second.
INLINE_SCAN_CHARS = 32_768
_BASE64_PATTERN = r"[A-Za-z0-9+/_-]{" + str(BASE64_MIN) + r",}={0,2}"
# Two engines for one pattern. RE2's scan is the faster on long texts, but its Python wrapper costs a few
# microseconds per call, most of a short prompt's whole check; Python's re (C code, and safe here: one
# character class with a repeat cannot backtrack beyond BASE64_MIN steps per start) takes short texts.
_BASE64_RUN = re2.compile(_BASE64_PATTERN)
_BASE64_RUN_SHORT = re.compile(_BASE64_PATTERN)
_SHORT = 512
_GAP = "\n\x00\n"  # between independent pieces: no rule matches across it
#: What ``surrogateescape`` decodes a byte that is not part of valid UTF-8 to (valid UTF-8 never gives these).
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True, slots=True)
class Finding:
    rule: Rule
    label: str | None
    matched: bytes  # the normalised text that matched (what the audit line hashes)
    pieces: tuple[tuple[int, int, int], ...]  # (slot index, start, end) in the original texts

    @property
    def placeholder(self) -> str:
        return f"[{self.label}]" if self.label else self.rule.placeholder


class _Doc:
    """Texts joined into one string, with where each starts."""

    __slots__ = ("data", "owners", "starts", "text")

    def __init__(self, parts: Sequence[str], owners: Sequence[int], sep: str | Sequence[str]) -> None:
        self.owners = owners
        if len(parts) == 1:  # the usual prompt: one text, no separator after the last
            self.starts = [0]
            self.text = parts[0]
            self.data = self.text.encode()
            return
        seps = [sep] * len(parts) if isinstance(sep, str) else sep  # seps[i] follows parts[i]
        self.starts = [0, *accumulate(map(len, chain.from_iterable(zip(parts, seps, strict=True))))][:-1:2]
        self.text = "".join(chain.from_iterable(zip(parts, seps, strict=True)))
        if not isinstance(sep, str) and seps and seps[-1]:
            self.text = self.text[: -len(seps[-1])]
        elif isinstance(sep, str) and sep:
            self.text = self.text[: -len(sep)]
        self.data = self.text.encode()

    def char_span(self, hit: Hit) -> tuple[int, int]:
        if len(self.data) == len(self.text):  # ASCII: bytes are characters
            return hit.start, hit.end
        head = self.data[: hit.end].decode("utf-8", "ignore")
        return len(self.data[: hit.start].decode("utf-8", "ignore")), len(head)


def _base64_text(run: str) -> str | None:
    """The text a base64 run decodes to, or None when it is not readable UTF-8 text.

    Most runs in prompts are not base64 text (hex ids, hashes, long words), so those answers come without
    raising: a length no base64 has (one more than a multiple of four, which the decoder raises for) is
    refused before decoding, and bytes that are not UTF-8 are found by a search for what
    ``surrogateescape`` makes of them instead of by a strict decode."""
    raw = run.rstrip("=")
    if len(raw) % 4 == 1:
        return None
    try:
        if "-" in raw or "_" in raw:
            decoded = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        else:
            decoded = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None
    text = decoded.decode("utf-8", "surrogateescape")
    if not text.isascii() and _ESCAPED_BYTE.search(text) is not None:
        return None
    return readable(text)


def readable(text: str) -> str | None:
    """``text`` when it reads as text (at least 95% printable characters or line breaks), else None."""
    printable = sum(1 for c in text if c.isprintable() or c in "\n\t\r")
    return text if text and printable >= 0.95 * len(text) else None


def scan_texts(rules: RuleSet, texts: Sequence[str], groups: Sequence[int] | None = None) -> list[Finding]:
    """Every match of ``rules`` in ``texts`` (normalised, joined, junctions, base64), mapped back.

    ``groups`` says which texts the model reads together (one chat conversation: one group; each
    prompt of a batch: its own); matches and junctions never run from one group into another."""
    if not rules or not texts:
        return []
    normalised = [normalize(t) for t in texts]
    found = _Findings([n for n, _ in normalised], [m for _, m in normalised])
    same = [True] * (len(texts) - 1) if groups is None else [a == b for a, b in pairwise(groups)]
    doc = found.joined(rules, same)
    found.junctions(rules, same)
    found.base64_runs(rules, doc)
    return found.findings


class _Findings:
    """The findings of one scan, from its passes over the normalised texts, each kept once."""

    def __init__(self, norms: list[str], maps: list[OffsetMap]) -> None:
        self.norms, self.maps = norms, maps
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, tuple[tuple[int, int, int], ...]]] = set()
        self._main_hits: dict[int, list[tuple[str, int, int]]] = {}  # text -> (rule, start, end), normalised

    def add(self, hit: Hit, matched: bytes, pieces: list[tuple[int, int, int]]) -> None:
        pieces_t = tuple(p for p in pieces if p[2] > p[1]) or tuple(pieces[:1])
        key = (hit.rule.id, pieces_t)
        if key not in self._seen:
            self._seen.add(key)
            self.findings.append(Finding(hit.rule, hit.label, matched, pieces_t))

    def joined(self, rules: RuleSet, same: list[bool]) -> _Doc:
        """1. The whole prompt, normalised and joined with spaces; then its leetspeak view for the wording
        rules (the same characters at the same offsets). Returns the joined document."""
        norms, maps = self.norms, self.maps
        seps = [
            _GAP if not joined else "" if _edge_space(norms[i], norms[i + 1]) else " " for i, joined in enumerate(same)
        ]
        doc = _Doc(norms, range(len(norms)), [*seps, ""])
        for hit in rules.scan(doc.data):
            start, end = doc.char_span(hit)
            self.add(hit, doc.data[hit.start : hit.end], _pieces(doc, maps, norms, start, end))
            first = bisect_index(doc.starts, start)
            self._main_hits.setdefault(first, []).append(
                (hit.rule.id, start - doc.starts[first], end - doc.starts[first])
            )
        leet = leet_view(doc.data) if rules.wording else doc.data
        if leet is not doc.data:
            for hit in rules.wording.scan(leet):
                start, end = doc.char_span(hit)
                self.add(hit, leet[hit.start : hit.end], _pieces(doc, maps, norms, start, end))
        return doc

    def junctions(self, rules: RuleSet, same: list[bool]) -> None:
        """2. The texts glued with nothing between them: a token split across two texts. Only matches that
        cross a junction count (the rest the first pass saw), and not when the left text alone already
        matched the same rule there (an address followed by a word is not a split address)."""
        norms = self.norms
        if len(norms) < 2:
            return
        glued = _Doc(norms, range(len(norms)), [*("" if joined else _GAP for joined in same), ""])
        for hit in rules.scan(glued.data):
            start, end = glued.char_span(hit)
            i = bisect_index(glued.starts, start)
            if end <= glued.starts[i] + len(norms[i]):
                continue  # inside one text
            local_start = start - glued.starts[i]
            if any(rule == hit.rule.id and end_ > local_start for rule, _, end_ in self._main_hits.get(i, ())):
                continue
            self.add(hit, glued.data[hit.start : hit.end], _pieces(glued, self.maps, norms, start, end))

    def base64_runs(self, rules: RuleSet, doc: _Doc) -> None:
        """3. Base64 runs of the joined document that decode to text; a match inside one counts for the run."""
        decoded: list[str] = []
        runs: list[tuple[int, int, int]] = []  # (slot, original start, original end) per decoded text
        finder = _BASE64_RUN_SHORT if len(doc.text) < _SHORT else _BASE64_RUN
        for match in finder.finditer(doc.text):
            text = _base64_text(match.group())
            if text is None:
                continue
            decoded.append(normalize(text)[0])
            runs.append(_pieces(doc, self.maps, self.norms, *match.span())[0])
        if not decoded:
            return
        bdoc = _Doc(decoded, range(len(decoded)), _GAP)
        for hit in rules.scan(bdoc.data):
            start, _ = bdoc.char_span(hit)
            self.add(hit, bdoc.data[hit.start : hit.end], [runs[bisect_index(bdoc.starts, start)]])


def _edge_space(left: str, right: str) -> bool:
    """Whether whitespace already separates ``left`` and ``right`` (or one of them is empty)."""
    return not left or not right or left[-1] == " " or right[0] == " "


def bisect_index(starts: Sequence[int], at: int) -> int:
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= at:
            lo = mid + 1
        else:
            hi = mid
    return max(lo - 1, 0)


def _pieces(
    doc: _Doc, maps: Sequence[OffsetMap], norms: Sequence[str], start: int, end: int
) -> list[tuple[int, int, int]]:
    """The original spans, per text, of the joined document's characters ``start:end``."""
    pieces: list[tuple[int, int, int]] = []
    i = bisect_index(doc.starts, start)
    while i < len(norms) and doc.starts[i] < end:
        a = max(start - doc.starts[i], 0)
        b = min(end - doc.starts[i], len(norms[i]))
        if b > a or not pieces:
            pieces.append((doc.owners[i], *maps[i].span(a, max(a, b))))
        i += 1
    return pieces


def redact_texts(texts: Sequence[str], findings: Sequence[Finding]) -> dict[int, str]:
    """The new text of each slot that a redact finding touches: original spans replaced (overlaps
    merged, first wins; the placeholder goes where the match starts)."""
    edits: dict[int, list[tuple[int, int, str]]] = {}
    for finding in findings:
        for n, (slot, start, end) in enumerate(finding.pieces):
            edits.setdefault(slot, []).append((start, end, finding.placeholder if n == 0 else ""))
    out: dict[int, str] = {}
    for slot, spans in edits.items():
        text = texts[slot]
        parts: list[str] = []
        cursor = 0
        for start, end, placeholder in sorted(spans, key=lambda s: (s[0], -s[1])):
            if start < cursor:
                cursor = max(cursor, end)  # overlaps the span just replaced: swallowed by it
                continue
            parts.append(text[cursor:start])
            parts.append(placeholder)
            cursor = max(end, start)
        parts.append(text[cursor:])
        out[slot] = "".join(parts)
    return out


def clip(finding: Finding, slot: int, cut: int) -> Finding:
    """``finding`` without what lies at or past ``cut`` in text ``slot`` (that text was cut there)."""
    pieces = tuple(
        (i, a, min(b, cut)) if i == slot else (i, a, b) for i, a, b in finding.pieces if i != slot or a < cut
    )
    return Finding(finding.rule, finding.label, finding.matched, pieces)
