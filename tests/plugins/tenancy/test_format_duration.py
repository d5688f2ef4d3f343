"""``format_duration``'s integer path (whole milliseconds under an hour, as Redis gives a reset) writes
what its general path writes for the same duration as a float."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from plugins.tenancy.budgets import format_duration


def test_every_whole_millisecond_of_the_first_two_minutes() -> None:
    # every edge of the fast path's arithmetic: the ms/s switch, each fraction, the first whole minutes
    mismatched = [ms for ms in range(120_001) if format_duration(ms) != format_duration(float(ms))]
    assert mismatched == []


@given(st.integers(min_value=0, max_value=3_600_000 + 5_000))
def test_whole_milliseconds_as_the_general_path_writes_them(ms: int) -> None:
    assert format_duration(ms) == format_duration(float(ms))


def test_the_texts_openai_writes() -> None:
    cases = {0: "0ms", 999: "999ms", 1000: "1s", 1500: "1.5s", 59_990: "59.99s", 60_000: "1m0s"}
    cases |= {60_001: "1m0.001s", 3_599_999: "59m59.999s", 3_600_000: "1h0m0s", 3_723_000: "1h2m3s"}
    assert {ms: format_duration(ms) for ms in cases} == cases


def test_negative_and_fractional_durations_take_the_general_path() -> None:
    assert [format_duration(-3), format_duration(20.7), format_duration(1500.0)] == ["0ms", "20ms", "1.5s"]
