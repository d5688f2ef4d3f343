"""HTTP routes: ``openai`` (the /v1 API), ``responses`` (/v1/responses), ``models``, ``health``, ``admin``,
``admin_views`` (what the operator console reads), ``utility``. ``JSON`` is the response class every
FastAPI route here uses (orjson-rendered).

May import the server's own modules and every layer below the server.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
