"""The routing plugin's ``config:`` section: per-model policy, canary weights, fallbacks, admission,
retries, discovery and optional load scraping. Validated before a config goes live."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

PolicyName = Literal["round_robin", "least_outstanding", "prefix_affinity", "session_affinity", "precise_prefix"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdmissionConfig(_Strict):
    """Per-model limits. A request over ``max_in_flight`` waits in a priority queue (at most
    ``max_queue`` waiters, each at most ``max_queue_time_s``); beyond that it gets a 429 at once."""

    max_in_flight: int | None = Field(
        None, ge=1, description="requests at the model's workers at once (None: no limit)"
    )
    max_queue: int = Field(0, ge=0, description="requests that may wait for a slot")
    max_queue_time_s: float = Field(5.0, gt=0, description="longest wait for a slot before a 429")
    retry_after_s: int = Field(1, ge=1, le=3600, description="the Retry-After a refused client is given")


class PreciseConfig(_Strict):
    """precise_prefix: place a request on the worker that holds the longest prefix of its prompt's KV
    blocks (from the workers' KV cache events), weighed against load. The prompt is tokenized as the
    worker does it, so the tokenizer, chat template, hash algorithm and seed must be the workers'."""

    tokenizer: str | None = Field(
        None, description="the model's Hugging Face directory (default: the managed worker's prepared model)"
    )
    chat_template: str | None = Field(
        None, description="the workers' --chat-template file (default: the managed worker's, else the model's own)"
    )
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(
        "sha256", description="the workers' --prefix-caching-hash-algo (xxhash is seeded per process: unusable)"
    )
    hash_seed: str | None = Field(None, description="the workers' PYTHONHASHSEED, when they set one")
    block_size: int | None = Field(
        None, ge=1, description="the workers' KV block size (default: learned from their events; CPU 128, GPU 16)"
    )
    prefix_weight: float = Field(3.0, ge=0, description="weight of the share of the prompt's blocks held")
    queue_weight: float = Field(2.0, ge=0, description="weight of the worker's load (1 - load / the bounded-load cap)")
    kv_weight: float = Field(1.0, ge=0, description="weight of the worker's free KV cache")
    home_weight: float = Field(
        2.5,
        ge=0,
        description="weight of the worker the request's prompt_cache_key last went to (above the queue's, so a"
        " lineage stays home when the held blocks tie; below the prefix's, so a worker holding the whole prompt"
        " wins over a home that lost it)",
    )
    min_match: float = Field(
        0.5,
        ge=0,
        le=1,
        description="a prompt no worker holds this share of (in blocks) is placed by cache room, as a cold one:"
        " it brings more than it would reuse (0: only prompts every worker holds equally)",
    )
    cache_key_entries: int = Field(
        65_536, ge=1, le=10_000_000, description="prompt_cache_key lineages remembered per model (LRU)"
    )
    thread_above_chars: int = Field(
        4096, ge=0, description="prompts longer than this are tokenized in a thread, off the event loop"
    )
    tokenizer_wait_s: float = Field(
        0.05,
        ge=0,
        description="a request that finds the model's tokenizer busy with other prompts for longer than this is"
        " placed by approximate affinity, not tokenized: one client's long prompt does not hold the others",
    )
    accuracy_threshold: float = Field(
        0.8, ge=0, le=1, description="below this share of predictions within one block, fall back to prefix_affinity"
    )
    accuracy_window: int = Field(200, ge=10, description="recent checked requests the share is taken over")
    accuracy_min_samples: int = Field(20, ge=1, description="checked requests needed before the share counts")


class ModelRouting(_Strict):
    """How the workers of one model are chosen, and where its traffic may go instead."""

    policy: PolicyName = Field("least_outstanding", description="how a worker of the model is chosen")
    prefix_chars: int = Field(
        1024, ge=16, le=1 << 20, description="prefix_affinity: how much of the prompt start identifies a prefix"
    )
    load_factor: float = Field(
        1.25, ge=1.0, le=10.0, description="bounded loads: a worker takes at most this times the mean in-flight"
    )
    load_slack: int = Field(
        4,
        ge=0,
        le=10_000,
        description="bounded loads: a worker is over its bound only when it is also this many requests over "
        "the mean in-flight (a few extra requests batch on a vLLM worker; a spilled prefix misses its cache)",
    )
    precise: PreciseConfig = Field(default_factory=PreciseConfig, description="precise_prefix: how to predict")
    session_header: str = Field("x-session-id", min_length=1, description="session_affinity: the header to hash")
    targets: dict[str, float] = Field(
        default_factory=dict,
        description="canary: model name -> weight (e.g. {a: 90, b: 10}); empty means this model alone",
    )
    fallbacks: list[str] = Field(
        default_factory=list,
        description="models tried in order when this one has no healthy worker or fails before the first byte",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="the model's in-flight limit and queue"
    )

    @field_validator("targets")
    @classmethod
    def _weights(cls, targets: dict[str, float]) -> dict[str, float]:
        if any(w < 0 for w in targets.values()):
            raise ValueError("target weights must be >= 0")
        if targets and sum(targets.values()) <= 0:
            raise ValueError("at least one target needs a weight > 0")
        return targets

    @field_validator("session_header")
    @classmethod
    def _lower(cls, name: str) -> str:
        return name.lower()


class RetryBudgetConfig(_Strict):
    """Retries may add at most ``ratio`` x recent requests (plus ``min_per_s``), so in an outage they
    cannot multiply the load on the workers that are left."""

    ratio: float = Field(0.2, ge=0.0, le=10.0, description="retries allowed per request seen in the window")
    min_per_s: float = Field(5.0, ge=0.0, description="retries allowed per second of the window regardless")
    window_s: float = Field(10.0, gt=0, description="the window over which requests are counted")


class DiscoveryConfig(_Strict):
    """``dns://name:port`` worker refs (e.g. a Kubernetes headless Service) are re-resolved this often."""

    dns_interval_s: float = Field(10.0, gt=0, description="how often dns:// workers are re-resolved")
    dns_timeout_s: float = Field(2.0, gt=0, description="time budget of one resolution")


class LoadMetricsConfig(_Strict):
    """Optionally scrape each worker's /metrics in the background and weigh its own queue and KV cache
    use into least_outstanding (score = in_flight + waiting_weight*waiting + kv_weight*kv_usage)."""

    enabled: bool = Field(False, description="scrape the workers' /metrics")
    interval_s: float = Field(2.0, gt=0, description="how often each worker is scraped")
    timeout_s: float = Field(1.0, gt=0, description="time budget of one scrape")
    waiting_weight: float = Field(1.0, ge=0, description="weight of the worker's waiting requests in the score")
    kv_weight: float = Field(4.0, ge=0, description="weight of the worker's KV cache use (0..1) in the score")
    max_age_s: float = Field(10.0, gt=0, description="older samples are ignored")


class KvSourceConfig(_Strict):
    """A worker's KV event publisher, when its ``/kv_event_sources`` route cannot say (e.g. behind a NAT)."""

    endpoint: str = Field(min_length=6, description="its PUB socket, e.g. tcp://10.0.0.5:5557 (it binds)")
    replay_endpoint: str | None = Field(None, description="its replay (ROUTER) socket")
    topic: str = Field("", description="the topic it publishes on")


class KvEventsConfig(_Strict):
    """precise_prefix's feed: the KV cache events and load of every worker of a precise model."""

    max_entries: int = Field(
        1_000_000, ge=1, description="index bound: (worker, block) entries, at most 320 bytes each; LRU beyond"
    )
    expire_s: float = Field(
        60.0, gt=0, description="a worker silent this long after requests that store blocks loses its entries"
    )
    replay_timeout_s: float = Field(2.0, gt=0, description="time budget of one replay from a worker's buffer")
    max_message_bytes: int = Field(
        16 << 20,
        ge=4096,
        le=256 << 20,
        description="an event batch larger than this, or of more elements (hashes, token ids) than one per 8 of "
        "its bytes, is not decoded (about 0.1 s of the event loop per MiB) but taken as a clear of its worker's "
        "entries; a frame over four times it drops the connection",
    )
    sources: dict[str, KvSourceConfig] = Field(
        default_factory=dict, description="worker URL -> its publisher (default: asked at GET /kv_event_sources)"
    )
    load_interval_s: float = Field(2.0, gt=0, description="how often each worker's /metrics load is polled")
    load_timeout_s: float = Field(1.0, gt=0, description="time budget of one poll")


class AdaptersConfig(_Strict):
    """LoRA adapters (models' ``adapters:``): how a request for one is placed, how often each worker's
    adapters are read back from it (``GET /v1/models``), and how many loads one tenant may cause."""

    affinity_weight: float = Field(
        100.0, ge=0, description="score of a worker that holds the adapter and is not overloaded"
    )
    free_slot_weight: float = Field(
        0.5, ge=0, description="score of a worker with a free adapter slot (loading there evicts nothing)"
    )
    load_weight: float = Field(1.0, ge=0, description="score taken off per request in flight at the worker")
    sync_interval_s: float = Field(5.0, gt=0, description="how often each worker's adapters are read back")
    sync_timeout_s: float = Field(2.0, gt=0, description="time budget of one read")
    load_timeout_s: float = Field(60.0, gt=0, description="time budget of one load on a worker")
    tenant_loads_per_minute: int | None = Field(
        60,
        ge=0,
        le=1_000_000,
        description="adapter loads this gateway process starts for one tenant a minute (a token bucket in memory);"
        " past it a request goes to a worker holding its adapter, else a 429 (null or 0: no bound)",
    )


class RoutingConfig(_Strict):
    default: ModelRouting = Field(default_factory=ModelRouting, description="for models not listed in `models`")
    models: dict[str, ModelRouting] = Field(default_factory=dict, description="per model name")
    max_attempts: int = Field(3, ge=1, le=10, description="tries per request, each on a different worker")
    retry_budget: RetryBudgetConfig = Field(
        default_factory=RetryBudgetConfig, description="how many retries an outage may add"
    )
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig, description="re-resolution of dns:// workers")
    load_metrics: LoadMetricsConfig = Field(
        default_factory=LoadMetricsConfig, description="optional: weigh the workers' own queue and KV cache use"
    )
    kv_events: KvEventsConfig = Field(
        default_factory=KvEventsConfig, description="precise_prefix: the workers' KV cache events and load"
    )

    adapters: AdaptersConfig = Field(
        default_factory=AdaptersConfig, description="placement and loading of LoRA adapters"
    )

    def for_model(self, name: str) -> ModelRouting:
        return self.models.get(name, self.default)
