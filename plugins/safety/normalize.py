"""What rules match against: a normalised copy of the text, with a map back to the original.

Evasions that leave a text readable to the model but not to a regex are undone before matching:

1. NFKC per character (fullwidth digits U+FF14 U+FF11 -> ``41``, mathematical bold letters -> ASCII,
   ligatures);
2. Unicode's Default_Ignorable_Code_Point set (from the ``regex`` package's Unicode tables, not a hand
   list: zero-width space/joiners, word joiner, soft hyphen, BOM, variation selectors, bidi controls...)
   and lone combining marks (``i`` U+0307 ``gnore``) are removed, with two exceptions that are folded
   instead: tag characters U+E0020-U+E007E, which spell ASCII invisibly ("ASCII smuggling"), become
   that ASCII, and the Hangul fillers (U+3164, U+115F, U+1160, U+FFA0), which render as blank space,
   become spaces;
3. confusable folding: a non-ASCII character whose Unicode confusable prototype (``confusables.txt``,
   as shipped by the ``confusable-homoglyphs`` package) is ASCII becomes that ASCII (Cyrillic
   U+0430 -> ``a``, Greek U+039F -> ``O``). ASCII itself is never folded (``0``/``O``, ``1``/``l`` stay), so
   digits of a card number keep their meaning;
4. spaced-out letters are joined: two or more single letters each separated by one space
   (``i g n o r e   a l l``) become a word (a wider gap or punctuation stays a word boundary);
5. whitespace folding: every run of whitespace becomes one space.

Leetspeak (``1gn0r3``) is not undone here, since it would rewrite digits that matter (a key, a card
number); ``leet_view`` gives the copy the word and injection rules read as well (``scan.py``).

The result comes with an ``OffsetMap``: any span of the normalised text maps to the span of the
original that produced it, so a redaction replaces exactly the original characters (zero-width
characters and fullwidth digits included). Plain ASCII text with single spaces and no spaced-out
letters is its own normalisation and costs one ``isascii``, a ``translate`` and one regex search (the
spaced-letter hint).
"""

from __future__ import annotations

import json
import re
import string
import unicodedata
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import re2
import regex

#: Unicode's Default_Ignorable_Code_Point property, from the tables the ``regex`` package keeps current.
_IGNORABLE = regex.compile(r"\p{Default_Ignorable_Code_Point}")
#: Default-ignorable characters that render as blank space: folded to a space, not removed.
_FILLERS = frozenset("\u115f\u1160\u3164\uffa0")
# ASCII whitespace other than the space becomes a space first: one for one, so offsets do not move.
_ASCII_SPACES = str.maketrans("\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f", " " * 9)
# The same for ASCII text as bytes: ``bytes.translate`` reads a 256-byte table, where ``str.translate`` looks
# each distinct character up in the dict above and raises (and clears) a KeyError for each it leaves alone,
# which cost more than the rest of a short prompt's normalisation.
_ASCII_SPACES_BYTES = bytes.maketrans(b"\t\n\r\x0b\x0c\x1c\x1d\x1e\x1f", b" " * 9)
_SPACE = re.compile(r"\s+")


@lru_cache(maxsize=1)
def _confusables() -> dict[str, str]:
    """Non-ASCII character -> its ASCII look-alike, from the confusable-homoglyphs package's data
    (generated from Unicode's confusables.txt; MIT licence). Loaded once, never downloaded."""
    raw = json.loads(resources.files("confusable_homoglyphs").joinpath("confusables.json").read_text("utf-8"))
    table: dict[str, str] = {}
    for char, entries in raw.items():
        if len(char) != 1 or char.isascii():
            continue
        for entry in entries:
            target = entry.get("c", "")
            # A letter folds only to letters (Cyrillic U+0431 is a look-alike of "6", but making digits out
            # of words would invent card numbers); other characters to anything printable.
            if char.isalpha() and not target.isalpha():
                continue
            if target and target.isascii() and target.isprintable() and not target.isspace():
                # The prototype of a capital I look-alike (Greek Iota, Cyrillic I) is "l": keep it a capital.
                table[char] = "I" if target == "l" and char.isupper() else target
                break
    return table


def _invisible(char: str) -> bool:
    return _IGNORABLE.match(char) is not None or unicodedata.category(char) in ("Mn", "Me", "Cf")


@lru_cache(maxsize=8192)
def fold_char(char: str) -> str:
    """The normalised form of one non-ASCII character ("" when it is invisible)."""
    if "\U000e0020" <= char <= "\U000e007e":
        return chr(ord(char) - 0xE0000)  # a tag character: the ASCII it spells
    if char in _FILLERS:
        return " "
    if char in (_DROPPED, _EXPANDED) or _invisible(char):
        return ""
    out = []
    for c in unicodedata.normalize("NFKC", char):
        if c.isascii():
            out.append(c)
        elif _invisible(c):
            continue
        elif c.isspace():
            out.append(" ")
        else:
            out.append(_confusables().get(c, c))
    return "".join(out)


_DROPPED = "\ue000"  # what a character that folds to nothing becomes in the one-to-one pass
_EXPANDED = "\ue001"  # ... and one that folds to several characters (a ligature, a circled number)


class _FoldTable(dict[int, str]):
    """Code point -> its normalised form as exactly one character, for ``str.translate``: a character
    that folds to nothing becomes ``_DROPPED``, one that folds to several ``_EXPANDED`` (both handled
    afterwards, one by one). Filled on first sight of a character, but only with assigned,
    non-private characters (about 150,000 exist): a client sending unassigned or private-use code
    points can neither grow the table without bound nor push other clients' characters out of it."""

    def __init__(self) -> None:
        super().__init__((code, chr(code)) for code in range(128))
        self.update({code: " " for code in _ASCII_SPACES})  # ASCII whitespace becomes a space here too

    def __missing__(self, code: int) -> str:
        folded = fold_char(chr(code))
        value = folded if len(folded) == 1 else _EXPANDED if folded else _DROPPED
        if len(self) < _TABLE_MAX and unicodedata.category(chr(code)) not in ("Cn", "Co", "Cs"):
            self[code] = value
        return value


_TABLE_MAX = 1 << 18  # a backstop: assigned characters alone stay below it
_FOLD = _FoldTable()
_NOT_ONE_TO_ONE = re.compile("[\ue000\ue001]+")
_SPACE_RUN = re.compile(" {2,}")
# RE2 (linear, and fast on long texts): one or more single letters after a single letter, each
# separated by one space, between non-word characters. The hint is the cheap test that one exists.
_SPACED = re2.compile(r"(?:^|[^\pL\pN_])(\pL(?: \pL)+)(?:[^\pL\pN_]|$)")
_SPACED_HINT = re2.compile(r" \pL \pL(?:[^\pL\pN_]|$)")
# The same hint for short texts, where the cost of a call into RE2 is most of the work (C regex,
# linear here: no repeat; the leading space lets it skip ahead).
_SPACED_HINT_SHORT = re.compile(r" [^\W\d_] [^\W\d_](?!\w)")
_SHORT = 512
#: Leetspeak: a digit or symbol beside a letter in a word of letters, digits and symbols, and the letter
#: each stands for. Read on UTF-8 bytes (the letters changed are ASCII: offsets do not move), through each
#: byte's kind: ``a`` a letter, ``1`` a digit or symbol, a space anything else.
_LEET = bytes.maketrans(b"013457@$", b"oieastas")
_LETTERS = string.ascii_letters.encode()
_LEET_KINDS = bytes.maketrans(
    bytes(range(256)),
    bytes(ord("a") if b in _LETTERS else ord("1") if b in b"0123456789@$" else ord(" ") for b in range(256)),
)


@dataclass(frozen=True, slots=True)
class OffsetMap:
    """Normalised character offsets -> original ones. Segment ``i`` starts at normalised offset
    ``norm[i]``; a linear segment maps one to one from ``orig[i]``, a replacement maps all its
    characters onto the original range ``orig[i]:orig_end[i]``. ``inner``, when set, maps the result
    one step further back (normalisation runs in two steps: characters, then spaces)."""

    norm: tuple[int, ...]
    orig: tuple[int, ...]
    orig_end: tuple[int, ...]
    linear: tuple[bool, ...]
    inner: OffsetMap | None = None

    def start(self, n: int) -> int:
        i = bisect_right(self.norm, n) - 1
        at = 0 if i < 0 else self.orig[i] + (n - self.norm[i]) if self.linear[i] else self.orig[i]
        return at if self.inner is None else self.inner.start(at)

    def end(self, n: int) -> int:
        """The original offset just past what normalised characters up to ``n`` (exclusive) came from."""
        if n <= 0:
            return 0
        i = bisect_right(self.norm, n - 1) - 1
        at = 0 if i < 0 else self.orig[i] + (n - self.norm[i]) if self.linear[i] else self.orig_end[i]
        return at if self.inner is None else self.inner.end(at)

    def span(self, start: int, end: int) -> tuple[int, int]:
        return self.start(start), self.end(end)


IDENTITY = OffsetMap((0,), (0,), (0,), (True,))  # the map of a text that normalisation left alone


class _Builder:
    """Segments of a normalised text being built."""

    __slots__ = ("linear", "n", "norm", "orig", "orig_end", "out")

    def __init__(self) -> None:
        self.out: list[str] = []
        self.norm: list[int] = []
        self.orig: list[int] = []
        self.orig_end: list[int] = []
        self.linear: list[bool] = []
        self.n = 0

    def add(self, a: int, b: int, piece: str, *, linear: bool) -> None:
        if not piece:
            return
        self.norm.append(self.n)
        self.orig.append(a)
        self.orig_end.append(b)
        self.linear.append(linear)
        self.out.append(piece)
        self.n += len(piece)

    def result(self, inner: OffsetMap) -> tuple[str, OffsetMap]:
        offsets = OffsetMap(
            tuple(self.norm) or (0,),
            tuple(self.orig) or (0,),
            tuple(self.orig_end) or (0,),
            tuple(self.linear) or (True,),
            None if inner is IDENTITY else inner,
        )
        return "".join(self.out), offsets


def _fold_chars(text: str, folded: str) -> tuple[str, OffsetMap]:
    """Step 1 where some character does not fold to exactly one: ``folded`` (the one-to-one pass) is
    kept in stretches; dropped characters are left out, expanded ones written out one by one."""
    built = _Builder()
    cursor = 0
    for match in _NOT_ONE_TO_ONE.finditer(folded):
        a, b = match.span()
        built.add(cursor, a, folded[cursor:a], linear=True)
        if _EXPANDED in match.group():
            for i in range(a, b):
                if folded[i] == _EXPANDED:
                    built.add(i, i + 1, fold_char(text[i]), linear=False)
        cursor = b
    built.add(cursor, len(text), folded[cursor:], linear=True)
    return built.result(IDENTITY)


def _fold_spaces(text: str, inner: OffsetMap) -> tuple[str, OffsetMap]:
    """Step 2: every run of spaces becomes one."""
    built = _Builder()
    cursor = 0
    for match in _SPACE_RUN.finditer(text):
        a, b = match.span()
        built.add(cursor, a, text[cursor:a], linear=True)
        built.add(a, b, " ", linear=False)
        cursor = b
    built.add(cursor, len(text), text[cursor:], linear=True)
    return built.result(inner)


def _word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


def _may_be_spaced(text: str) -> bool:
    """A cheap test that ``text`` may hold spaced-out letters (``_SPACED`` then finds them)."""
    if " " not in text:
        return False
    if text[1:2] == " " and text[:1].isalpha() and text[2:3].isalpha() and not _word_char(text[3:4]):
        return True
    if len(text) < _SHORT:
        return _SPACED_HINT_SHORT.search(text) is not None
    return _SPACED_HINT.search(text.encode()) is not None  # RE2 on bytes: no offsets to convert


def _join_spaced(text: str, inner: OffsetMap) -> tuple[str, OffsetMap]:
    """Step 4: each run of spaced-out letters becomes one word, mapped onto the whole run."""
    built = _Builder()
    cursor = 0
    # ASCII: RE2 on the bytes, whose offsets are the characters' (on a str it converts every offset).
    spans = (m.span(1) for m in _SPACED.finditer(text.encode() if text.isascii() else text))
    for a, b in spans:
        built.add(cursor, a, text[cursor:a], linear=True)
        built.add(a, b, text[a:b].replace(" ", ""), linear=False)
        cursor = b
    if cursor == 0:
        return text, inner
    built.add(cursor, len(text), text[cursor:], linear=True)
    return built.result(inner)


def leet_view(data: bytes) -> bytes:
    """``data`` (UTF-8) with leetspeak undone in the words that mix letters with digits or ``@``/``$``
    (``1gn0r3 4ll`` -> ``ignore all``), byte for byte (offsets do not move); words of digits alone stay.
    Returns ``data`` itself when there is nothing to undo."""
    parts: list[bytes] = []
    cursor = 0
    for a, b in _leet_words(data.translate(_LEET_KINDS)):
        parts += (data[cursor:a], data[a:b].translate(_LEET))
        cursor = b
    if not parts:
        return data
    parts.append(data[cursor:])
    return b"".join(parts)


def _leet_words(kinds: bytes) -> Iterator[tuple[int, int]]:
    """The spans of the words (runs of kinds ``a`` and ``1``) that hold an ``a`` beside a ``1``, in order.

    All C searches of ``kinds``: a regular expression took about a microsecond of a short prompt's view per
    search (Python's ``re`` tries both pairs at each byte; RE2's Python wrapper costs that per call and per
    match). Each pair is looked for again only past the word it was found in, and a word is widened to its
    spaces once, so the whole is linear in the text."""
    size = len(kinds)
    after, before = kinds.find(b"a1"), kinds.find(b"1a")
    while after >= 0 or before >= 0:
        hint = after if before < 0 or 0 <= after < before else before
        start = kinds.rfind(b" ", 0, hint) + 1
        stop = kinds.find(b" ", hint)
        stop = size if stop < 0 else stop
        yield start, stop
        if 0 <= after < stop:
            after = kinds.find(b"a1", stop)
        if 0 <= before < stop:
            before = kinds.find(b"1a", stop)


def normalize(text: str) -> tuple[str, OffsetMap]:
    """The normalised text and its map back to ``text``. Costs a few C-speed passes (``translate``,
    RE2) plus Python work only per character that does not fold one-to-one and per run of spaces."""
    offsets = IDENTITY
    if text.isascii():
        text = text.encode("ascii").translate(_ASCII_SPACES_BYTES).decode("ascii")
    else:
        folded = text.translate(_FOLD)  # one pass: characters and ASCII whitespace
        if _DROPPED in folded or _EXPANDED in folded:
            folded, offsets = _fold_chars(text, folded)
        text = folded
    if _may_be_spaced(text):
        text, offsets = _join_spaced(text, offsets)
    if "  " in text:
        text, offsets = _fold_spaces(text, offsets)
    return text, offsets
