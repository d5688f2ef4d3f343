"""A batch's lines as shared work in Redis: leased by one replica at a time, each result written once.

Per batch ``<prefix>:b:<id>:``
- ``lines``: hash, line index -> the input line (JSON), written once when the batch is validated (a line
  loaded again, by a validation that ran twice, is not put back to run).
- ``todo``: sorted set of the indexes not done yet, scored by their place in the run order (lines with a
  shared prefix next to each other).
- ``leases`` (index -> expiry in ms) and ``owners`` (index -> replica): a replica that claims a line
  holds it until the expiry, renewing while it runs; a replica killed midway stops renewing and its
  lines are claimed again by whoever looks next.
- ``out`` and ``err``: hash, the line's ``custom_id`` -> ``<index> <output line>``, until the batch is final
  and its files hold them (then the batch's work is dropped, results too: Redis holds the lines and results
  of unfinished batches only). Every version of the gateway writes and reads these entries alike (a rolling
  upgrade mixes versions in one batch): a line's place in the files is the index its entry's value starts
  with, whatever the field, and ``results`` reads them in that order a chunk at a time. A line without a
  ``custom_id`` (a malformed one, recorded at validation) is keyed by the byte 0xff and its index, which no
  ``custom_id`` (UTF-8 text) can be: a line whose own ``custom_id`` is ``#line-2`` is a line of its own
  (earlier versions keyed the unnamed line 2 so; still read alike). ``record`` writes a result only while
  the batch is not final, and only when neither hash has that line yet, in one Lua script with the counters:
  two replicas that both ran a line (a lease taken over from a slow one) produce one output line, counted
  once. The one exception: a success replaces an error, so a line whose first answer was a failure (the slow
  replica's worker gave up) and whose second run succeeded ends completed, as a lone run's retry would; only
  while the batch is ``in_progress`` and not sealed (``Jobs.seal``: an expiry is writing its files from the
  results as they are, the status still ``in_progress``). Only answers count tokens (an error line has no
  usage), so a replaced error leaves nothing to take back but its count. A run that wrote an error leaves a
  lease that is no longer its own, and the batch is finalized only once no lease is live (``running``); a
  success, which nothing replaces, takes the line's lease whoever holds it.
- ``runs``: hash, index -> how many claims of the line are neither recorded nor given back: a run whose
  lease was taken over (a stalled replica) may still record, whichever run wrote first.
- ``unsettled``: set of the indexes whose error was written while another run of the line could still
  record (one holding its lease, or one of its ``runs``), so that run's success may still replace it:
  ``record_outcome`` says when a line's outcome is final (each line's once: that is when
  ``gateway_batch_lines_total`` counts it), and these are final when the last such run records, or when
  the batch is final (``Lifecycle.finalize`` counts the ones left).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.batch.redis_errors import text
from gateway.pipeline.batch_config import BatchesConfig

# KEYS todo, leases, owners, batch, runs; ARGV now_ms, lease_ms, n, owner. The indexes claimed, in run order;
# none while the batch is not in progress, or sealed by an expiry being written. Each claim is a run of the
# line until it records or gives the line back (``runs``): a lease taken over leaves the run it lapsed on.
_CLAIM = """
if redis.call('HGET', KEYS[4], 'status') ~= '"in_progress"' or redis.call('HEXISTS', KEYS[4], '_sealed') == 1 then
  return {}
end
local now = tonumber(ARGV[1])
local expiry = now + tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local got = {}
local start = 0
while #got < want do
  local idxs = redis.call('ZRANGE', KEYS[1], start, start + 63)
  if #idxs == 0 then break end
  for _, idx in ipairs(idxs) do
    local held = redis.call('ZSCORE', KEYS[2], idx)
    if (not held) or tonumber(held) <= now then
      redis.call('ZADD', KEYS[2], expiry, idx)
      redis.call('HSET', KEYS[3], idx, ARGV[4])
      redis.call('HINCRBY', KEYS[5], idx, 1)
      got[#got + 1] = idx
      if #got >= want then break end
    end
  end
  start = start + 64
end
return got
"""

# KEYS out, err, todo, leases, owners, batch, unsettled, runs; ARGV index, value, "out"|"err", input tokens,
# output tokens (an answer's; an error's are not counted), owner ("" for a step's write-off, not a run), the
# result's field (the line's custom_id, as every version keys it: a line two versions ran has one result). A
# success replaces an error while the batch is in progress and not sealed (``Jobs.seal``), taking the error's
# count back. The lease is removed when it is the caller's or the caller wrote a success: a run whose lease
# was taken over and that wrote an error leaves the other run's, so the batch waits for it. An error is
# unsettled while another run of the line may still replace it (one holding its lease, or one whose claim
# is neither recorded nor given back: a stalled run whose lease was taken over), until the last such run
# records, or the batch is final. Returns
# 1: this call wrote the result, and the line's outcome is final;
# 2: this call wrote an error another run may still replace (unsettled);
# 3: this call wrote nothing, but settled the line's unsettled error: it is final now;
# 0: nothing (a result was written and settled before, another run may still replace the error, or the
#    batch is final or gone: its work dropped, nothing is written under its keys again).
_RECORD = """
local status = redis.call('HGET', KEYS[6], 'status')
local unfinished = {['"validating"'] = true, ['"in_progress"'] = true, ['"finalizing"'] = true, ['"cancelling"'] = true}
if not unfinished[status] then return 0 end
-- the runs of the line, other than this one, that may still record
local others = tonumber(redis.call('HGET', KEYS[8], ARGV[1])) or 0
if ARGV[6] ~= '' then
  others = redis.call('HINCRBY', KEYS[8], ARGV[1], -1)
  if others <= 0 then redis.call('HDEL', KEYS[8], ARGV[1]) end
end
local written = 0
local done_ok = redis.call('HEXISTS', KEYS[1], ARGV[7]) == 1
local done_err = redis.call('HEXISTS', KEYS[2], ARGV[7]) == 1
local replaceable = status == '"in_progress"'
replaceable = replaceable and redis.call('HEXISTS', KEYS[6], '_sealed') == 0
if ARGV[3] == 'out' and done_err and not done_ok and replaceable then
  redis.call('HDEL', KEYS[2], ARGV[7])
  redis.call('HINCRBY', KEYS[6], 'n_failed', -1)
  done_err = false
end
if not done_ok and not done_err then
  if ARGV[3] == 'out' then
    redis.call('HSET', KEYS[1], ARGV[7], ARGV[2])
    redis.call('HINCRBY', KEYS[6], 'n_completed', 1)
    redis.call('HINCRBY', KEYS[6], 'n_input_tokens', tonumber(ARGV[4]))
    redis.call('HINCRBY', KEYS[6], 'n_output_tokens', tonumber(ARGV[5]))
  else
    redis.call('HSET', KEYS[2], ARGV[7], ARGV[2])
    redis.call('HINCRBY', KEYS[6], 'n_failed', 1)
  end
  written = 1
end
redis.call('ZREM', KEYS[3], ARGV[1])
-- another run's lease stays while its success may still replace this error; once a success is written
-- nothing replaces it, and the batch need not wait for that run
local holder = redis.call('HGET', KEYS[5], ARGV[1])
if holder == ARGV[6] or (written == 1 and ARGV[3] == 'out') then
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[5], ARGV[1])
  holder = false
end
if written == 1 and ARGV[3] == 'out' then
  redis.call('SREM', KEYS[7], ARGV[1])  -- the error it replaced, if unsettled, is settled by this success
  return 1
end
local pending = replaceable and (others > 0 or holder)
if written == 1 then
  if pending then
    redis.call('SADD', KEYS[7], ARGV[1])
    return 2
  end
  return 1
end
if not pending and redis.call('SREM', KEYS[7], ARGV[1]) == 1 then return 3 end
return 0
"""

# KEYS leases, owners; ARGV owner, expiry_ms, index... Extends the leases still held by ``owner``.
_RENEW = """
local n = 0
for i = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[2], ARGV[i])
    n = n + 1
  end
end
return n
"""


# KEYS leases, owners, runs; ARGV owner, index... Gives back the leases still held by ``owner`` (expired at
# once), ending those runs of the lines (``runs``). A lease no longer the owner's was taken over, or went
# with a result this run recorded (which ended the run then): its run is left counted, so an error waits
# for the batch's end at worst, rather than a run that may still record being taken for ended.
_RELEASE = """
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', 0, ARGV[i])
    if redis.call('HINCRBY', KEYS[3], ARGV[i], -1) <= 0 then redis.call('HDEL', KEYS[3], ARGV[i]) end
  end
end
return 0
"""


# KEYS lines, todo; ARGV (index, line, place in the run order)... Each line not loaded yet, to run: one
# loaded before is done, running or to run already, and stays so.
_LOAD = """
for i = 1, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('ZADD', KEYS[2], ARGV[i + 2], ARGV[i])
  end
end
return 0
"""

#: How many results ``Work.results`` reads in one reply.
READ_CHUNK = 256

# KEYS a result hash; ARGV fields. Each field's line index, the number its value starts with (-1 for a field
# gone since): every line's place, without its answer.
_PLACES = """
local places = {}
for i, field in ipairs(ARGV) do
  local value = redis.call('HGET', KEYS[1], field)
  places[i] = value and tonumber(string.match(value, '^%d+')) or -1
end
return places
"""

#: Every key of a batch's work.
_PARTS = ("lines", "todo", "leases", "owners", "out", "err", "unsettled", "runs")


def result_field(idx: int, custom_id: str | None) -> str | bytes:
    """The field a line's result is written under: its ``custom_id``, or for a line without one the byte
    0xff and its index, which no ``custom_id`` (UTF-8 text) can be."""
    return custom_id if custom_id is not None else b"\xff%d" % idx


class ResultsGone(Exception):
    """A batch's results were dropped while they were read (``Work.results``)."""


@dataclass(frozen=True)
class Recorded:
    """What ``Work.record_outcome`` did: whether it wrote the line's result, and the line's outcome
    (``completed``, ``failed``) when the call made it final: a line's outcome is final once, so counting
    it there counts each line once, however many runs it had (``gateway_batch_lines_total``)."""

    written: bool
    final: str | None


class Work:
    """The lines of every batch, as claims, renewals and results."""

    def __init__(
        self, redis: aioredis.Redis, config: BatchesConfig, batch_key: Any, *, read_chunk: int = READ_CHUNK
    ) -> None:
        self.redis, self.config, self.read_chunk = redis, config, read_chunk
        self._batch_key = batch_key  # batch id -> the batch hash's key (``Jobs.key``)
        self._load = redis.register_script(_LOAD)
        self._claim = redis.register_script(_CLAIM)
        self._record = redis.register_script(_RECORD)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._places = redis.register_script(_PLACES)

    def key(self, batch_id: str, part: str) -> str:
        return f"{self.config.redis_prefix}:b:{batch_id}:{part}"

    async def load_lines(self, batch_id: str, lines: list[bytes], order: list[int]) -> None:
        """Store the validated ``lines`` (by index) to run in ``order`` (a list of indexes). A line already
        loaded is left as it is, done or not: a validation run twice (its lock lapsed) puts back no line
        that ran, so none runs (and is charged) again."""
        keys = [self.key(batch_id, "lines"), self.key(batch_id, "todo")]
        for start in range(0, len(order), 500):
            args: list[bytes | str | int] = []
            for k, i in enumerate(order[start : start + 500]):
                args += [i, lines[i], start + k]
            await self._load(keys=keys, args=args)

    async def claim(self, batch_id: str, owner: str, n: int) -> list[tuple[int, bytes]]:
        """Up to ``n`` lines nobody holds, now held by ``owner`` for ``lease_s``: (index, line). None of a
        batch that is not in progress (cancelled, expired, finalizing since its caller last read it)."""
        now_ms = int(time.time() * 1000)
        keys = [*(self.key(batch_id, p) for p in ("todo", "leases", "owners")), self._batch_key(batch_id)]
        keys.append(self.key(batch_id, "runs"))
        idxs = await self._claim(keys=keys, args=[now_ms, int(self.config.lease_s * 1000), n, owner])
        return await self._lines(batch_id, [text(i) for i in idxs or ()])

    async def _lines(self, batch_id: str, idxs: list[str]) -> list[tuple[int, bytes]]:
        if not idxs:
            return []
        raws: list[Any] = await self.redis.hmget(self.key(batch_id, "lines"), idxs)
        return [(int(i), bytes(raw)) for i, raw in zip(idxs, raws, strict=True) if raw is not None]

    async def release(self, batch_id: str, owner: str, idxs: list[int]) -> None:
        """Give leases back at once (a line claimed but not sent): anyone may claim them again."""
        if idxs:
            keys = [self.key(batch_id, p) for p in ("leases", "owners", "runs")]
            await self._release(keys=keys, args=[owner, *idxs])

    async def renew(self, batch_id: str, owner: str, idxs: list[int]) -> int:
        if not idxs:
            return 0
        expiry = int((time.time() + self.config.lease_s) * 1000)
        keys = [self.key(batch_id, "leases"), self.key(batch_id, "owners")]
        return int(await self._renew(keys=keys, args=[owner, expiry, *idxs]))

    async def record(
        self,
        batch_id: str,
        idx: int,
        line: dict[str, Any],
        *,
        ok: bool,
        tokens: tuple[int, int],
        owner: str,
    ) -> bool:
        """Write line ``idx``'s result, run by ``owner``, unless one was written already (a success
        replaces an error another run wrote); whether this call wrote it. The line's lease goes with it
        when it is still ``owner``'s. The result is written under ``result_field`` of the ``custom_id`` in
        ``line``, where earlier versions write it too: a line that a replica of each ran during an upgrade
        has one result, whichever came first."""
        recorded = await self.record_outcome(batch_id, idx, line, ok=ok, tokens=tokens, owner=owner)
        return recorded.written

    async def record_outcome(
        self,
        batch_id: str,
        idx: int,
        line: dict[str, Any],
        *,
        ok: bool,
        tokens: tuple[int, int],
        owner: str,
    ) -> Recorded:
        """``record``, saying also whether this call made the line's outcome final: a result nothing can
        replace any more written, or an error another run could have replaced that now none will (that
        run's result came second, or could not replace it). An error written while another run of the
        line may still record is not final until the last such run records, or the batch is final
        (``unsettled``)."""
        keys = [self.key(batch_id, p) for p in ("out", "err", "todo", "leases", "owners")]
        keys += [self._batch_key(batch_id), self.key(batch_id, "unsettled"), self.key(batch_id, "runs")]
        kind = "out" if ok else "err"
        value = b"%d " % idx + orjson.dumps(line)  # the prefix orders the files (``results``)
        field = result_field(idx, line.get("custom_id"))
        args: list[bytes | str | int] = [idx, value, kind, tokens[0], tokens[1], owner, field]
        done = int(await self._record(keys=keys, args=args))
        outcome = "completed" if ok else "failed"
        return Recorded(written=done in (1, 2), final={1: outcome, 3: "failed"}.get(done))

    async def unsettled(self, batch_id: str) -> int:
        """How many errors another run could still have replaced: read once the batch is final, when
        none will be, their count is the finalization's to add (``Lifecycle.finalize``)."""
        return int(await self.redis.scard(self.key(batch_id, "unsettled")))

    async def remaining(self, batch_id: str) -> list[tuple[int, bytes]]:
        """The lines not done yet (expiry and cancellation write them off)."""
        idxs = await self.redis.zrange(self.key(batch_id, "todo"), 0, -1)
        return await self._lines(batch_id, [text(i) for i in idxs])

    async def pending(self, batch_id: str) -> int:
        return int(await self.redis.zcard(self.key(batch_id, "todo")))

    async def running(self, batch_id: str) -> int:
        """How many lines are leased and not given back or lapsed: with none pending, the runs of lines
        another run already has a result for (a lease taken over), whose success may still replace it."""
        now_ms = int(time.time() * 1000)
        return int(await self.redis.zcount(self.key(batch_id, "leases"), f"({now_ms}", "+inf"))

    async def count(self, batch_id: str, part: str) -> int:
        """How many output (``out``) or error (``err``) lines the batch has."""
        return int(await self.redis.hlen(self.key(batch_id, part)))

    async def results(self, batch_id: str, part: str, count: int = 0) -> AsyncIterator[bytes]:
        """The output (``out``) or error (``err``) lines, in input order, read ``read_chunk`` at a time:
        a batch of many long answers is written to its file without ever being in memory whole (only
        each line's field and index are). Read while the batch is finalized, when no result changes any
        more: fewer than the ``count`` the caller counted, or one gone midway, is ``ResultsGone`` (another
        replica, taking the step over, finalized the batch and dropped its work: what was read is not the
        whole of it)."""
        key = self.key(batch_id, part)
        fields = [field for _, field in await self._in_order(key)]
        if len(fields) < count:
            raise ResultsGone(batch_id)
        for start in range(0, len(fields), self.read_chunk):
            raws: list[Any] = await self.redis.hmget(key, fields[start : start + self.read_chunk])
            for raw in raws:
                if raw is None:
                    raise ResultsGone(batch_id)
                yield bytes(raw).split(b" ", 1)[1]

    async def _in_order(self, key: str) -> list[tuple[int, bytes]]:
        """The result hash's (index, field)s, by index: learnt from the values' prefixes, a chunk at a
        time, in Redis (a field does not say its line: it is a ``custom_id``)."""
        fields: list[Any] = await self.redis.hkeys(key)
        places: list[tuple[int, bytes]] = []
        for start in range(0, len(fields), self.read_chunk):
            chunk = fields[start : start + self.read_chunk]
            idxs = await self._places(keys=[key], args=chunk)
            places += [(int(i), bytes(field)) for i, field in zip(idxs, chunk, strict=True) if int(i) >= 0]
        return sorted(places)

    async def expire(self, batch_id: str, seconds: int) -> None:
        """Let the batch's work expire in ``seconds`` unless ``drop`` deletes it first: set before the batch
        is moved to a final status, after which nothing else would ever delete it (a ``drop`` that failed,
        a replica that died between the two)."""
        pipe = self.redis.pipeline(transaction=False)
        for part in _PARTS:
            pipe.expire(self.key(batch_id, part), seconds)
        await pipe.execute()

    async def drop(self, batch_id: str) -> None:
        """Forget the work once the batch is final: its results live on in its files only. (A run that ends
        later records nothing: ``record`` writes only while the batch is not final.)"""
        await self.redis.delete(*(self.key(batch_id, p) for p in _PARTS))
