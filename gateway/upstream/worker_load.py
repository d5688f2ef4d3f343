"""Each worker's own view of its load, polled from its Prometheus ``/metrics`` in the background.

A gateway replica's in-flight counters are exact for its own requests and blind to the others'; the
worker's ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``
are the same truth for every replica. Samples older than ``max_age_s`` count as unknown, so a worker
that stops answering its metrics never pins traffic away. Polls never sit on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from gateway.ops.tasks import cancel_and_wait

log = logging.getLogger("gateway.worker_load")

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_CACHE_INFO = "vllm:cache_config_info"
Fetch = Callable[[str, float], Awaitable[tuple[int, bytes]]]


@dataclass(frozen=True, slots=True)
class LoadSample:
    running: float
    waiting: float
    kv_usage: float  # 0..1
    at: float
    cache_blocks: int = 0  # the KV cache's size in blocks (vllm:cache_config_info's num_gpu_blocks); 0: unknown
    block_size: int = 0  # tokens per KV block (vllm:cache_config_info's block_size); 0: unknown


def parse_vllm_load(text: str, at: float = 0.0) -> LoadSample:
    """Running and waiting requests summed over the engines of one /metrics page, the highest KV cache
    use among them, their KV cache blocks together and their block size."""
    running = waiting = kv = 0.0
    blocks = block_size = 0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, brace, rest = line.partition("{")
        if name == _CACHE_INFO:  # an info metric: the values are labels
            labels = rest.rpartition("}")[0]
            blocks += _label_int(labels, "num_gpu_blocks")
            block_size = _label_int(labels, "block_size") or block_size
            continue
        if brace:
            fields = rest.rpartition("}")[2].split()
        else:
            name, *fields = line.split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if name == _RUNNING:
            running += value
        elif name == _WAITING:
            waiting += value
        elif name in _KV_USAGE:
            kv = max(kv, value)
    return LoadSample(running, waiting, kv, at, blocks, block_size)


def _label_int(labels: str, name: str) -> int:
    """The whole-number value of label ``name`` in a sample's labels (inside its braces), else 0
    ("None" before vLLM has sized its cache)."""
    for label in labels.split(","):
        key, _, value = label.partition("=")
        if key.strip() == name:
            value = value.strip().strip('"')
            return int(value) if value.isdigit() else 0
    return 0


class LoadPoller:
    """Polls the followed workers every ``interval_s``; ``sample(url)`` is the last fresh one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: dict[str, LoadSample] = {}
        self._urls: list[str] = []
        self._fetch: Fetch | None = None
        self.interval_s = 2.0
        self.timeout_s = 1.0
        self.max_age_s = 10.0
        self._task: asyncio.Task[None] | None = None

    def sample(self, url: str) -> LoadSample | None:
        found = self._samples.get(url)
        if found is None or self._clock() - found.at > self.max_age_s:
            return None
        return found

    def record(self, url: str, sample: LoadSample) -> None:
        self._samples[url] = sample

    def follow(self, urls: Iterable[str], fetch: Fetch, *, interval_s: float, timeout_s: float) -> None:
        """Poll exactly ``urls`` from now on (the loop starts on the first call)."""
        self._urls = list(dict.fromkeys(urls))
        self._fetch = fetch
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.max_age_s = max(5 * interval_s, 2 * timeout_s)
        for url in [u for u in self._samples if u not in self._urls]:
            del self._samples[url]
        if self._task is None and self._urls:
            self._task = asyncio.create_task(self._loop(), name="worker-load-poll")

    async def poll_once(self) -> None:
        urls, fetch = list(self._urls), self._fetch
        if fetch is None:
            return
        results = await asyncio.gather(*(fetch(u + "/metrics", self.timeout_s) for u in urls), return_exceptions=True)
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, tuple) and result[0] == 200:
                self._samples[url] = parse_vllm_load(result[1].decode("utf-8", "replace"), self._clock())

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # a bug here must not end polling for good
                log.exception("worker load poll failed")
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
