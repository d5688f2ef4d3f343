"""``gateway.wire.completion_bound.can_hold``'s quick answer (the first choice's characters) agrees with the
whole bound (``most_completion_tokens``) for every answer and count."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire.completion_bound import SPECIAL_PER_CHOICE, can_hold, most_completion_tokens

_TEXT = st.text(alphabet=st.sampled_from("ab é€😀"), max_size=12)
_CALL = st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": _TEXT, "arguments": _TEXT})})
_MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "content": st.one_of(st.none(), _TEXT),
        "reasoning_content": _TEXT,
        "refusal": _TEXT,
        "tool_calls": st.lists(_CALL, max_size=2),
    },
)
_CHOICE = st.one_of(
    st.fixed_dictionaries({"message": _MESSAGE}),
    st.fixed_dictionaries({"text": st.one_of(st.none(), _TEXT)}),
    st.just("not a choice"),
)


@settings(max_examples=400)
@given(st.lists(_CHOICE, max_size=3), st.integers(min_value=-2, max_value=2))
def test_the_quick_answer_is_the_whole_bounds(choices: list[Any], off_the_bound: int) -> None:
    answer = {"choices": choices}
    bound = most_completion_tokens(answer)
    completion = max(0, bound + off_the_bound)  # near the bound, where a wrong quick answer shows
    assert can_hold(answer, completion) == (completion <= bound)


def test_multibyte_text_is_held_by_its_bytes_not_its_characters() -> None:
    answer = {"choices": [{"message": {"content": "€" * 10}}]}  # 10 characters, 30 bytes
    assert can_hold(answer, 30 + SPECIAL_PER_CHOICE)
    assert not can_hold(answer, 31 + SPECIAL_PER_CHOICE)
