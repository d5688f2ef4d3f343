"""Request paths are decoded once, before routing, and a path that means different things to
different readers is refused.

uvicorn percent-decodes the request target once into ``scope["path"]`` and every route (the inference
endpoints, FastAPI, the admin app) matches on that: ``/v1/%63hat/completions`` is
``/v1/chat/completions`` and ``/%61dmin/config`` is ``/admin/config``, behind the same token; a
double-encoded ``%2561`` stays ``%61`` (never decoded twice). Refused with a 400
(``invalid_path``), because a proxy in front, a log or a rule reading the raw target would see another
path than the route that answers:

- an encoded slash or backslash (``%2F``, ``%5C``): one segment to the raw reader, two here;
- dot segments (``.`` or ``..``, written plainly or encoded): resolved by some readers, not by others;
- a backslash, or a control character (``%00`` included), anywhere in the decoded path.

The check costs two substring tests for a path with no ``%`` and no ``/.`` (every ordinary request).
"""

from __future__ import annotations

import re
from typing import Any

from gateway.wire.errors import InvalidRequest

_CONTROL = re.compile(r"[\x00-\x1f\x7f\\]")


def path_problem(scope: Any) -> InvalidRequest | None:
    """The 400 for a path outside the rules above, else None."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    if raw.find(b"%") < 0 and raw.find(b"/.") < 0 and raw.find(b"\\") < 0:  # not `in`: gateway/wire/streaming.py
        return None
    lowered = raw.lower()
    if lowered.find(b"%2f") >= 0 or lowered.find(b"%5c") >= 0:
        reason = "an encoded '/' or '\\'"
    else:
        path: str = scope["path"]
        segments = path.split("/")
        if "." in segments or ".." in segments:
            reason = "a '.' or '..' segment"
        elif _CONTROL.search(path):
            reason = "a control character or '\\'"
        else:
            return None
    return InvalidRequest(f"The request path has {reason}; send the plain path.", code="invalid_path")
