"""Every way a new config reaches a running gateway, all through ``RuntimeHolder.load``.

Sources: the config file (``POST /admin/reload``, SIGHUP, and a watcher that re-reads it), a config in a
request body (``PUT /admin/config``), and optionally other replicas (Redis pub/sub, see
``gateway.config_channel``). Each one parses and validates, then the holder prepares (builds and starts
plugins) and swaps; any failure raises ``ConfigRefused`` (a 400 naming the field and the reason) and the
running config stays live.

The watcher compares the file's *content hash*, never its mtime: a Kubernetes ConfigMap mounted as a
directory changes by swapping the ``..data`` symlink to a new timestamped directory, which keeps the
mtime of ``config.yaml`` (itself a symlink) meaningless. It polls because reading a few KB through the
symlinks every couple of seconds costs nothing, sees every kind of replacement (in-place write, editor
rename, symlink swap, network filesystems without inotify) and needs no extra thread; the kubelet
itself only refreshes ConfigMaps every minute or so. A content change that is refused is not retried
until the content changes again.

Nothing here loads code, templates or files named by a request: a body is YAML/JSON data validated
against the config models, and plugins are only ever looked up by name in the installed registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.ops.logs import apply_logging
from gateway.ops.settings import Settings
from gateway.ops.tasks import stop_if_cancelled
from gateway.pipeline.config import ConfigError, GatewayConfig, parse_config
from gateway.pipeline.reload_history import ReloadHistory
from gateway.pipeline.runtime import RuntimeHolder
from gateway.wire.errors import InvalidRequest

log = logging.getLogger("gateway.reload")

#: Called after a change went live with (config text, version, source); used to tell other replicas.
Announce = Callable[[bytes, str, str], Awaitable[None]]


class ConfigRefused(InvalidRequest):
    """A config that could not go live; the running one is untouched."""

    def __init__(self, error: ConfigError, live_version: str | None) -> None:
        first = error.problems[0] if error.problems else ""
        field, sep, _ = first.partition(": ")
        still = f"the running config (version {live_version}) stays live" if live_version else "nothing was loaded"
        super().__init__(
            f"The new config was refused and {still}: " + "; ".join(error.problems),
            param=field if sep and " " not in field else None,
            code="config_invalid",
        )
        self.problems = error.problems


@dataclass(frozen=True, slots=True)
class ReloadResult:
    version: str
    changed: bool
    loaded_at: float
    source: str

    def as_json(self) -> dict[str, Any]:
        return {"version": self.version, "changed": self.changed, "loaded_at": self.loaded_at, "source": self.source}


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Reloader:
    """Turns config sources into ``holder.load`` calls; owns the watcher and the SIGHUP handler."""

    def __init__(self, holder: RuntimeHolder, settings: Settings) -> None:
        self.holder = holder
        self.settings = settings
        self.path: Path = settings.config_path
        self.source = "initial"
        self.announce: Announce | None = None
        self._file_hash: str | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sighup = False
        # SIGHUP's disposition before start(), given back by aclose(): asyncio's remove_signal_handler
        # resets it to SIG_DFL, which under nohup (SIG_IGN) would let a later SIGHUP kill the process.
        self._sighup_before: Any = None
        self.channel: ConfigChannel | None = None
        #: Every attempt through this reloader, accepted or refused (bounded; the console shows it).
        self.history = ReloadHistory()

    # -- sources ----------------------------------------------------------------------------------

    async def from_file(self, source: str = "file", *, who: str | None = None) -> ReloadResult:
        """Re-read the configured file (never a path from a request). ``who`` names the caller in the
        reload history (the source when not given)."""
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except OSError as exc:
            problem = f"{self.path}: cannot read the config file: {exc.strerror or exc}"
            raise self._refused(ConfigError([problem]), source, who) from None
        result = await self.from_text(data, source, origin=str(self.path), who=who)
        self._file_hash = content_hash(data)
        return result

    async def from_text(
        self, data: bytes, source: str, *, origin: str = "config", announce: bool = True, who: str | None = None
    ) -> ReloadResult:
        """Parse YAML or JSON ``data`` and load it. Raises ``ConfigRefused``."""
        try:
            config = parse_config(data, source=origin)
        except ConfigError as exc:
            raise self._refused(exc, source, who) from None
        return await self.load(config, source, text=data if announce else None, who=who)

    async def load(
        self, config: GatewayConfig, source: str, *, text: bytes | None = None, who: str | None = None
    ) -> ReloadResult:
        try:
            snapshot, changed = await self.holder.load(config)
        except ConfigError as exc:
            raise self._refused(exc, source, who) from None
        self.history.record(source, who, "accepted" if changed else "unchanged", snapshot.version)
        if changed:
            self.source = source
            apply_logging(config.logging, override=self.settings.log_level)
            log.info("config %s loaded from %s", snapshot.version, source)
            if text is not None and self.announce is not None:
                try:
                    await self.announce(text, snapshot.version, source)
                except Exception:  # telling others is best effort; this replica already runs it
                    log.exception("could not announce config %s to other replicas", snapshot.version)
        return ReloadResult(snapshot.version, changed, snapshot.loaded_at, self.source)

    def _refused(self, error: ConfigError, source: str, who: str | None) -> ConfigRefused:
        live = self.holder.current.version if self.holder.loaded else None
        log.warning("config refused: %s", "; ".join(error.problems))
        refused = ConfigRefused(error, live)
        self.history.record(source, who, "refused", live, refused.message)
        return refused

    # -- background triggers ----------------------------------------------------------------------

    def start(self, *, watch: bool = True) -> None:
        """Install the SIGHUP handler (main thread only) and start the file watcher if enabled.

        ``watch=False`` when the running config did not come from the file (tests, embedding)."""
        try:
            before = signal.getsignal(signal.SIGHUP)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            self._sighup, self._sighup_before = True, before
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread (tests), or Windows
            log.debug("SIGHUP reload not available in this thread")
        if watch and self.settings.config_watch_s > 0:
            self.spawn(self._watch(self.settings.config_watch_s), "config-watch")
        if self.settings.config_channel:
            self.channel = ConfigChannel(self, self.settings.redis_url, self.settings.config_channel)
            self.announce = self.channel.publish
            self.spawn(self.channel.listen(), "config-channel")

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_sighup(self) -> None:
        log.info("SIGHUP: reloading %s", self.path)
        self.spawn(self._quietly(self.from_file("sighup")), "config-sighup")

    @staticmethod
    async def _quietly(work: Awaitable[ReloadResult]) -> None:
        with contextlib.suppress(ConfigRefused):  # already logged; the old config stays live
            await work

    async def _watch(self, interval_s: float) -> None:
        if self._file_hash is None:
            with contextlib.suppress(OSError):
                self._file_hash = content_hash(await asyncio.to_thread(self.path.read_bytes))
        while True:
            await asyncio.sleep(interval_s)
            try:
                data = await asyncio.to_thread(self.path.read_bytes)
            except OSError:
                continue  # mid-swap or removed: keep serving, look again next time
            digest = content_hash(data)
            if digest == self._file_hash:
                continue
            self._file_hash = digest  # a refused content is not retried until it changes again
            started = time.perf_counter()
            with contextlib.suppress(ConfigRefused):
                result = await self.from_text(data, "watch", origin=str(self.path))
                log.info(
                    "config file changed: version %s (%s, %.0f ms)",
                    result.version,
                    "applied" if result.changed else "same config",
                    (time.perf_counter() - started) * 1000,
                )
            # Loading catches errors on its way (a plugin that could not start is refused, a failed
            # announcement logged): a cancellation one of them was turned into must still end the watch.
            stop_if_cancelled()

    async def aclose(self) -> None:
        if self._sighup:
            self._sighup = False
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
                if self._sighup_before is not None:  # None: not set from Python, nothing to give back
                    signal.signal(signal.SIGHUP, self._sighup_before)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self.channel is not None:
            await self.channel.aclose()


class ConfigChannel:
    """Replicas tell each other about a new config over Redis pub/sub.

    A replica that loaded a change (from any source but the channel) publishes
    ``{"origin", "version", "config"}``; every other replica (and every worker process of this one)
    loads that text through the same parse/prepare/swap, so a refused config is refused everywhere it
    is invalid and the running one stays. Whoever can publish on the channel can change the config:
    protect Redis with ACLs as you protect the admin token. Every wait is bounded: publishing by the
    socket timeout, listening by one-second polls, reconnecting by a capped backoff.
    """

    def __init__(self, reloader: Reloader, redis_url: str, channel: str) -> None:
        self.reloader = reloader
        self.name = channel
        self.origin = uuid.uuid4().hex
        # Its own client: a subscribed connection cannot serve commands, and the shared pools use
        # sub-second timeouts meant for cache lookups.
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
        self.ready = asyncio.Event()

    async def publish(self, text: bytes, version: str, source: str) -> None:
        if source == "channel":
            return
        message = {"origin": self.origin, "version": version, "source": source, "config": text.decode()}
        await self.redis.publish(self.name, orjson.dumps(message))

    async def listen(self) -> None:
        backoff = 0.5
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.name)
                    self.ready.set()
                    backoff = 0.5
                    await self._receive(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: keep serving, try again later
                stop_if_cancelled()  # redis-py may turn the cancellation of a read into ConnectionError
                self.ready.clear()
                log.warning("config channel %s: %s; retrying in %.1f s", self.name, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _receive(self, pubsub: aioredis.client.PubSub) -> None:
        """Apply each message of a subscribed channel, until the connection fails."""
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None and message.get("type") == "message":
                await self._received(message["data"])

    async def _received(self, data: bytes) -> None:
        try:
            message = orjson.loads(data)
            origin, version, text = message["origin"], message["version"], message["config"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("config channel %s: ignored a message that is not a config announcement", self.name)
            return
        holder = self.reloader.holder
        if origin == self.origin or (holder.loaded and holder.current.version == version):
            return
        try:
            result = await self.reloader.from_text(str(text).encode(), "channel", origin="config channel")
        except ConfigRefused:
            return  # logged; the running config stays
        if result.version != version:
            log.warning("config channel: announced version %s loaded as %s here", version, result.version)

    async def aclose(self) -> None:
        await self.redis.aclose()
