"""``gateway.infra.redis_script.ScriptCall``: a script call packed in two parts (the fixed part once,
the varying part per call) gives the same bytes as hiredis packing the whole command, for every kind of
argument hiredis accepts."""

from __future__ import annotations

from typing import Any

import hiredis
import pytest

from gateway.infra.redis_script import ScriptCall, bulk_strings


class _Script:
    """What ScriptCall reads of a registered script: its SHA."""

    sha = "a37bfdbc1c59409f9b34a1530ac49be0577c4ba0"


VALUES: list[Any] = [0, 7, -1, 2**63 - 1, -(2**70), b"", b"\x00\r\n$*", "", "ascii", "caf\u00e9 \U0001f600", 1.5, -0.25]


@pytest.mark.parametrize(
    ("keys", "fixed", "varying"),
    [
        (["t:{a}:rpm", "t:{a}:tpm"], [2, 1_000_000_000, 60_000, 1], [29, 29]),
        ([], [], [1]),
        (["k"], [], VALUES),
        ([b"bytes-key", "caf\u00e9"], VALUES, [3, b"x", "y"]),
        (["k"], [1, 2], []),
    ],
)
def test_a_call_packs_to_the_bytes_of_the_whole_command(keys: list[Any], fixed: list[Any], varying: list[Any]) -> None:
    call = ScriptCall(_Script(), keys, fixed)
    whole = hiredis.pack_command(("EVALSHA", _Script.sha, len(keys), *keys, *varying, *fixed))
    assert call.command(varying) == whole
    assert call.args(varying) == [*varying, *fixed]
    assert call.keys == keys


def test_a_call_is_reused_with_other_varying_arguments() -> None:
    call = ScriptCall(_Script(), ["k1", "k2"], [10, 20])
    for varying in ([1, 2], [300, -4], [b"z", "w", 5]):
        assert call.command(varying) == hiredis.pack_command(("EVALSHA", _Script.sha, 2, "k1", "k2", *varying, 10, 20))


def test_bulk_strings_are_the_arguments_without_the_array_header() -> None:
    assert bulk_strings([]) == b""
    assert bulk_strings(["GET", 12]) == b"$3\r\nGET\r\n$2\r\n12\r\n"
