"""A KV event publisher speaking vLLM's wire (``vllm/distributed/kv_events.py``: PUB frames
``[topic, seq, payload]``, a ROUTER replay socket answering ``["", topic, seq, payload]`` then the end
marker), over real IPC sockets, with the faults a test needs: a batch sent only to the replay buffer
(a gap), a buffer that forgot old batches, a restart (sequence numbers from 0 again)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from gateway.upstream.kv_source import KvSource
from gateway.upstream.kv_wire import encode_batch


def stored(hashes: list[int], tokens: list[int] | None = None, parent: int | None = None, block_size: int = 4) -> dict:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens or [],
                             "block_size": block_size, "medium": "GPU"}  # fmt: skip
    if parent is not None:
        event["parent_block_hash"] = parent
    return event


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


CLEARED: dict = {"type": "AllBlocksCleared"}


class FakePublisher:
    def __init__(self, topic: str = "kv@test", buffer_steps: int = 100) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvpub")
        base = Path(self._dir.name)
        self.source = KvSource(f"ipc://{base}/pub", f"ipc://{base}/replay", topic)
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.source.endpoint)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(self.source.replay_endpoint or "")
        self._topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replays = 0
        self.hold_replay_end: asyncio.Event | None = None  # when set here, the end marker waits for it
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(self, events: list[dict], *, drop: bool = False) -> int:
        """One batch; with ``drop`` it goes to the replay buffer only (a subscriber sees a gap)."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(events, ts=1.0)
        self.buffer.append((seq, payload))
        if not drop:
            await self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """A new worker process: empty buffer, sequence from 0."""
        self.buffer.clear()
        self.seq = 0

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self._router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self._router.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
            if self.hold_replay_end is not None:
                await self.hold_replay_end.wait()
            await self._router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._pub.close(0)
        self._router.close(0)
        self._ctx.term()
        self._dir.cleanup()


class ThreadedPublisher:
    """The same wire from plain (blocking) sockets, for tests whose gateway runs in another thread: the
    replay socket is served by a thread of its own."""

    def __init__(self, topic: str = "kv@test") -> None:
        import threading

        self._dir = tempfile.TemporaryDirectory(prefix="kvpub")
        base = Path(self._dir.name)
        self.source = KvSource(f"ipc://{base}/pub", f"ipc://{base}/replay", topic)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.source.endpoint)
        self._topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=1000)
        self.seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, events: list[dict]) -> None:
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            payload = encode_batch(events, ts=1.0)
            self.buffer.append((seq, payload))
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.source.replay_endpoint or "")
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                client, _, start = router.recv_multipart()
                first = int.from_bytes(start, "big")
                with self._lock:
                    buffered = [(s, p) for s, p in self.buffer if s >= first]
                for seq, payload in buffered:
                    router.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        finally:
            router.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pub.close(0)
        self._ctx.term()
        self._dir.cleanup()
