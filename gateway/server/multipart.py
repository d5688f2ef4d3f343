"""A ``multipart/form-data`` body read as it arrives: a few small fields kept (bounded), the one file part handed
on as pieces (``file_pieces``), so an upload is streamed to its store without being held in memory.

python-multipart's push parser does the parsing; this turns its callbacks into a pull iterator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header

from gateway.wire.errors import InvalidRequest

MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16  # the Files API's form has one ("purpose"); the bound keeps a form of fields from growing


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="invalid_multipart")


class FormReader:
    """One multipart body whose file part is named ``file_field``."""

    def __init__(self, content_type: str, file_field: str = "file") -> None:
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise _invalid("The body must be multipart/form-data with a boundary (a file upload).")
        self.file_field = file_field
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self._headers: dict[bytes, bytes] = {}
        self._name = b""
        self._value = b""
        self._part: str | None = None  # "file", "field" or None between parts
        self._field = bytearray()
        self._out: list[bytes] = []
        try:
            self._parser = MultipartParser(
                boundary,
                {
                    "on_header_field": self._on_header_field,
                    "on_header_value": self._on_header_value,
                    "on_header_end": self._on_header_end,
                    "on_headers_finished": self._on_headers_finished,
                    "on_part_data": self._on_part_data,
                    "on_part_end": self._on_part_end,
                },
            )
        except FormParserError as exc:
            raise _invalid(f"The multipart body cannot be read: {exc}") from None

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._name += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _on_header_end(self) -> None:
        self._headers[self._name.lower()] = self._value
        self._name = self._value = b""

    def _on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._headers = {}
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name == self.file_field:
            if self.filename is not None:
                raise _invalid(f"Send one '{self.file_field}' part only.")
            self.filename = options.get(b"filename", b"upload").decode("utf-8", "replace")[:255] or "upload"
            self._part = "file"
        else:
            if len(self.fields) >= MAX_FIELDS:
                raise _invalid(f"The form has more than {MAX_FIELDS} fields.")
            self._part = "field"
            self._name = name.encode()
            self._field.clear()

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part == "file":
            self._out.append(data[start:end])
            return
        self._field += data[start:end]
        if len(self._field) > MAX_FIELD_BYTES:
            raise _invalid(f"A form field is longer than {MAX_FIELD_BYTES} bytes.")

    def _on_part_end(self) -> None:
        if self._part == "field":
            self.fields[self._name.decode()] = self._field.decode("utf-8", "replace")
            self._name = b""
        self._part = None

    async def file_pieces(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Feed ``body`` to the parser, yielding the file part's bytes as they are parsed."""
        try:
            async for chunk in body:
                self._parser.write(chunk)
                if self._out:
                    out, self._out = self._out, []
                    yield out[0] if len(out) == 1 else b"".join(out)
            self._parser.finalize()
        except FormParserError as exc:
            raise _invalid(f"The multipart body cannot be read: {exc}") from None
        if self._parser.state != MultipartState.END:  # the parser accepts a body cut short; a file is not
            raise _invalid("The multipart body ends before its closing boundary.")
        if self._out:
            out, self._out = self._out, []
            yield b"".join(out)
