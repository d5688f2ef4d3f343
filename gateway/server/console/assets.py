"""The console's static files and the headers they are served with.

The files are read once, when the app is built (not at import, not per request), from the package
(``static/`` is package data). The Content-Security-Policy allows only this origin's own script, style and
connections: no inline script or style, no ``eval``, no other origin, no plugins, no framing
(``frame-ancestors 'none'``, clickjacking), no ``<base>`` rewrites and no form posts.

The charting library (uPlot) is not in the repository: ``make`` fetches it from the npm registry into
``static/vendor/`` (``make vendor``). Without it the page still works, and its charts say what to run:
the missing files are served as a one-line script and an empty stylesheet that name the command.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources

log = logging.getLogger("gateway.console")

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
    "/admin/ui/charts.js": ("charts.js", "text/javascript; charset=utf-8"),
    "/admin/ui/usage.js": ("usage.js", "text/javascript; charset=utf-8"),
    "/admin/ui/batches.js": ("batches.js", "text/javascript; charset=utf-8"),
    "/admin/ui/vendor/uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/admin/ui/vendor/uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
}
#: What stands in for a vendored file that is missing (its path -> body).
MISSING_VENDOR_HELP = (
    "the console's charting library (uPlot) is not installed in gateway/server/console/static/vendor/: "
    "run `make vendor` (it fetches uplot from the npm registry) and restart the gateway"
)
_STAND_INS = {
    "vendor/uPlot.iife.min.js": f"window.gatewayConsoleMissing = {MISSING_VENDOR_HELP!r};\n".encode(),
    "vendor/uPlot.min.css": f"/* {MISSING_VENDOR_HELP} */\n".encode(),
}


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    media_type: str


def load_assets() -> dict[str, Asset]:
    """Every served path with its file's bytes (a missing vendored file: its stand-in, and a warning)."""
    static = resources.files("gateway.server.console").joinpath("static")
    assets = {}
    for path, (name, media) in FILES.items():
        file = static.joinpath(name)
        if name in _STAND_INS and not file.is_file():
            assets[path] = Asset(_STAND_INS[name], media)
        else:
            assets[path] = Asset(file.read_bytes(), media)
    if any(assets[path].body == _STAND_INS.get(name) for path, (name, _) in FILES.items()):
        log.warning("console: %s", MISSING_VENDOR_HELP)
    return assets
