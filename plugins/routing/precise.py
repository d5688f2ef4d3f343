"""precise_prefix: place a request where its prompt's KV blocks are, checked against what the worker says.

Per request (``predict``, in ``on_request``): the prompt is tokenized as the worker will (in a thread
when long) and its full blocks hashed as vLLM hashes them, unless it is longer than any worker takes
(``token_limit``). Per pick (``PreciseRequest.choose``, on the core's synchronous path): each available
worker's longest held prefix (the KV index the worker table keeps from its events) and its load go
through the weighted scorers (``scorers.rank``). Per response
(``check``): the worker's ``cached_tokens`` against the prediction for that worker.

Each placement also records the prompt's blocks as recent demand on the chosen worker (``demand``: a
``BlockIndex`` per model, kept across reloads, bounded by the pool's KV cache blocks together, since
older demand is gone from any cache by then, or by the KV index's bound when the workers' sizes are not
known). A cold prompt, one that no worker holds more of than the
others, goes to the worker whose recent working set is smallest (``scorers.rank``): new prefixes are
spread by what each cache is already asked to hold, not by load alone. And a placement's new blocks are
pending on that worker until its events arrive (``pending.PendingBlocks``), so that a repeat of the
prompt sent meanwhile follows it instead of looking cold; predictions still go by the index alone.

Approximate affinity (``prefix_affinity``) places the request instead when precise placement cannot be
trusted: a worker of the model whose events are not followed or went silent, a block size not learned
yet, or a model degraded by its checks. The prediction is still made and checked, so a degraded model
recovers by itself. Models served by a single worker are never tokenized.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.upstream.kv_feed import FIRST_STORED_BLOCKS, WorkerKv
from gateway.upstream.kv_index import BlockIndex
from gateway.upstream.workers import Worker, WorkerTable
from plugins.routing.accuracy import AccuracyTracker, reported_cached_tokens
from plugins.routing.blockhash import BlockHasher, predicted_cached_tokens
from plugins.routing.cache_keys import KeyHomes, lineage
from plugins.routing.config import ModelRouting
from plugins.routing.pending import PendingBlocks
from plugins.routing.policies import WorkerPool
from plugins.routing.prompt_tokens import PromptTokenizer, TokenizerBusy
from plugins.routing.scorers import Candidate, Weights, rank
from plugins.routing.telemetry import RoutingShared

log = logging.getLogger("gateway.routing.placement")
STATE_KEY = "routing"  # ctx.state[STATE_KEY]: the request's PreciseRequest


@dataclass(slots=True)
class PreciseRequest:
    """One request's prediction: its prompt's block hashes, and the cached tokens predicted for each
    worker it was sent to."""

    placement: PrecisePlacement
    prompt_tokens: int
    hashes: list[int]
    block_size: int
    lineage: int | None = None  # the tenant's prompt_cache_key, hashed (``cache_keys``)
    predicted: dict[str, int] = field(default_factory=dict)

    def choose(self, pool: WorkerPool, tried: list[Worker], now: float) -> Worker | None:
        """The best worker by the scorers, or None when precise placement cannot be trusted now."""
        return self.placement.choose(self, pool, tried, now)

    def note(self, worker: Worker, held_blocks: int | None = None) -> None:
        """``worker`` was chosen (by whichever policy): remember what it should report as cached, and
        count the prompt's blocks as demand on it."""
        placement = self.placement
        index = placement.workers.kv.index
        held = index.prefix_blocks(worker.url, self.hashes) if held_blocks is None else held_blocks
        self.predicted[worker.url] = predicted_cached_tokens(held, self.prompt_tokens, self.block_size)
        if held < len(self.hashes):  # it will store new blocks: an event must follow
            placement.workers.kv.expect(worker.url)
            placement.pending.add(worker.url, self.hashes[held:])
        placement.demand.store(worker.url, self.hashes)
        if self.lineage is not None:
            placement.homes.remember(self.lineage, worker.url)


class PrecisePlacement:
    """precise_prefix for one model within one config snapshot."""

    def __init__(
        self, model: str, routing: ModelRouting, tokenizer: PromptTokenizer, workers: WorkerTable, shared: RoutingShared
    ) -> None:
        self.model = model
        self.routing = routing
        self.config = routing.precise
        self.tokenizer = tokenizer
        self.workers = workers
        self.shared = shared
        config = self.config
        self.weights = Weights(config.prefix_weight, config.queue_weight, config.kv_weight, config.home_weight)
        self._hashers: dict[int, BlockHasher] = {}
        self._verified: set[int] = set()  # ids of the first BlockStored events already checked
        self._rr = 0
        tracker = shared.accuracy.get(model)
        if tracker is None:
            tracker = shared.accuracy[model] = AccuracyTracker(
                model, window=config.accuracy_window, min_samples=config.accuracy_min_samples,
                threshold=config.accuracy_threshold,
            )  # fmt: skip
        else:
            tracker.configure(
                window=config.accuracy_window, min_samples=config.accuracy_min_samples,
                threshold=config.accuracy_threshold,
            )  # fmt: skip
        self.tracker = tracker
        # sized from the feed's settings at each placement (``_size_memory``): they change after this
        self.demand = shared.demand.setdefault(model, BlockIndex(workers.kv.index.max_entries))
        self.pending = shared.pending.setdefault(
            model, PendingBlocks(workers.kv.settings.expire_s, workers.kv.index.max_entries)
        )
        self.homes = shared.homes.setdefault(model, KeyHomes(config.cache_key_entries))
        self.homes.max_entries = config.cache_key_entries  # a reload may change it; the next remember applies it

    def hasher(self, block_size: int) -> BlockHasher:
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher(self.config.hash_algo, self.config.hash_seed, block_size)
        return hasher

    def block_size(self, pool: WorkerPool) -> int | None:
        """The configured block size, else the one the pool's workers publish in their events, else in
        their metrics (before their first event reaches this replica; checked: they must agree)."""
        feed = self.workers.kv
        states = [s for w in pool.workers if (s := feed.workers.get(w.url)) is not None]
        self._verify(states)
        learned = {s.block_size for s in states if s.block_size}
        if not learned:
            samples = (self.workers.load.sample(w.url) for w in pool.workers)
            learned = {s.block_size for s in samples if s is not None and s.block_size}
        if self.config.block_size is not None:
            if learned - {self.config.block_size}:
                self.tracker.mark(f"workers publish block size {sorted(learned)}, configured {self.config.block_size}")
            return self.config.block_size
        if len(learned) > 1:
            self.tracker.mark(f"the workers publish different block sizes {sorted(learned)}")
        return min(learned) if learned else None

    def _verify(self, states: list[WorkerKv]) -> None:
        """Hash the first blocks (at most ``FIRST_STORED_BLOCKS``) of a worker's first published block
        chain ourselves: another hash algorithm, seed or block size would give no match at all, silently.
        Bounded whatever the event says: this runs on the event loop, in ``predict``, and an event with
        millions of token ids (one byte each on the wire) but no hashes would be millions of blocks."""
        for state in states:
            event = state.first_stored
            if event is None or id(event) in self._verified or event.extra_keys or not event.block_size:
                continue
            blocks = min(len(event.hashes), FIRST_STORED_BLOCKS)
            tokens = event.token_ids[: blocks * event.block_size]
            if not blocks or len(tokens) < blocks * event.block_size:
                continue  # no blocks, or not the tokens of its blocks (vLLM always sends them): nothing to check
            self._verified.add(id(event))
            ours = self.hasher(event.block_size).hashes(tokens)
            if ours != event.hashes[:blocks]:
                self.tracker.mark(
                    f"worker {state.url}'s block hashes differ from the gateway's (hash_algo "
                    f"{self.config.hash_algo!r}, seed {'set' if self.config.hash_seed else 'default'})"
                )

    async def predict(self, ctx: RequestContext, pool: WorkerPool) -> PreciseRequest | None:
        """The request's block hashes, or None when they cannot be known (nothing to predict)."""
        if len(pool) < 2 or ctx.model.name != self.model:
            return None
        block_size = self.block_size(pool)
        if block_size is None:
            return None
        salt = ctx.body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        hasher = self.hasher(block_size)
        limit = self.token_limit(ctx.model.max_model_len, pool)

        def work(wait: bool) -> tuple[int, list[int]] | None:
            tokens = self.tokenizer.tokens(ctx.endpoint, ctx.body, wait=wait, at_most=limit)
            if tokens is None or (limit is not None and len(tokens) > limit):
                return None  # longer than any worker takes: it will refuse it, nothing to place by
            return len(tokens), hasher.hashes(tokens, salt)

        long = len(ctx.raw_body) > self.config.thread_above_chars
        try:
            # on the loop, work(False) never waits for the tokenizer's lock: run's turn has it free already
            result = await self.tokenizer.run(lambda: work(long), in_thread=long, wait_s=self.config.tokenizer_wait_s)
        except TokenizerBusy:  # another prompt holds the tokenizer: placed without waiting for it
            log.debug("request %s: no prediction (tokenizer busy)", ctx.request_id)
            return None
        except Exception as exc:  # a template that refuses the request: the worker will say why
            log.debug("request %s: no prediction (%s)", ctx.request_id, exc)
            return None
        if result is None:
            return None
        return PreciseRequest(self, result[0], result[1], block_size, lineage(ctx.tenant, ctx.body))

    def token_limit(self, max_model_len: int | None, pool: WorkerPool) -> int | None:
        """The longest prompt a worker of the pool can take: the model's configured context, and the
        largest KV cache among the workers when each one's is known from its metrics (vLLM does not start
        with a context its cache cannot hold). None when neither is known.

        Why: a prompt's blocks are looked up and stored on the event loop at each placement, so their
        number must not be the client's to choose. A 4 MiB completions body of token ids is about two
        million tokens, 131,072 blocks of 16: 0.4 s of the loop for one request's placement."""
        limits = [max_model_len] if max_model_len else []
        caches = []
        for worker in pool.workers:
            sample = self.workers.load.sample(worker.url)
            if sample is None or not sample.cache_blocks or not sample.block_size:
                break
            caches.append(sample.cache_blocks * sample.block_size)
        else:
            if caches:
                limits.append(max(caches))
        return min(limits) if limits else None

    def choose(self, request: PreciseRequest, pool: WorkerPool, tried: list[Worker], now: float) -> Worker | None:
        counter = self.shared.placements
        if self.tracker.degraded:
            counter.labels(self.model, "fallback_degraded").inc()
            return None
        feed, load = self.workers.kv, self.workers.load
        live = [w for w in pool.workers if w.available(now) and w not in tried]
        if not live:
            return None
        if not all(feed.trusted(w.url) for w in live):
            counter.labels(self.model, "fallback_untrusted").inc()
            return None
        start = self._rr = (self._rr + 1) % len(live)
        self._size_memory(pool)
        home = self.homes.home(request.lineage) if request.lineage is not None else None
        candidates = []
        indexed: dict[str, int] = {}  # what the prediction goes by: the index, the worker's own word
        for worker in live[start:] + live[:start]:
            sample = load.sample(worker.url)
            held = indexed[worker.url] = feed.index.prefix_blocks(worker.url, request.hashes)
            held = self.pending.extend(worker.url, request.hashes, held)  # a repeat follows its first request
            running, waiting, kv = (sample.running, sample.waiting, sample.kv_usage) if sample else (None, None, None)
            working_set = self.demand.blocks(worker.url)
            at_home = worker.url == home
            candidates.append(Candidate(worker.url, held, worker.in_flight, running, waiting, kv, working_set, at_home))
        ranked = rank(
            candidates, len(request.hashes), self.weights,
            load_factor=self.routing.load_factor, load_slack=self.routing.load_slack,
            fresh=request.lineage is not None and home is None, min_match=self.config.min_match,
        )  # fmt: skip
        best = ranked[0][1]
        worker = next(w for w in live if w.url == best.key)
        request.note(worker, indexed[worker.url])
        counter.labels(self.model, "precise").inc()
        return worker

    def _size_memory(self, pool: WorkerPool) -> None:
        """Recent demand spans what the pool's caches hold together (each worker's ``num_gpu_blocks``,
        from its metrics): older demand is gone from any cache. When a worker's size is not known, it
        spans everything placed since the start, up to the KV index's own bound. Pending blocks live as
        long as the feed waits for a worker's events, within the same bound."""
        feed = self.workers.kv
        bound = feed.index.max_entries
        self.pending.lifetime_s, self.pending.max_entries = feed.settings.expire_s, bound
        window = 0
        for worker in pool.workers:
            sample = self.workers.load.sample(worker.url)
            if sample is None or not sample.cache_blocks:
                window = bound
                break
            window += sample.cache_blocks
        self.demand.max_entries = max(1, min(window, bound))

    def check(self, ctx: RequestContext, response: ModelResponse) -> None:
        """Compare the worker's reported cached tokens with the prediction for that worker."""
        request = ctx.state.get(STATE_KEY)
        worker = ctx.worker
        if not isinstance(request, PreciseRequest) or worker is None or response.status != 200:
            return
        predicted = request.predicted.get(worker.url)
        if predicted is None:
            return
        ctx.log["cached_tokens_predicted"] = predicted  # beside the worker's usage in the access log
        actual = reported_cached_tokens(response.json.get("usage"))
        if actual is None:
            return
        self.workers.kv.record_hit(worker.url, actual, request.prompt_tokens)
        self.shared.prediction_error.labels(self.model).observe(abs(predicted - actual))
        self.tracker.observe(predicted, actual, request.block_size)
        share = self.tracker.share()
        if share is not None:
            self.shared.prediction_within_block.labels(self.model).set(share)
        self.shared.placement_degraded.labels(self.model).set(1 if self.tracker.degraded else 0)


def placement_view(
    placements: dict[str, PrecisePlacement], pool_of: Callable[[str], WorkerPool], workers: WorkerTable
) -> dict[str, Any]:
    """What ``POST /admin/plugins/routing/placement`` shows."""
    feed = workers.kv
    models = []
    for model, placement in placements.items():
        tracker = placement.tracker
        rows = []
        for worker in pool_of(model).workers:
            state = feed.workers.get(worker.url)
            sample = workers.load.sample(worker.url)
            rows.append(
                {
                    "url": worker.url,
                    "blocks": feed.index.blocks(worker.url),
                    "working_set": placement.demand.blocks(worker.url),
                    "hit_rate": None if state is None else state.hit_rate,
                    "events": None if state is None else {
                        "following": state.source is not None, "trusted": feed.trusted(worker.url),
                        "last_seq": state.last_seq, "block_size": state.block_size, "batches": state.batches,
                        "gaps": state.gaps, "resyncs": state.resyncs, "restarts": state.restarts,
                        "removals": state.removals, "received": state.received, "unread": state.unread,
                        "reconnects": state.reconnects,
                    },
                    "load": None if sample is None else {
                        "running": sample.running, "waiting": sample.waiting, "kv_usage": sample.kv_usage,
                    },
                }
            )  # fmt: skip
        models.append(
            {
                "model": model,
                "degraded": tracker.degraded,
                "within_one_block": tracker.share(),
                "checked": tracker.checked,
                "workers": rows,
            }
        )
    return {"models": models, "index_entries": len(feed.index), "index_evicted": feed.index.evicted}
