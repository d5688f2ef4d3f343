"""The base64 run finder's two engines (Python's re for short texts, RE2 for long ones) find the same
runs, so where a prompt's length falls never changes what is decoded and scanned."""

from __future__ import annotations

import base64

from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.safety.config import RuleConfig
from plugins.safety.rules import RuleSet, build_rule
from plugins.safety.scan import _BASE64_RUN, _BASE64_RUN_SHORT, _SHORT, BASE64_MIN, scan_texts

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
