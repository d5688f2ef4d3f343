"""The reloadable configuration (``config.yaml``): pydantic models, loading and readable errors.

A config is validated whole before it can go live. Errors name the field path (``models[0].workers``)
and the reason. Plugin sections are validated later against each plugin's own ``Config`` model, when
the runtime is prepared (``gateway.pipeline.runtime``), with the same error format.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Literal

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.engine.spec import ManagedWorkerSpec, merged_lora
from gateway.ops.logs import LoggingConfig
from gateway.pipeline.adapters import AdapterConfig, LoraSettings
from gateway.pipeline.batch_config import BatchesConfig
from gateway.upstream.client import UpstreamConfig


class ConfigError(ValueError):
    """A config that cannot go live. ``str()`` is one readable line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(StrictModel):
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="largest request body; a larger one is a 413, refused before it is read"
    )
    max_n: int = Field(128, ge=1, description="largest 'n' (choices per request) a client may ask for, as OpenAI")
    extra_params: list[str] = Field(
        default_factory=list,
        description="request fields to pass through beside the built-in allow-list (gateway.wire.allowlist)",
    )


class ResponsesConfig(StrictModel):
    """The Responses API's stored responses (``store: true``, the default), kept in Redis."""

    ttl_s: int = Field(
        7 * 86400,
        ge=60,
        le=366 * 86400,
        description="how long a stored response can be retrieved or continued (previous_response_id), in seconds",
    )
    redis_prefix: str = Field(
        "gw:responses", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$", description="Redis key prefix"
    )
    redis_timeout_ms: float = Field(500, gt=0, le=10_000, description="bound on each Redis call of the store")
    # What one tenant can make the store keep (a turn over a bound is refused, never truncated): see
    # docs/responses.md#bounds.
    max_response_bytes: int = Field(
        512 * 1024, ge=1024, description="largest stored record of one response (its own input and output); 413"
    )
    max_tenant_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="stored bytes one tenant may hold at once (all its responses); 429"
    )
    max_conversation_turns: int = Field(
        256, ge=1, le=10_000, description="longest previous_response_id chain a turn may continue; 400"
    )
    max_conversation_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="stored bytes of a whole chain a turn may continue; 400"
    )


class CorsConfig(StrictModel):
    """Calls from web pages of other origins (CORS), answered by ``gateway.server.cors``; off while
    ``allow_origins`` is empty."""

    allow_origins: list[str] = Field(
        default_factory=list,
        description="origins (scheme://host[:port]) whose pages may call the API; '*' for any; empty: CORS off",
    )
    allow_methods: list[str] = Field(
        default_factory=lambda: ["GET", "POST", "DELETE"], description="methods a cross-origin request may use"
    )
    allow_headers: list[str] = Field(
        default_factory=lambda: ["authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta",
                                 "anthropic-dangerous-direct-browser-access", "x-request-id", "x-stainless-*"],
        description="request headers a cross-origin request may send (a trailing '*' matches a prefix)",
    )  # fmt: skip
    expose_headers: list[str] = Field(
        default_factory=lambda: ["x-request-id", "retry-after"], description="response headers a page may read"
    )
    max_age_s: int = Field(600, ge=0, le=86400, description="how long a browser may keep a preflight's answer")

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            scheme, sep, rest = origin.partition("://")
            if origin != "*" and (scheme not in ("http", "https") or not sep or not rest or "/" in rest):
                raise ValueError(f"'{origin}' is not an origin: write scheme://host[:port] (no path) or '*'")
        return [o.lower() for o in origins]


class ModelConfig(StrictModel):
    """A model clients may name, and the workers that serve it.

    ``workers`` holds URLs of vLLM OpenAI servers (``http://host:port``) or names of managed workers
    declared under ``engine.workers``.
    """

    name: str = Field(min_length=1, description='what clients put in "model"')
    aliases: list[str] = Field(default_factory=list, description="other names clients may use for this model")
    served_name: str | None = Field(None, description="the name the workers know (default: name)")
    workers: list[str] = Field(
        min_length=1,
        description="worker URLs (http://host:port, dns://name:port for a headless Service) or names of "
        "managed workers under engine.workers",
    )
    owned_by: str = Field("vllm-gateway", description="owned_by on the model's cards in GET /v1/models")
    max_model_len: int | None = Field(
        None, ge=1, description="the context window: shown on the model card; bounds guided_json's retry budget"
    )
    adapters: list[AdapterConfig] = Field(
        default_factory=list, description="LoRA adapters of this base model, loaded on its workers on demand"
    )
    lora: LoraSettings | None = Field(
        None, description="adapter slots per worker and the largest rank (default when adapters are listed)"
    )

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name

    @property
    def lora_settings(self) -> LoraSettings | None:
        """The LoRA settings the model's workers run with: None when the model serves no adapter."""
        return self.lora or (LoraSettings() if self.adapters else None)


class AdapterModel(ModelConfig):
    """A LoRA adapter as a model of its own (what ``ctx.model`` is for a request naming it): the base
    model's workers and context, the adapter's names, and ``base`` naming the model it was trained on."""

    base: str
    adapter: AdapterConfig

    @classmethod
    def of(cls, base: ModelConfig, adapter: AdapterConfig) -> AdapterModel:
        return cls(
            name=adapter.name,
            aliases=adapter.aliases,
            served_name=adapter.upstream_name,
            workers=base.workers,
            owned_by=base.owned_by,
            max_model_len=base.max_model_len,
            base=base.name,
            adapter=adapter,
        )


class PluginEntry(StrictModel):
    """One enabled plugin. Order in the list is the order of ``on_request`` hooks."""

    name: str = Field(min_length=1, description="the plugin's entry-point name (gateway.plugins)")
    enabled: bool = Field(True, description="false: listed but off; its section is not validated")
    on_error: Literal["fail_closed", "fail_open"] | None = Field(
        None, description="what a hook failure does (default: the plugin's own choice)"
    )
    timeout_ms: float | None = Field(None, gt=0, description="time budget per hook call")
    config: dict[str, Any] = Field(
        default_factory=dict, description="the plugin's own section, checked against its Config"
    )


class EngineConfig(StrictModel):
    workers: list[ManagedWorkerSpec] = Field(
        default_factory=list, description="vLLM workers the gateway starts (unless GATEWAY_MANAGED_WORKERS=false)"
    )
    ready_timeout_s: float = Field(600.0, gt=0, description="longest wait for a managed worker to become ready")

    @field_validator("workers")
    @classmethod
    def _unique(cls, workers: list[ManagedWorkerSpec]) -> list[ManagedWorkerSpec]:
        names = [w.name for w in workers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"managed worker names must be unique; repeated: {', '.join(dupes)}")
        ports = [w.port for w in workers]
        clash = sorted({p for p in ports if ports.count(p) > 1})
        if clash:
            raise ValueError(f"managed workers share a port: {', '.join(map(str, clash))}")
        return workers


class GatewayConfig(StrictModel):
    models: list[ModelConfig] = Field(min_length=1, description="the models clients may name, and their workers")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="managed vLLM workers")
    plugins: list[PluginEntry] = Field(default_factory=list, description="enabled plugins, in on_request order")
    upstream: UpstreamConfig = Field(
        default_factory=UpstreamConfig, description="waits and pool of the client to workers"
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="request limits of the core")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="log level and content")
    responses: ResponsesConfig = Field(
        default_factory=ResponsesConfig, description="the Responses API's store of responses (Redis, per tenant)"
    )
    cors: CorsConfig = Field(default_factory=CorsConfig, description="calls from web pages of other origins")

    @functools.cached_property
    def served_models(self) -> list[ModelConfig]:
        """Every model a client may name: the base models, then each one's adapters (``AdapterModel``),
        built once per config so that every plugin holds the same objects as the model table."""
        adapters = [AdapterModel.of(model, adapter) for model in self.models for adapter in model.adapters]
        return [*self.models, *adapters]

    def managed_workers(self) -> list[ManagedWorkerSpec]:
        """``engine.workers`` as they are launched: a worker of a model that serves adapters runs with
        LoRA enabled (the model's ``lora`` settings), unless its own ``lora`` says otherwise."""
        wanted = self._lora_wanted()
        out = []
        for spec in self.engine.workers:
            lora = spec.lora or merged_lora(wanted.get(spec.name, []))
            out.append(spec if lora is spec.lora else spec.model_copy(update={"lora": lora}))
        return out

    def worker_lora(self) -> dict[str, LoraSettings]:
        """The LoRA settings each worker of a model with adapters runs with, by its ref in ``models[].workers``:
        a managed worker's as it is launched, an external one's the largest each of its models asks for (as a
        managed one shared by several models; docs/adapters.md). Every model on a worker shares its slots."""
        launched = {spec.name: spec.lora for spec in self.managed_workers()}
        out = {}
        for ref, settings in self._lora_wanted().items():
            lora = launched.get(ref) or merged_lora(settings)
            if lora is not None:
                out[ref] = lora
        return out

    def _lora_wanted(self) -> dict[str, list[LoraSettings]]:
        """Worker ref -> the LoRA settings of each model with adapters that lists it."""
        wanted: dict[str, list[LoraSettings]] = {}
        for model in self.models:
            settings = model.lora_settings
            if settings is not None:
                for ref in model.workers:
                    wanted.setdefault(ref, []).append(settings)
        return wanted

    batches: BatchesConfig = Field(
        default_factory=BatchesConfig, description="the Files and Batch APIs, run on idle capacity (gateway.batch)"
    )

    @model_validator(mode="after")
    def _check_references(self) -> GatewayConfig:
        seen: dict[str, str] = {}
        lora_names: dict[str, AdapterModel] = {}  # served name -> the first adapter served under it
        for model in self.served_models:
            for name in (model.name, *model.aliases):
                if name in seen:
                    raise ValueError(f"model name or alias '{name}' is used twice ({seen[name]}, {model.name})")
                seen[name] = model.name
            if isinstance(model, AdapterModel) and model.upstream_name in {m.upstream_name for m in self.models}:
                raise ValueError(f"adapter '{model.name}' is served under a base model's name ({model.upstream_name})")
            if isinstance(model, AdapterModel):
                # Workers know an adapter by this name alone: a second path under it would be served the
                # first one's weights wherever the first was loaded.
                first = lora_names.setdefault(model.upstream_name, model)
                if first.adapter.path != model.adapter.path:
                    raise ValueError(
                        f"adapters '{first.name}' and '{model.name}' are both served as '{model.upstream_name}'"
                        " (lora_name) from different paths: give one a served_name of its own"
                    )
        managed = {w.name for w in self.engine.workers}
        for model in self.models:
            for ref in model.workers:
                if not is_url(ref) and ref not in managed:
                    raise ValueError(
                        f"model '{model.name}': worker '{ref}' is neither a URL (http://host:port, dns://name:port)"
                        f" nor a managed worker under engine.workers ({', '.join(sorted(managed)) or 'none'})"
                    )
        plugin_names = [p.name for p in self.plugins if p.enabled]
        dupes = sorted({n for n in plugin_names if plugin_names.count(n) > 1})
        if dupes:
            raise ValueError(f"plugin listed twice: {', '.join(dupes)}")
        return self


def is_url(ref: str) -> bool:
    return ref.startswith(("http://", "https://", "dns://"))


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def format_validation_error(exc: ValidationError, prefix: str = "") -> list[str]:
    problems = []
    for err in exc.errors():
        where = _loc(tuple(err["loc"]))
        if prefix:
            where = f"{prefix}.{where}" if where else prefix
        msg = err["msg"].removeprefix("Value error, ")
        problems.append(f"{where or '(top level)'}: {msg}")
    return problems


def parse_config(text: str | bytes, source: str = "config") -> GatewayConfig:
    """Parse YAML (or JSON, a subset) text into a validated config, or raise ConfigError."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{source}: not valid YAML{where}: {problem}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping (models:, plugins:, ...)"])
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(path: Path) -> GatewayConfig:
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the config file: {exc.strerror or exc}"]) from None
    return parse_config(text, source=str(path))


def config_version(config: GatewayConfig) -> str:
    """A content hash of the validated config: comments and key order do not change it."""
    canonical = orjson.dumps(config.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()[:16]
