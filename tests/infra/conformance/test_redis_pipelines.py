"""The same cases against both implementations of ``gateway.infra.redis_api.RedisPipeline``: the
hand-written ``AutoPipeline`` (hiredis, one connection, commands of a loop turn in one write) and
``RedisPyPipeline`` (redis-py's pipeline on a dedicated connection, the library it replaces), against the
real Redis. Every case must give the same replies and the same exceptions for both: mixed batches, error
replies inside a batch, Lua scripts (EVAL, EVALSHA, NOSCRIPT), large values, concurrency, and Redis
failing (refused, a connect that never completes, silence, the connection killed mid-batch, gone)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.infra.redis_api import RedisPipeline
from gateway.infra.redis_autopipe import AutoPipeline
from gateway.infra.redis_py import RedisPyPipeline
from gateway.infra.redis_script import ScriptCall
from tests.support.fakes import free_port
from tests.support.faults import BlackHole, SwitchableProxy, unaccepting_port

REDIS_PORT = 6379
IMPLEMENTATIONS: dict[str, Callable[[aioredis.Redis], RedisPipeline]] = {
    "autopipe": AutoPipeline,
    "redis-py": RedisPyPipeline,
}


def redis_client(port: int = REDIS_PORT, timeout_s: float = 2.0) -> aioredis.Redis:
    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def control() -> AsyncIterator[aioredis.Redis]:
    """A plain redis-py client for setting up and checking, outside the pipeline under test."""
    client = redis_client()
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(control: aioredis.Redis) -> AsyncIterator[str]:
    """Keys of this test's own, deleted afterwards."""
    name = f"gwtest:conformance:{uuid.uuid4().hex}"
    yield name
    keys = [k async for k in control.scan_iter(match=name + ":*")]
    if keys:
        await control.delete(*keys)


@contextlib.asynccontextmanager
async def pipeline(kind: str, port: int = REDIS_PORT, timeout_s: float = 2.0) -> AsyncIterator[RedisPipeline]:
    client = redis_client(port, timeout_s)
    pipe = IMPLEMENTATIONS[kind](client)
    try:
        yield pipe
    finally:
        await pipe.aclose()
        await client.aclose()


async def outcomes(*calls: Any) -> list[Any]:
    """Replies, or ``(exception type, message)`` for the ones that failed."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    return [(type(r), str(r)) if isinstance(r, BaseException) else r for r in results]


async def test_a_mixed_batch_gets_redis_own_replies_in_one_round_trip(kind: str, prefix: str) -> None:
    k = prefix
    async with pipeline(kind) as pipe:
        assert await pipe.execute("PING") == b"PONG"
        before = pipe.batches_sent  # type: ignore[attr-defined]
        replies = await outcomes(
            pipe.execute("SET", f"{k}:s", "v"),
            pipe.execute("GET", f"{k}:s"),
            pipe.execute("GET", f"{k}:absent"),
            pipe.execute("INCR", f"{k}:n"),
            pipe.execute("INCRBY", f"{k}:n", 41),
            pipe.execute("HSET", f"{k}:h", "a", "1", "b", "2"),
            pipe.execute("HGETALL", f"{k}:h"),
            pipe.execute("EXPIRE", f"{k}:s", 100),
            pipe.execute("TTL", f"{k}:s"),
            pipe.execute("MGET", f"{k}:s", f"{k}:absent", f"{k}:n"),
            pipe.execute("RPUSH", f"{k}:l", "x", "y"),
            pipe.execute("LRANGE", f"{k}:l", 0, -1),
            pipe.execute("EXISTS", f"{k}:s", f"{k}:absent"),
            pipe.execute("DEL", f"{k}:s"),
            pipe.execute("SET", f"{k}:nx", "1", "NX"),
            pipe.execute("SET", f"{k}:nx", "2", "NX"),
        )
        assert pipe.batches_sent == before + 1  # type: ignore[attr-defined]
    assert replies == [
        b"OK",
        b"v",
        None,
        1,
        42,
        2,
        [b"a", b"1", b"b", b"2"],
        1,
        100,
        [b"v", None, b"42"],
        2,
        [b"x", b"y"],
        1,
        1,
        b"OK",
        None,
    ]


async def test_an_error_reply_fails_its_command_only(kind: str, prefix: str) -> None:
    async with pipeline(kind) as pipe:
        replies = await outcomes(
            pipe.execute("SET", f"{prefix}:s", "text"),
            pipe.execute("LPUSH", f"{prefix}:s", "x"),
            pipe.execute("GET", f"{prefix}:s"),
            pipe.execute("INCR", f"{prefix}:s"),
            pipe.execute("NOSUCHCOMMAND"),
            pipe.execute("SET", f"{prefix}:after", "1"),
        )
    assert replies[0] == b"OK" and replies[2] == b"text" and replies[5] == b"OK"
    assert replies[1][0] is ResponseError and replies[1][1].startswith("WRONGTYPE")
    assert replies[3] == (ResponseError, "value is not an integer or out of range")
    assert replies[4][0] is ResponseError and "unknown command" in replies[4][1]


async def test_lua_eval_evalsha_and_noscript(kind: str, prefix: str, control: aioredis.Redis) -> None:
    body = f"-- {uuid.uuid4().hex}\nredis.call('SET', KEYS[1], ARGV[1]); return {{KEYS[1], ARGV[1], 3, false}}"
    script = control.register_script(body)  # unique text: Redis has never seen it
    key = f"{prefix}:lua"
    async with pipeline(kind) as pipe:
        first = await outcomes(
            pipe.execute("EVAL", "return {KEYS[1], ARGV[1], 7}", 1, key, "a"),
            pipe.execute("EVALSHA", script.sha, 1, key, "b"),
            pipe.execute("EVAL", "return redis.error_reply('boom')", 0),
            pipe.execute("EVAL", "return redis.call('INCR', KEYS[1])", 1, key + ":n"),
        )
        assert first[0] == [key.encode(), b"a", 7] and first[3] == 1
        assert first[1][0] is NoScriptError
        assert first[2] == (ResponseError, "boom")
        # the script runner loads an unknown script and runs it; afterwards it goes by SHA
        assert await pipe.evalsha(script, [key], ["c"]) == [key.encode(), b"c", 3, None]
        assert await control.script_exists(script.sha) == [True]
        assert await pipe.evalsha(script, [key], ["d"]) == [key.encode(), b"d", 3, None]
    assert await control.get(key) == b"d"


async def test_a_prepacked_script_call_runs_like_evalsha_and_loads_an_unknown_script(
    kind: str, prefix: str, control: aioredis.Redis
) -> None:
    body = f"-- {uuid.uuid4().hex}\nredis.call('RPUSH', KEYS[2], unpack(ARGV)); return {{KEYS[1], ARGV[1], #ARGV}}"
    script = control.register_script(body)  # unique text: Redis has never seen it
    first, second = f"{prefix}:a", f"{prefix}:b"
    call = ScriptCall(script, [first, second], [10, b"fixed", "x"])
    async with pipeline(kind) as pipe:
        # unknown to Redis: loaded and run once; then by SHA, in one batch with other commands
        assert await pipe.run_script(call, (1, 2)) == [first.encode(), b"1", 5]
        replies = await outcomes(pipe.run_script(call, ("v",)), pipe.execute("LLEN", second), pipe.run_script(call, ()))
        assert replies == [[first.encode(), b"v", 4], 9, [first.encode(), b"10", 3]]
    fixed = [b"10", b"fixed", b"x"]
    assert await control.lrange(second, 0, -1) == [b"1", b"2", *fixed, b"v", *fixed, *fixed]


async def test_a_submitted_script_call_hands_its_reply_or_noscript_to_a_future(
    kind: str, prefix: str, control: aioredis.Redis
) -> None:
    body = f"-- {uuid.uuid4().hex}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1] + ARGV[2])"
    script = control.register_script(body)  # unique text: Redis has never seen it
    call = ScriptCall(script, [f"{prefix}:n"], [100])
    async with pipeline(kind) as pipe:
        unknown = pipe.submit_script(call, (1,))
        with pytest.raises(NoScriptError):
            await unknown  # nothing is loaded for a caller that does not wait: it runs run_script
        assert await pipe.run_script(call, (2,)) == 102
        futures = [pipe.submit_script(call, (i,)) for i in (3, 4)]
        assert [await f for f in futures] == [205, 309]
    assert await control.get(f"{prefix}:n") == b"309"


async def test_large_values_go_whole_among_small_commands(kind: str, prefix: str) -> None:
    big = bytes(range(256)) * (64 * 1024) + b"tail"  # 16 MiB + 4
    async with pipeline(kind, timeout_s=10) as pipe:
        replies = await outcomes(
            pipe.execute("SET", f"{prefix}:small", "1"),
            pipe.execute("SET", f"{prefix}:big", big),
            pipe.execute("GET", f"{prefix}:small"),
            pipe.execute("STRLEN", f"{prefix}:big"),
        )
        assert replies == [b"OK", b"OK", b"1", len(big)]
        got = await outcomes(pipe.execute("GET", f"{prefix}:big"), pipe.execute("INCR", f"{prefix}:small"))
    assert got[0] == big and got[1] == 2


async def test_concurrent_callers_each_get_their_own_reply(kind: str, prefix: str) -> None:
    async with pipeline(kind) as pipe:
        for i in range(50):
            await pipe.execute("SET", f"{prefix}:{i}", i)

        async def caller(i: int) -> tuple[int, Any]:
            await asyncio.sleep(0.001 * (i % 7))
            return await pipe.execute("INCR", f"{prefix}:counter"), await pipe.execute("GET", f"{prefix}:{i % 50}")

        results = await asyncio.gather(*(caller(i) for i in range(1000)))
    assert sorted(n for n, _ in results) == list(range(1, 1001))
    assert [v for _, v in results] == [str(i % 50).encode() for i in range(1000)]


async def test_submit_hands_the_reply_to_a_future(kind: str, prefix: str) -> None:
    async with pipeline(kind) as pipe:
        futures = [pipe.submit("INCR", f"{prefix}:f") for _ in range(3)]
        assert [await f for f in futures] == [1, 2, 3]


async def test_a_caller_that_gives_up_leaves_the_others_their_replies(kind: str, prefix: str) -> None:
    async with pipeline(kind) as pipe:
        await pipe.execute("PING")
        blocked = asyncio.ensure_future(pipe.execute("BLPOP", f"{prefix}:empty", 0.3))
        after = asyncio.ensure_future(pipe.execute("INCR", f"{prefix}:n"))
        await asyncio.sleep(0.05)
        blocked.cancel()
        assert await after == 1  # answered once the BLPOP timed out in Redis
        assert await pipe.execute("INCR", f"{prefix}:n") == 2  # the connection is still in step
    assert blocked.cancelled()


async def test_a_closed_pipeline_refuses_commands(kind: str) -> None:
    async with pipeline(kind) as pipe:
        assert await pipe.execute("PING") == b"PONG"
    with pytest.raises(RedisConnectionError):
        await pipe.execute("PING")


# -- Redis failing -----------------------------------------------------------------------------------


async def test_a_refused_connection_fails_every_waiting_command_with_connection_error(kind: str) -> None:
    async with pipeline(kind, port=free_port()) as pipe:
        replies = await outcomes(pipe.execute("PING"), pipe.execute("GET", "x"))
        assert [r[0] for r in replies] == [RedisConnectionError, RedisConnectionError]
        with pytest.raises(RedisConnectionError):  # and again: no cached failure, no hang
            await pipe.execute("PING")


async def test_a_connect_that_never_completes_is_a_timeout(kind: str) -> None:
    with unaccepting_port() as port:
        async with pipeline(kind, port=port, timeout_s=0.3) as pipe:
            with pytest.raises(RedisTimeoutError):
                await pipe.execute("PING")


async def test_a_server_that_never_answers_is_a_timeout(kind: str) -> None:
    with BlackHole() as hole:
        async with pipeline(kind, port=hole.port, timeout_s=0.3) as pipe:
            replies = await outcomes(pipe.execute("PING"), pipe.execute("GET", "x"))
    assert [r[0] for r in replies] == [RedisTimeoutError, RedisTimeoutError]


async def test_a_slow_reply_past_the_socket_timeout_fails_and_the_next_command_reconnects(
    kind: str, prefix: str
) -> None:
    async with pipeline(kind, timeout_s=0.3) as pipe:
        replies = await outcomes(pipe.execute("BLPOP", f"{prefix}:empty", 3), pipe.execute("INCR", f"{prefix}:n"))
        assert [r[0] for r in replies] == [RedisTimeoutError, RedisTimeoutError]
        assert await pipe.execute("SET", f"{prefix}:s", "1") == b"OK"


async def test_a_network_that_goes_silent_mid_use_is_a_timeout(kind: str, prefix: str) -> None:
    with SwitchableProxy(REDIS_PORT) as proxy:
        async with pipeline(kind, port=proxy.port, timeout_s=0.3) as pipe:
            assert await pipe.execute("SET", f"{prefix}:s", "1") == b"OK"
            proxy.blackholed.set()
            with pytest.raises(RedisTimeoutError):
                await pipe.execute("GET", f"{prefix}:s")


async def test_a_connection_killed_mid_batch_fails_its_commands_which_redis_never_ran(
    kind: str, prefix: str, control: aioredis.Redis
) -> None:
    async with pipeline(kind) as pipe:
        client_id = await pipe.execute("CLIENT", "ID")
        blocked = outcomes(pipe.execute("BLPOP", f"{prefix}:empty", 10), pipe.execute("INCR", f"{prefix}:n"))
        batch = asyncio.ensure_future(blocked)
        await asyncio.sleep(0.2)  # both sent; Redis holds the INCR behind the BLPOP
        assert await control.execute_command("CLIENT", "KILL", "ID", client_id) == 1
        replies = await batch
        assert [r[0] for r in replies] == [RedisConnectionError, RedisConnectionError]
        assert await control.get(f"{prefix}:n") is None  # not run, and not sent again
        assert await pipe.execute("INCR", f"{prefix}:n") == 1  # a new connection
        assert await pipe.execute("CLIENT", "ID") != client_id


async def test_redis_gone_after_connecting_is_a_connection_error(kind: str, prefix: str) -> None:
    proxy = SwitchableProxy(REDIS_PORT)
    with proxy:
        async with pipeline(kind, port=proxy.port) as pipe:
            assert await pipe.execute("SET", f"{prefix}:s", "1") == b"OK"
            proxy.__exit__(None, None, None)  # every connection closed, nothing listens any more
            await asyncio.sleep(0.1)
            with pytest.raises(RedisConnectionError):
                await pipe.execute("GET", f"{prefix}:s")
            with pytest.raises(RedisConnectionError):
                await pipe.execute("GET", f"{prefix}:s")
