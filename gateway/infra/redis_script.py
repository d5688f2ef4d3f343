"""A Lua script call whose keys and trailing arguments stay the same from call to call, packed once.

hiredis packs a command at about a thousand instructions per argument (an integer goes through
``repr``, each length through ``sprintf``). Tenancy's admission and charge scripts send about forty
arguments each, and only three or four of them change from request to request: the keys and limits of
a request's plan change once an hour. A ``ScriptCall`` packs the fixed part when it is made, and each
call packs only what changes in front of it (``RedisPipeline.run_script``). The bytes on the wire are
the same as ``EVALSHA sha numkeys *keys *varying *fixed`` packed whole (tests/infra/test_redis_script.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis


class ScriptCall:
    """``script`` (a registered ``redis.commands.core.AsyncScript``) with its ``keys`` and the arguments
    that follow the varying ones (``fixed``), the command's fixed parts packed in RESP."""

    __slots__ = ("_count", "_head", "_tail", "fixed", "keys", "script")

    def __init__(self, script: Any, keys: Sequence[Any], fixed: Sequence[Any]) -> None:
        self.script = script
        self.keys = list(keys)
        self.fixed = list(fixed)
        self._head = bulk_strings(("EVALSHA", script.sha, len(self.keys), *self.keys))
        self._tail = bulk_strings(self.fixed)
        self._count = 3 + len(self.keys) + len(self.fixed)

    def args(self, varying: Sequence[Any]) -> list[Any]:
        """The script's ARGV for a call: the varying arguments, then the fixed ones."""
        return [*varying, *self.fixed]

    def command(self, varying: Sequence[Any]) -> bytes:
        """The whole EVALSHA command in RESP, as ``hiredis.pack_command`` would pack it."""
        packed = [b"*%d\r\n" % (self._count + len(varying)), self._head]
        for value in varying:
            if type(value) is int:  # the usual varying argument: a count of tokens
                digits = b"%d" % value
                packed.append(b"$%d\r\n%b\r\n" % (len(digits), digits))
            else:
                packed.append(bulk_strings((value,)))
        packed.append(self._tail)
        return b"".join(packed)


def bulk_strings(args: Sequence[Any]) -> bytes:
    """``args`` as RESP bulk strings, encoded as hiredis encodes a command's arguments (without the
    array header that ``pack_command`` puts before them)."""
    if not args:
        return b""
    packed: bytes = hiredis.pack_command(tuple(args))
    return packed[packed.index(b"\r\n") + 2 :]
