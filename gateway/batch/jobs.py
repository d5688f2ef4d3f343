"""Batch objects in Redis, with OpenAI's status lifecycle, shared by every replica.

- ``<prefix>:batch:<id>``: a hash; each field of the OpenAI batch object JSON-encoded, plus the
  owner (``_scope``, ``_caller``), who cancelled it (``_cancelled_by``, ``owner`` or ``operator``: what
  the lines it cuts are charged depends on it), whether its results are final (``_sealed``, ``seal``)
  and the counters the runner increments atomically
  (``n_total``, ``n_completed``, ``n_failed``, ``n_input_tokens``, ``n_output_tokens``). A final batch
  expires with its output files (``output_ttl_s``).
- ``<prefix>:batches:<scope>``: the scope's batch ids by creation time (listing, newest first); pruned
  of expired batches as it is read.
- ``<prefix>:active``: the ids of batches not yet in a final state: what the runners look at.
- ``<prefix>:active:<scope>``: the same for one scope (``batches.max_active_batches`` bounds it: a
  batch is added only while it holds fewer, in the script that creates it).
- ``<prefix>:inputs:<scope>``: batch id -> its input file's size, for the scope's unfinished batches
  (``batches.max_tenant_batch_bytes`` bounds their sum: each copies its input's lines into Redis while it
  runs, ``gateway.batch.work``); entries of batches no longer active are dropped as a create reads it.
- ``<prefix>:all``: every batch id by creation time, for operators (the admin API); pruned of expired
  batches as it is read.

Status changes are compare-and-set (a Lua script): a change applies only from the statuses it names, so
two replicas (or a cancel racing a completion) never both move a batch on. A change to a final status
also leaves the active sets and sets the record's expiry in that same script.

    validating -> in_progress -> finalizing -> completed
    validating -> failed                  (an input that is not a batch: no lines run)
    validating | in_progress -> cancelling -> cancelled
    validating | in_progress | finalizing -> expired   (completion_window passed)
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.batch.index_pages import page
from gateway.batch.redis_errors import guarded, text
from gateway.pipeline.batch_config import BatchesConfig, Caller

FINAL = frozenset({"completed", "failed", "expired", "cancelled"})
COUNTERS = ("n_total", "n_completed", "n_failed", "n_input_tokens", "n_output_tokens")

# KEYS[1] the batch hash, KEYS[2] the runners' active set; ARGV[1] the allowed current statuses,
# JSON-encoded, joined by "|"; ARGV[2] the batch id; ARGV[3] the seconds a final batch is kept, or "" when
# the new status is not final; ARGV[4] the prefix of the scopes' active sets; ARGV[5..] field, value pairs
# to set (the new status among them, unless the status stays). 1 when applied, else 0. A final status also
# takes the batch off both active sets and sets its expiry in the same step, so no failure in between can
# leave a final batch that never expires or that holds its tenant's place among the running batches.
_MOVE = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
for allowed in string.gmatch(ARGV[1], '[^|]+') do
  if allowed == current then
    for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
    if ARGV[3] ~= '' then
      redis.call('SREM', KEYS[2], ARGV[2])
      local scope = redis.call('HGET', KEYS[1], '_scope')
      if scope then redis.call('SREM', ARGV[4] .. scope, ARGV[2]) end
      redis.call('EXPIRE', KEYS[1], ARGV[3])
    end
    return 1
  end
end
return 0
"""

# KEYS[1] the batch hash, KEYS[2] the scope's index, KEYS[3] the runners' active set, KEYS[4] the scope's
# active set, KEYS[5] every batch, KEYS[6] the scope's input bytes (batch id -> its input file's size);
# ARGV[1] the most batches the scope's active set may hold and ARGV[5] the most input bytes ('' for no
# bound), ARGV[2] the batch id, ARGV[3] its score (creation, µs), ARGV[4] its input file's size, ARGV[6]
# the prefix of the batch hashes, ARGV[7..] field, value pairs. {1} when created, {0} when the scope already
# has its most batches, {-1, held} when its unfinished batches' inputs leave no room for this one. Counting
# and adding are one step, so creates at once, on any replicas, never pass the bounds together. At the
# bound, batches of the active set that are gone or final without having left it (a Redis flush, an
# expiry) are dropped first, so they never hold a place for good. A batch no longer in the scope's active
# set holds no input bytes: its entry is dropped here, whichever version finalized it. Last, a sample of
# ids of the scope's index and of every batch's is read, and those whose batch expired are dropped: a
# listing drops only the expired ids it meets, so without this the indexes kept every batch ever made
# past the pages anyone reads. Each create adds one id and drops each sampled stale one, so at most about
# one id in SAMPLED of an index is stale while the scope creates batches.
_CREATE = (
    # the final statuses as the record stores them (JSON strings: '"completed"')
    "local final = {"
    + ", ".join(f"['{orjson.dumps(status).decode()}'] = true" for status in sorted(FINAL))
    + "}"
    + """
local SAMPLED = 8
if ARGV[1] ~= '' and redis.call('SCARD', KEYS[4]) >= tonumber(ARGV[1]) then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[4])) do
    local status = redis.call('HGET', ARGV[6] .. id, 'status')
    if not status or final[status] then redis.call('SREM', KEYS[4], id) end
  end
  if redis.call('SCARD', KEYS[4]) >= tonumber(ARGV[1]) then return {0} end
end
local held = 0
for _, id in ipairs(redis.call('HKEYS', KEYS[6])) do
  if redis.call('SISMEMBER', KEYS[4], id) == 1 then
    held = held + tonumber(redis.call('HGET', KEYS[6], id))
  else
    redis.call('HDEL', KEYS[6], id)
  end
end
if ARGV[5] ~= '' and held + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return {-1, held} end
for i = 7, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[2])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[6], ARGV[2], ARGV[4])
for _, index in ipairs({KEYS[2], KEYS[5]}) do
  for _, id in ipairs(redis.call('ZRANDMEMBER', index, SAMPLED)) do
    if redis.call('EXISTS', ARGV[6] .. id) == 0 then redis.call('ZREM', index, id) end
  end
end
return {1}
"""
)


class TooManyActive(Exception):
    """The scope already has the most unfinished batches it may (``Jobs.create``'s ``most``)."""


class InputsFull(Exception):
    """The scope's unfinished batches hold too many input bytes for another (``Jobs.create``'s
    ``most_bytes``): ``held`` is what they hold."""

    def __init__(self, held: int) -> None:
        super().__init__(held)
        self.held = held


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class Jobs:
    """Create, load, list and move batches on."""

    def __init__(self, redis: aioredis.Redis, config: BatchesConfig) -> None:
        self.redis, self.config = redis, config
        self._move = redis.register_script(_MOVE)
        self._create = redis.register_script(_CREATE)

    def key(self, batch_id: str) -> str:
        return f"{self.config.redis_prefix}:batch:{batch_id}"

    def _index(self, scope: str) -> str:
        return f"{self.config.redis_prefix}:batches:{scope}"

    @property
    def active_key(self) -> str:
        return f"{self.config.redis_prefix}:active"

    def _active_of(self, scope: str) -> str:
        return self._active_prefix + scope

    def _inputs_of(self, scope: str) -> str:
        return f"{self.config.redis_prefix}:inputs:{scope}"

    @property
    def _active_prefix(self) -> str:
        return f"{self.config.redis_prefix}:active:"

    async def active_count(self, scope: str) -> int:
        """How many of the scope's batches hold a place among its running ones (``max_active_batches``)."""
        async with guarded("count the running batches"):
            return int(await self.redis.scard(self._active_of(scope)))

    async def create(
        self,
        scope: str,
        caller: Caller,
        input_file_id: str,
        endpoint: str,
        metadata: dict[str, str] | None,
        *,
        most: int | None = None,
        input_bytes: int = 0,
        most_bytes: int | None = None,
    ) -> dict[str, Any]:
        """A new batch, validating, counted as holding ``input_bytes`` (its input file's size: what its
        lines take in Redis at most) until it is final. With ``most``: only while the scope's active set
        holds fewer batches (``TooManyActive`` else); with ``most_bytes``: only while the scope's unfinished
        batches' inputs and this one's fit in it (``InputsFull`` else). Checked and added in one script."""
        batch_id = new_batch_id()
        now = int(time.time())
        obj: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + int(self.config.completion_window_s),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "metadata": metadata,
        }
        fields: dict[str, bytes | int] = {name: orjson.dumps(value) for name, value in obj.items()}
        fields["_scope"] = scope.encode()
        fields["_caller"] = orjson.dumps({"tenant": caller.tenant, "key_id": caller.key_id})
        fields.update(dict.fromkeys(COUNTERS, 0))
        keys = [self.key(batch_id), self._index(scope), self.active_key, self._active_of(scope), self._all_key]
        keys.append(self._inputs_of(scope))
        args: list[Any] = ["" if most is None else most, batch_id, time.time_ns() // 1000]  # within a second too
        args += [input_bytes, "" if most_bytes is None else most_bytes, self.key("")]
        for name, value in fields.items():
            args += [name, value]
        async with guarded("create the batch"):
            reply = await self._create(keys=keys, args=args)
        if int(reply[0]) == 0:
            raise TooManyActive(scope)
        if int(reply[0]) < 0:
            raise InputsFull(int(reply[1]))
        return {**obj, "request_counts": {"total": 0, "completed": 0, "failed": 0}}

    async def load(self, batch_id: str) -> dict[str, Any] | None:
        """The stored record: the OpenAI object's fields, ``_scope``, ``_caller`` and the counters."""
        if not _batch_id(batch_id):
            return None
        async with guarded("read the batch"):
            raw = await self.redis.hgetall(self.key(batch_id))
        return _record(raw)

    async def _load_many(self, batch_ids: list[str]) -> list[dict[str, Any] | None]:
        """The records of ``batch_ids`` (None for an unknown one), read in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for batch_id in batch_ids:
                pipe.hgetall(self.key(batch_id))
            raws = await pipe.execute()
        return [_record(raw) if _batch_id(batch_id) else None for batch_id, raw in zip(batch_ids, raws, strict=True)]

    async def get(self, scope: str, batch_id: str) -> dict[str, Any] | None:
        """The OpenAI batch object, or None when unknown or another scope's (the same 404)."""
        record = await self.load(batch_id)
        if record is None or record["_scope"] != scope:
            return None
        return public(record)

    async def listing(self, scope: str, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """A page of the scope's batches, newest first, after the batch ``after`` (none for an id the index
        does not hold); and whether more follow. Read a chunk at a time from where the page starts, never
        the whole index (it holds every batch of the scope's last ``output_ttl_s``: a whole read per page
        would cost the event loop in proportion to a tenant's history). Batches expired with their output
        files are dropped from the index as they are met."""
        index = self._index(scope)
        start = 0
        if after is not None:
            async with guarded("list the batches"):
                rank: Any = await self.redis.zrevrank(index, after)
            if rank is None:
                return [], False
            start = int(rank) + 1

        async def fetch(chunk: list[str]) -> list[dict[str, Any] | None]:
            records = await self._load_many(chunk)
            return [public(r) if r is not None and r["_scope"] == scope else None for r in records]

        return await page(self.redis, index, start, desc=True, limit=limit, fetch=fetch, doing="list the batches")

    @property
    def _all_key(self) -> str:
        return f"{self.config.redis_prefix}:all"

    async def recent(self, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` batches of every scope, as stored records (operators only)."""
        async with guarded("list the batches"):
            ids = [text(i) for i in await self.redis.zrange(self._all_key, 0, limit - 1, desc=True)]
            records = await self._load_many(ids)
            gone = [batch_id for batch_id, record in zip(ids, records, strict=True) if record is None]
            if gone:
                await self.redis.zrem(self._all_key, *gone)
        return [record for record in records if record is not None]

    async def move(self, batch_id: str, allowed: tuple[str, ...], status: str, **fields: Any) -> bool:
        """Set ``status`` (and ``fields``) if the batch is in one of ``allowed``; whether it was.

        A final status takes the batch off the active sets and makes it expire with its output files
        (``output_ttl_s``) in the same script, atomically with the change itself.

        The scope's active set is named inside the script from the record's ``_scope``, so that key is
        not declared in ``KEYS``. That is sound on the standalone Redis this gateway runs against
        (``GATEWAY_REDIS_URL``: the deploy's single Redis pod, or a managed primary), which does not
        check a script's keys. Redis Cluster is not supported: a batch's keys are not hash-tagged to one
        slot (``create`` already writes them in one MULTI across slots).
        """
        return await self._apply(batch_id, allowed, {"status": status, **fields}, final=status in FINAL)

    async def update(self, batch_id: str, allowed: tuple[str, ...], **fields: Any) -> bool:
        """Set ``fields`` if the batch is in one of ``allowed``, its status left as it is; whether it was."""
        return await self._apply(batch_id, allowed, fields, final=False)

    async def _apply(self, batch_id: str, allowed: tuple[str, ...], fields: dict[str, Any], *, final: bool) -> bool:
        argv: list[bytes] = [
            b"|".join(orjson.dumps(s) for s in allowed),
            batch_id.encode(),
            str(self.config.output_ttl_s).encode() if final else b"",
            self._active_prefix.encode(),
        ]
        for name, value in fields.items():
            argv += [name.encode(), orjson.dumps(value)]
        async with guarded("update the batch"):
            applied = await self._move(keys=[self.key(batch_id), self.active_key], args=argv)
        return bool(applied)

    async def seal(self, batch_id: str) -> None:
        """Keep every line's result as it is from now on (``_sealed``: no success replaces an error, see
        ``gateway.batch.work``). An expiry's finalization seals the batch before it writes off the lines
        left and reads the results into the files, all while the status is still ``in_progress``: a run
        ending meanwhile on another replica must not change a result the files or the counts already
        took, nor turn a line written off into an answer nobody receives."""
        await self.update(batch_id, ("in_progress",), _sealed=True)

    async def active(self) -> list[str]:
        async with guarded("list the running batches"):
            return sorted(text(i) for i in await self.redis.smembers(self.active_key))


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI batch object of a stored record."""
    obj = {k: v for k, v in record.items() if not k.startswith("_") and k not in COUNTERS}
    obj["request_counts"] = {
        "total": record.get("n_total", 0),
        "completed": record.get("n_completed", 0),
        "failed": record.get("n_failed", 0),
    }
    if record.get("n_input_tokens") or record.get("n_output_tokens"):
        inp, out = record["n_input_tokens"], record["n_output_tokens"]
        obj["usage"] = {
            "input_tokens": inp,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": inp + out,
        }
    return obj


def _batch_id(batch_id: str) -> bool:
    """Whether ``batch_id`` can name a batch (any other is unknown without a Redis read)."""
    return batch_id.startswith("batch_") and len(batch_id) <= 64


def _record(raw: dict[Any, Any]) -> dict[str, Any] | None:
    """A batch's stored record from its hash (None for an empty one: unknown, or expired)."""
    if not raw:
        return None
    record: dict[str, Any] = {}
    for name_b, value in raw.items():
        name = text(name_b)
        if name in COUNTERS:
            record[name] = int(value)
        elif name == "_scope":
            record[name] = text(value)
        else:
            record[name] = orjson.loads(value)
    return record
