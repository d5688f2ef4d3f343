"""The console's static files and the headers they are served with.

The files are read once, when the app is built (not at import, not per request), from the package
(``static/`` is package data). The Content-Security-Policy allows only this origin's own script, style and
connections: no inline script or style, no ``eval``, no other origin, no plugins, no framing
(``frame-ancestors 'none'``, clickjacking), no ``<base>`` rewrites and no form posts.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}

#: URL path -> (file in ``static/``, media type). Only these are served: no path from a request ever
#: reaches the filesystem.
FILES = {
    "/admin/ui": ("index.html", "text/html; charset=utf-8"),
    "/admin/ui/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/admin/ui/console.css": ("console.css", "text/css; charset=utf-8"),
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str


def load_assets() -> dict[str, Asset]:
    """Every served path with its file's bytes."""
    static = resources.files("gateway.server.console").joinpath("static")
    return {path: Asset(static.joinpath(name).read_bytes(), media) for path, (name, media) in FILES.items()}
