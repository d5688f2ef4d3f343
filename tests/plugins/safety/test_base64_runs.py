"""The base64 run finder's two engines (Python's re for short texts, RE2 for long ones) find the same
runs, so where a prompt's length falls never changes what is decoded and scanned; and a run's text is
what a strict decode gives, though the decoder raises nothing for the usual runs that are not text."""

from __future__ import annotations

import base64
import binascii

from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.safety.config import RuleConfig
from plugins.safety.rules import RuleSet, build_rule
from plugins.safety.scan import (
    _BASE64_RUN,
    _BASE64_RUN_SHORT,
    _SHORT,
    BASE64_MIN,
    _base64_text,
    readable,
    scan_texts,
)

ALPHABET = "AZaz09+/_-= .\n\u00e9"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=200))
def test_both_engines_find_the_same_runs(text: str) -> None:
    short = [m.span() for m in _BASE64_RUN_SHORT.finditer(text)]
    long = [m.span() for m in _BASE64_RUN.finditer(text)]
    assert short == long


def test_an_encoded_secret_is_found_in_a_short_and_a_long_prompt() -> None:
    config = RuleConfig.model_validate(
        {"id": "aws", "kind": "pattern", "patterns": [r"AKIA[0-9A-Z]{16}"], "action": "redact"}
    )
    rules = RuleSet([build_rule(config, [])])
    encoded = base64.b64encode(b"key AKIAIOSFODNN7EXAMPLE here").decode()
    assert len(encoded) >= BASE64_MIN
    short = f"look: {encoded}"
    long = "plain words " * (_SHORT // 12 + 1) + encoded
    assert len(short) < _SHORT <= len(long)
    for text in (short, long):
        assert [f.rule.id for f in scan_texts(rules, [text])] == ["aws"]


def _strict_text(run: str) -> str | None:
    """What ``_base64_text`` answers, by the decoders raising: a strict UTF-8 decode of the run, then the
    same readability test."""
    raw = run.rstrip("=")
    try:
        if "-" in raw or "_" in raw:
            decoded = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))
        else:
            decoded = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
        text = decoded.decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    return readable(text)


_RUNS = st.one_of(
    st.text(alphabet="0123456789abcdef-", min_size=BASE64_MIN, max_size=40),  # hex ids, hashes, uuids
    st.builds(
        lambda data, urlsafe, cut, pad: (
            (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(data).decode().rstrip("=")[: cut or None]
            + "=" * pad
        ),
        st.one_of(
            st.binary(max_size=40),
            st.text(max_size=20).map(str.encode),
            # readable text and one byte that is not UTF-8: enough printable characters to pass that test
            st.tuples(
                st.text(alphabet="abcdefgh ijklmn", min_size=30, max_size=40), st.binary(min_size=1, max_size=1)
            ).map(lambda pair: pair[0].encode() + pair[1]),
        ),
        st.booleans(),
        st.integers(-3, 0),
        st.integers(0, 2),
    ),
)


@settings(max_examples=500, deadline=None)
@given(_RUNS)
def test_a_runs_text_is_what_a_strict_decode_gives(run: str) -> None:
    assert _base64_text(run) == _strict_text(run)


def test_text_that_is_not_utf8_or_of_no_base64_length_is_not_text() -> None:
    # not UTF-8, though 40 of its 41 characters are readable
    assert _base64_text(base64.b64encode(b"a fairly long readable sentence of text \xff").decode()) is None
    assert _base64_text("a" * 17) is None  # 17 characters: no base64 has that length
    assert _base64_text(base64.b64encode("une clé secrète".encode()).decode()) == "une clé secrète"
