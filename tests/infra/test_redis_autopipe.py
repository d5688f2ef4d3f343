"""gateway/infra/redis_autopipe.py against the real Redis: batching per loop turn, per-command errors,
scripts Redis does not know yet, callers that give up, the connection handshake (credentials, database,
a Unix socket), and Redis failing: not there, silent, dropping the connection, talking nonsense."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.infra.redis_autopipe import AutoPipeline
from tests.support.fakes import free_port
from tests.support.faults import BlackHole, SwitchableProxy

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
async def client() -> AsyncIterator[aioredis.Redis]:
    redis_client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=2)
    yield redis_client
    await redis_client.aclose()


@pytest.fixture
async def prefix(client: aioredis.Redis) -> AsyncIterator[str]:
    """Keys of this test's own, deleted afterwards."""
    name = f"gwtest:autopipe:{uuid.uuid4().hex}"
    yield name
    keys = [k async for k in client.scan_iter(match=name + ":*")]
    if keys:
        await client.delete(*keys)


async def connected(client: aioredis.Redis, **kwargs: int) -> AutoPipeline:
    """A pipeline whose connection is open (the commands queued while connecting go out together)."""
    pipe = AutoPipeline(client, **kwargs)
    assert await pipe.execute("PING") == b"PONG"
    pipe.batches_sent = 0
    return pipe


async def test_commands_of_one_loop_turn_go_as_one_write(client: aioredis.Redis, prefix: str) -> None:
    pipe = await connected(client)
    assert await asyncio.gather(*(pipe.execute("SET", f"{prefix}:{i}", i) for i in range(20))) == [b"OK"] * 20
    assert pipe.batches_sent == 1
    values = await asyncio.gather(*(pipe.execute("GET", f"{prefix}:{i}") for i in range(20)))
    assert values == [str(i).encode() for i in range(20)]
    assert pipe.batches_sent == 2
    await pipe.aclose()


async def test_sequential_commands_each_go_at_once(client: aioredis.Redis, prefix: str) -> None:
    pipe = await connected(client)
    for i in range(3):
        assert await pipe.execute("INCR", f"{prefix}:n") == i + 1
    assert pipe.batches_sent == 3
    await pipe.aclose()


async def test_a_full_batch_is_sent_without_waiting_for_the_turn_to_end(client: aioredis.Redis, prefix: str) -> None:
    pipe = await connected(client, max_batch=4)
    results = await asyncio.gather(*(pipe.execute("SET", f"{prefix}:{i}", "v") for i in range(10)))
    assert results == [b"OK"] * 10
    assert pipe.batches_sent == 3  # 4 + 4 + 2
    await pipe.aclose()


async def test_commands_queued_while_connecting_go_in_batches_of_the_limit(client: aioredis.Redis, prefix: str) -> None:
    pipe = AutoPipeline(client, max_batch=4)
    results = await asyncio.gather(*(pipe.execute("SET", f"{prefix}:{i}", "v") for i in range(10)))
    assert results == [b"OK"] * 10
    assert pipe.batches_sent == 3
    await pipe.aclose()


async def test_replies_keep_their_order_across_many_batches(client: aioredis.Redis, prefix: str) -> None:
    """Replies are matched to commands by order alone: interleave batches and check every answer."""
    pipe = await connected(client, max_batch=7)

    async def echo(i: int) -> bytes:
        await asyncio.sleep(0.001 * (i % 3))
        return await pipe.execute("ECHO", f"{prefix}:{i}")

    assert await asyncio.gather(*(echo(i) for i in range(300))) == [f"{prefix}:{i}".encode() for i in range(300)]
    assert pipe.batches_sent > 3
    await pipe.aclose()


async def test_an_error_reaches_only_the_command_that_caused_it(client: aioredis.Redis, prefix: str) -> None:
    pipe = AutoPipeline(client)
    await client.lpush(f"{prefix}:list", "x")
    results = await asyncio.gather(
        pipe.execute("SET", f"{prefix}:a", "1"),
        pipe.execute("INCR", f"{prefix}:list"),  # WRONGTYPE
        pipe.execute("GET", f"{prefix}:a"),
        return_exceptions=True,
    )
    assert results[0] == b"OK"
    assert isinstance(results[1], ResponseError) and "WRONGTYPE" in str(results[1])
    assert results[2] == b"1"
    await pipe.aclose()


async def test_a_script_redis_does_not_know_is_loaded_and_run(client: aioredis.Redis, prefix: str) -> None:
    # A comment unique to this test gives a SHA that no Redis has loaded yet: the batch gets NOSCRIPT,
    # as it would from a Redis that restarted or flushed its scripts.
    script = client.register_script(f"-- {uuid.uuid4().hex}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1])")
    pipe = AutoPipeline(client)
    assert await pipe.evalsha(script, [f"{prefix}:s"], [5]) == 5
    assert await client.script_exists(script.sha) == [True]
    assert await pipe.evalsha(script, [f"{prefix}:s"], [2]) == 7  # now by SHA, in a batch
    await pipe.aclose()


async def test_a_caller_that_gives_up_leaves_the_batch_intact(client: aioredis.Redis, prefix: str) -> None:
    pipe = AutoPipeline(client)
    await client.set(f"{prefix}:k", "v")
    impatient = asyncio.ensure_future(pipe.execute("GET", f"{prefix}:k"))
    patient = asyncio.ensure_future(pipe.execute("GET", f"{prefix}:k"))
    await asyncio.sleep(0)
    impatient.cancel()
    assert await patient == b"v"
    with pytest.raises(asyncio.CancelledError):
        await impatient
    # The connection the batch used is still good for the next one.
    assert await pipe.execute("GET", f"{prefix}:k") == b"v"
    await pipe.aclose()


async def test_a_redis_that_is_not_there_fails_every_command_of_the_batch() -> None:
    absent = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    pipe = AutoPipeline(absent)
    results = await asyncio.gather(*(pipe.execute("GET", "k") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, RedisConnectionError) for r in results), results
    await pipe.aclose()
    await absent.aclose()


async def test_a_silent_redis_times_out_every_waiting_command() -> None:
    with BlackHole() as hole:
        silent = aioredis.Redis(port=hole.port, socket_connect_timeout=1, socket_timeout=0.3)
        pipe = AutoPipeline(silent)
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(pipe.execute("GET", "k") for _ in range(3)), return_exceptions=True)
        waited = asyncio.get_running_loop().time() - started
        await pipe.aclose()
        await silent.aclose()
    assert all(isinstance(r, RedisTimeoutError) for r in results), results
    assert waited < 5  # bounded by the socket timeout, not by the peer


async def test_after_a_timeout_the_next_command_opens_a_new_connection(prefix: str) -> None:
    with SwitchableProxy(6379) as proxy:
        through = aioredis.Redis(port=proxy.port, socket_connect_timeout=1, socket_timeout=0.3)
        pipe = AutoPipeline(through)
        assert await pipe.execute("SET", f"{prefix}:k", "v") == b"OK"
        proxy.blackholed.set()
        with pytest.raises(RedisTimeoutError):
            await pipe.execute("GET", f"{prefix}:k")
        proxy.blackholed.clear()
        assert await pipe.execute("GET", f"{prefix}:k") == b"v"
        await pipe.aclose()
        await through.aclose()


async def test_a_connection_killed_by_redis_fails_its_commands_then_reconnects(client: aioredis.Redis) -> None:
    pipe = AutoPipeline(client)
    first_id = await pipe.execute("CLIENT", "ID")
    await client.execute_command("CLIENT", "KILL", "ID", first_id)
    # The kill may land before or after the next write: that command fails or succeeds, never hangs.
    with contextlib.suppress(RedisConnectionError):
        await pipe.execute("PING")
    second_id = await pipe.execute("CLIENT", "ID")
    assert second_id != first_id
    await pipe.aclose()


async def serve_bytes(reply: bytes, connections: list[int]) -> tuple[asyncio.Server, int]:
    """A TCP server that answers whatever arrives with ``reply``; counts its connections."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while data := await reader.read(65536):
            del data
            writer.write(reply)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_an_unreadable_reply_fails_the_connection() -> None:
    connections: list[int] = []
    server, port = await serve_bytes(b"%%not resp\r\n", connections)
    async with server:
        peer = aioredis.Redis(port=port, socket_connect_timeout=1, socket_timeout=1)
        pipe = AutoPipeline(peer)
        with pytest.raises(RedisConnectionError, match="unreadable"):
            await pipe.execute("PING")
        await pipe.aclose()
        await peer.aclose()


async def test_a_reply_nobody_asked_for_drops_the_connection() -> None:
    """Two replies to each command: the second one is unasked, so the stream is out of step and the
    next command goes on a new connection."""
    connections: list[int] = []
    server, port = await serve_bytes(b"+OK\r\n+OK\r\n", connections)
    async with server:
        peer = aioredis.Redis(port=port, socket_connect_timeout=1, socket_timeout=1)
        pipe = AutoPipeline(peer)
        assert await pipe.execute("PING") == b"OK"
        for _ in range(100):  # bounded: 1 s for the second reply to arrive
            if pipe._conn is not None and not pipe._conn.open:
                break
            await asyncio.sleep(0.01)
        assert await pipe.execute("PING") == b"OK"
        assert len(connections) == 2
        await pipe.aclose()
        await peer.aclose()


async def test_the_database_of_the_url_is_selected(prefix: str) -> None:
    db1 = aioredis.Redis.from_url("redis://127.0.0.1:6379/1", socket_timeout=2)
    pipe = AutoPipeline(db1)
    try:
        assert await pipe.execute("SET", f"{prefix}:db", "one") == b"OK"
        assert await db1.get(f"{prefix}:db") == b"one"
        db0 = aioredis.Redis.from_url(REDIS_URL)
        assert await db0.exists(f"{prefix}:db") == 0
        await db0.aclose()
    finally:
        await db1.delete(f"{prefix}:db")
        await pipe.aclose()
        await db1.aclose()


@pytest.fixture
async def acl_user(client: aioredis.Redis, prefix: str) -> AsyncIterator[tuple[str, str]]:
    """A Redis user allowed only this test's keys, removed afterwards."""
    name, password = f"gwtest-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
    await client.execute_command("ACL", "SETUSER", name, "on", f">{password}", f"~{prefix}:*", "+@all")
    yield name, password
    await client.execute_command("ACL", "DELUSER", name)


async def test_credentials_of_the_url_authenticate_the_connection(acl_user: tuple[str, str], prefix: str) -> None:
    name, password = acl_user
    authed = aioredis.Redis.from_url(f"redis://{name}:{password}@127.0.0.1:6379/0", socket_timeout=2)
    pipe = AutoPipeline(authed)
    assert await pipe.execute("SET", f"{prefix}:mine", "1") == b"OK"
    with pytest.raises(NoPermissionError):
        await pipe.execute("GET", "gwtest:someone-else")
    await pipe.aclose()
    await authed.aclose()

    wrong = aioredis.Redis.from_url(f"redis://{name}:not-{password}@127.0.0.1:6379/0", socket_timeout=2)
    pipe = AutoPipeline(wrong)
    with pytest.raises(AuthenticationError):
        await pipe.execute("PING")
    await pipe.aclose()
    await wrong.aclose()


@contextlib.asynccontextmanager
async def unix_relay(path: Path) -> AsyncIterator[None]:
    """A Unix socket at ``path`` whose connections are relayed to Redis on TCP."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True)

    server = await asyncio.start_unix_server(handle, str(path))
    async with server:
        yield


async def test_a_unix_socket_url_is_served(tmp_path: Path, prefix: str) -> None:
    sock = tmp_path / "redis.sock"
    async with unix_relay(sock):
        local = aioredis.Redis.from_url(f"unix://{sock}", socket_timeout=2)
        pipe = AutoPipeline(local)
        assert await pipe.execute("ECHO", f"{prefix}:unix") == f"{prefix}:unix".encode()
        await pipe.aclose()
        await local.aclose()


async def test_aclose_waits_for_replies_due_then_refuses_new_commands(client: aioredis.Redis, prefix: str) -> None:
    pipe = AutoPipeline(client)
    pending = [pipe.submit("SET", f"{prefix}:{i}", i) for i in range(5)]
    await pipe.aclose()
    assert [f.result() for f in pending] == [b"OK"] * 5
    with pytest.raises(RedisConnectionError):
        await pipe.execute("PING")


def test_the_pipeline_works_on_uvloop(prefix: str) -> None:
    """The gateway serves on uvloop, whose transports are not asyncio.Transport subclasses: commands,
    a batch and a reconnect after Redis drops the connection, all on a uvloop loop."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
        pipe = AutoPipeline(client)
        try:
            assert await pipe.execute("SET", f"{prefix}:uv", "1") == b"OK"
            assert await asyncio.gather(*(pipe.execute("INCR", f"{prefix}:uv") for _ in range(10))) == list(
                range(2, 12)
            )
            first_id = await pipe.execute("CLIENT", "ID")
            await client.execute_command("CLIENT", "KILL", "ID", first_id)
            with contextlib.suppress(RedisConnectionError):
                await pipe.execute("PING")
            assert await pipe.execute("CLIENT", "ID") != first_id
        finally:
            await pipe.aclose()
            await client.aclose()

    uvloop.run(scenario())
