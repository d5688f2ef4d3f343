"""A rolling upgrade in the real Redis: replicas of the previous version and of this one work off the same
batch, so each reads what the other wrote. The previous version's code is copied here as it was: its
record script (results keyed by ``custom_id``, an unnamed line by ``#line-<n>``, each value prefixed by
its line's index) and its finalization's read (every value at once, split on the first space, sorted by
the number)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.batch.blobs import DirectoryStore
from gateway.batch.files import Files
from gateway.batch.jobs import Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.lines import error_line
from gateway.batch.metrics import BatchMetrics
from gateway.batch.work import Work
from gateway.ops.metrics import Metrics
from gateway.pipeline.batch_config import BatchesConfig
from tests.support.batches import batch_in_progress, chat_line

# The previous version's record script, verbatim. KEYS out, err, todo, leases, owners, batch; ARGV
# custom_id, index, value, "out"|"err", input tokens, output tokens, owner.
OLD_RECORD = """
local status = redis.call('HGET', KEYS[6], 'status')
local unfinished = {['"validating"'] = true, ['"in_progress"'] = true, ['"finalizing"'] = true, ['"cancelling"'] = true}
if not unfinished[status] then return 0 end
local written = 0
local done_ok = redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1
local done_err = redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
local replaceable = status == '"in_progress"'
replaceable = replaceable and redis.call('HEXISTS', KEYS[6], '_sealed') == 0
if ARGV[4] == 'out' and done_err and not done_ok and replaceable then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[6], 'n_failed', -1)
  done_err = false
end
if not done_ok and not done_err then
  if ARGV[4] == 'out' then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
    redis.call('HINCRBY', KEYS[6], 'n_completed', 1)
    redis.call('HINCRBY', KEYS[6], 'n_input_tokens', tonumber(ARGV[5]))
    redis.call('HINCRBY', KEYS[6], 'n_output_tokens', tonumber(ARGV[6]))
  else
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
    redis.call('HINCRBY', KEYS[6], 'n_failed', 1)
  end
  written = 1
end
redis.call('ZREM', KEYS[3], ARGV[2])
-- another run's lease stays while its success may still replace this error; once a success is written
-- nothing replaces it, and the batch need not wait for that run
if redis.call('HGET', KEYS[5], ARGV[2]) == ARGV[7] or (written == 1 and ARGV[4] == 'out') then
  redis.call('ZREM', KEYS[4], ARGV[2])
  redis.call('HDEL', KEYS[5], ARGV[2])
end
return written
"""


class OldReplica:
    """The previous version's ``Work.record`` and ``Work.results``, verbatim but for ``self``."""

    def __init__(self, work: Work, jobs: Jobs) -> None:
        self.work, self.jobs = work, jobs

    async def record(self, batch_id: str, idx: int, custom_id: str, line: dict[str, Any], ok: bool) -> bool:
        """(``custom_id`` was ``#line-<n>`` for a line without one.)"""
        keys = [self.work.key(batch_id, p) for p in ("out", "err", "todo", "leases", "owners")]
        keys.append(self.jobs.key(batch_id))
        value = b"%d " % idx + orjson.dumps(line)
        args = [custom_id, idx, value, "out" if ok else "err", 1, 1, "old"]
        return bool(await self.work.redis.eval(OLD_RECORD, len(keys), *keys, *args))

    async def results(self, batch_id: str, part: str) -> list[bytes]:
        raw: list[Any] = await self.work.redis.hvals(self.work.key(batch_id, part))
        entries = [bytes(value).split(b" ", 1) for value in raw]
        entries.sort(key=lambda e: int(e[0]))
        return [e[1] for e in entries]


def work_results(work: Work) -> Callable[[str, str], Awaitable[list[bytes]]]:
    """This version's read, as a list."""

    async def read(batch_id: str, part: str) -> list[bytes]:
        return [line async for line in work.results(batch_id, part)]

    return read


async def in_progress(jobs: Jobs, work: Work, n: int) -> str:
    """A batch of ``n`` lines in progress: its id."""
    return await batch_in_progress(jobs, work, [orjson.dumps(chat_line(f"c-{i}", f"q{i}")) for i in range(n)])


# A batch validated by the previous version, run by both: (custom_id, who records, ok) per run, by line.
# The custom_ids are other lines' indexes, or read as one ("007"); line 2 had none (an error at validation).
RUNS: list[tuple[str | None, list[tuple[str, bool]]]] = [
    ("3", [("old", True)]),
    ("0", [("new", True)]),
    (None, [("old", False)]),
    ("007", [("new", False)]),
    ("2", [("old", False), ("new", True)]),  # a success replaces an error, both ways
    ("5", [("new", False), ("old", True)]),
    ("1", [("old", True), ("new", True)]),  # a line both ran: one result, the first
    ("6", [("new", True), ("old", True)]),
    ("9", [("old", True)]),
    ("8", [("new", True)]),
]


def test_a_batch_both_versions_ran_is_finalized_whole_in_input_order(batch_names: dict[str, Any]) -> None:
    """Each line's result once, counted once, whichever version wrote it; read back in input order by
    either version's read, and into the files a chunk (of 3) at a time."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], files_dir=batch_names["dir"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            files = Files(client, DirectoryStore(config.files_dir), config)
            work = Work(client, config, jobs.key, read_chunk=3)
            batch_id = await in_progress(jobs, work, len(RUNS))
            old = OldReplica(work, jobs)
            for turn in range(2):
                for idx, (custom_id, runs) in enumerate(RUNS):
                    who, ok = runs[turn] if turn < len(runs) else ("none", False)
                    line = {"custom_id": custom_id, "by": who}
                    if who == "new":
                        await work.record(batch_id, idx, line, ok=ok, tokens=(1, 1), owner="new")
                    elif who == "old":
                        await old.record(batch_id, idx, custom_id or f"#line-{idx + 1}", line, ok)
            by = ["old", "new", "new", "old", "old", "new", "old", "new"]
            out = [{"custom_id": c, "by": who} for c, who in zip("30251698", by, strict=True)]
            err = [{"custom_id": None, "by": "old"}, {"custom_id": "007", "by": "new"}]
            for read in (old.results, work_results(work)):  # either version's finalization
                assert [orjson.loads(line) for line in await read(batch_id, "out")] == out
                assert [orjson.loads(line) for line in await read(batch_id, "err")] == err
            record = await jobs.load(batch_id)
            assert record is not None and (record["n_completed"], record["n_failed"]) == (8, 2)
            lifecycle = Lifecycle(jobs, files, work, config, "new", BatchMetrics(Metrics()))
            assert await lifecycle.finalize(batch_id, record, "completed")
            final = await jobs.load(batch_id)
            assert final is not None
            for name, lines in (("output", out), ("error", err)):
                content = b"".join([piece async for piece in files.content(final[f"{name}_file_id"])])
                assert [orjson.loads(line) for line in content.splitlines()] == lines
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_the_previous_version_reads_what_this_one_wrote(batch_names: dict[str, Any]) -> None:
    """A batch this version ran, finalized by a replica not upgraded yet: its read finds every line, in
    input order, as this version's does; a line without a custom_id too."""

    async def scenario() -> None:
        config = BatchesConfig(redis_prefix=batch_names["prefix"], lease_s=30)
        client = aioredis.Redis()
        try:
            jobs = Jobs(client, config)
            work = Work(client, config, jobs.key, read_chunk=2)
            batch_id = await in_progress(jobs, work, 7)
            lines = [{"custom_id": c, "n": i} for i, c in enumerate(["b", "2", "a", "0", "10", "c", "1"])]
            lines[3] = error_line(None, "missing_custom_id", "Line 4: no custom_id")
            for idx in (5, 0, 6, 3, 1, 4, 2):  # not in input order
                assert await work.record(batch_id, idx, lines[idx], ok=idx != 3, tokens=(1, 1), owner="new")
            expected = [orjson.dumps(line) for i, line in enumerate(lines) if i != 3]
            old = OldReplica(work, jobs)
            assert await old.results(batch_id, "out") == expected
            assert await work_results(work)(batch_id, "out") == expected
            assert await old.results(batch_id, "err") == [orjson.dumps(lines[3])]
            assert await work_results(work)(batch_id, "err") == [orjson.dumps(lines[3])]
        finally:
            await client.aclose()

    asyncio.run(scenario())
