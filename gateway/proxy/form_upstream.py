"""A multipart upload (vLLM's audio routes) taking the ordinary trip.

The plugins and the ``Proxy`` work on a JSON body: an audio request's context holds its form fields as
one (``model``, ``language``, ``prompt``, ...), so tenancy, safety and routing read and may rewrite them as
on any request (an alias resolved, a fallback model). ``FormUpstream`` stands in for the pooled client on
that one request: whatever JSON body the Proxy sends is rendered back into ``multipart/form-data`` with the
uploaded files, under a boundary of its own. Pure rendering and one delegation: no I/O of its own.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, cast

import orjson

from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig, UpstreamResponse


@dataclass(frozen=True, slots=True)
class FilePart:
    name: str
    filename: str
    content_type: str
    data: bytes


def _quoted(value: str) -> str:
    """A name for a Content-Disposition parameter: quotes, backslashes and line breaks cannot end it early."""
    return value.replace("\\", "\\\\").replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


def encode_form(fields: dict[str, Any], files: list[FilePart], boundary: str) -> bytes:
    """``multipart/form-data`` of ``fields`` (a list value: the field repeated) and ``files``."""
    marker = f"--{boundary}\r\n".encode("latin-1")
    parts: list[bytes] = []
    for name, value in fields.items():
        for item in value if isinstance(value, list) else [value]:
            text = item if isinstance(item, str) else orjson.dumps(item).decode()
            head = f'Content-Disposition: form-data; name="{_quoted(name)}"\r\n\r\n'
            parts += [marker, head.encode("utf-8"), text.encode("utf-8"), b"\r\n"]
    for part in files:
        head = (
            f'Content-Disposition: form-data; name="{_quoted(part.name)}"; filename="{_quoted(part.filename)}"\r\n'
            f"Content-Type: {part.content_type or 'application/octet-stream'}\r\n\r\n"
        )
        parts += [marker, head.encode("utf-8"), part.data, b"\r\n"]
    parts.append(f"--{boundary}--\r\n".encode("latin-1"))
    return b"".join(parts)


class FormUpstream:
    """The pooled client as one multipart request's ``Proxy`` sees it: each JSON body it sends goes out as
    the form, with its files."""

    def __init__(self, inner: UpstreamClient, files: list[FilePart]) -> None:
        self.inner = inner
        self.files = files
        self.boundary = "gateway-" + uuid.uuid4().hex
        while any(self.boundary.encode() in part.data for part in files):  # never inside an upload
            self.boundary = "gateway-" + uuid.uuid4().hex

    @property
    def config(self) -> UpstreamConfig:
        return self.inner.config

    async def open(
        self, base_url: str, path: str, body: bytes, *, headers: dict[str, str] | None = None
    ) -> UpstreamResponse:
        form = encode_form(orjson.loads(body), self.files, self.boundary)
        sent = {**(headers or {}), "Content-Type": f"multipart/form-data; boundary={self.boundary}"}
        return await self.inner.open(base_url, path, form, headers=sent)


def form_services(services: Services, files: list[FilePart]) -> Services:
    """``services`` for one multipart request: the same everything, its own stand-in for the client."""
    # A structural stand-in: the Proxy only opens requests and reads the config on a non-streamed trip.
    copy = dataclasses.replace(services, upstream=cast(UpstreamClient, FormUpstream(services.upstream, files)))
    copy.recordings = services.recordings  # process-wide: ``replace`` made a new one
    return copy
