"""Where file contents live: a small interface, and a directory on disk as its default implementation.

Contents are written and read in pieces on a thread (never the event loop), so a large upload or
download costs the loop nothing but the hand-over of each piece. A file being written is invisible
until ``commit`` (written as ``<name>.<random>.part``, then renamed), so a reader never sees half a file and a
replica killed mid-write leaves only a ``.part`` behind. Several replicas need the same directory (a
shared volume) or another implementation of ``BlobStore`` (an object store).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO, Protocol

_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
READ_CHUNK = 1 << 20


class BlobWriter(Protocol):
    """One blob being written: ``write`` pieces, then ``commit`` (visible) or ``abort`` (gone)."""

    async def write(self, data: bytes) -> None: ...

    async def commit(self) -> None: ...

    async def abort(self) -> None: ...


class BlobStore(Protocol):
    """Blobs by name (names are ids the gateway made: letters, digits, ``_`` and ``-``)."""

    async def open_writer(self, name: str) -> BlobWriter: ...

    def read(self, name: str) -> AsyncIterator[bytes]:
        """The blob's bytes in pieces; ``FileNotFoundError`` when there is none."""
        ...

    async def delete(self, name: str) -> None: ...


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a blob name: {name!r}")
    return name


class _DirWriter:
    def __init__(self, handle: BinaryIO, part: Path, final: Path) -> None:
        self._handle, self._part, self._final = handle, part, final

    async def write(self, data: bytes) -> None:
        await asyncio.to_thread(self._handle.write, data)

    async def commit(self) -> None:
        def finish() -> None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            os.replace(self._part, self._final)

        await asyncio.to_thread(finish)

    async def abort(self) -> None:
        def drop() -> None:
            self._handle.close()
            with contextlib.suppress(FileNotFoundError):
                self._part.unlink()

        await asyncio.to_thread(drop)


class DirectoryStore:
    """Blobs as files in one directory (created on first write)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    async def open_writer(self, name: str) -> BlobWriter:
        final = self.root / _checked(name)
        part = final.with_name(f"{final.name}.{secrets.token_hex(4)}.part")  # two writers never share one

        def open_part() -> BinaryIO:
            self.root.mkdir(parents=True, exist_ok=True)
            return part.open("wb")

        return _DirWriter(await asyncio.to_thread(open_part), part, final)

    async def read(self, name: str) -> AsyncIterator[bytes]:
        handle = await asyncio.to_thread((self.root / _checked(name)).open, "rb")
        try:
            while True:
                piece = await asyncio.to_thread(handle.read, READ_CHUNK)
                if not piece:
                    return
                yield piece
        finally:
            await asyncio.to_thread(handle.close)

    async def delete(self, name: str) -> None:
        def unlink() -> None:
            with contextlib.suppress(FileNotFoundError):
                (self.root / _checked(name)).unlink()

        await asyncio.to_thread(unlink)
