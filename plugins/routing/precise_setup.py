"""Setting up precise_prefix for a config: which tokenizer and chat template each precise model uses,
loading them (once per process, off the loop), and, once the config is live, telling the worker table's
feeds which workers to follow (their KV cache events and their load)."""

from __future__ import annotations

from pathlib import Path

from gateway.engine.launch import chat_template_path
from gateway.engine.model_prep import resolve_model_path
from gateway.engine.spec import ManagedWorkerSpec
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.services import Services
from gateway.upstream.kv_source import FeedSettings, KvSource
from plugins.routing.config import RoutingConfig
from plugins.routing.precise import PrecisePlacement
from plugins.routing.prompt_tokens import PromptTokenizer
from plugins.routing.telemetry import RoutingShared

#: model -> (tokenizer directory, chat template file or None)
TokenizerSources = dict[str, tuple[str, str | None]]


def precise_models(routing: RoutingConfig, config: GatewayConfig) -> list[str]:
    return [m.name for m in config.models if routing.for_model(m.name).policy == "precise_prefix"]


def tokenizer_sources(routing: RoutingConfig, config: GatewayConfig, model_dir: Path) -> TokenizerSources:
    """Each precise model's tokenizer and template: as configured, else its first managed worker's.
    Raises ``ValueError`` (the config is refused) when neither says."""
    managed: dict[str, ManagedWorkerSpec] = {w.name: w for w in config.engine.workers}
    out: TokenizerSources = {}
    for model in config.models:
        precise = routing.for_model(model.name).precise
        if routing.for_model(model.name).policy != "precise_prefix":
            continue
        spec = next((managed[ref] for ref in model.workers if ref in managed), None)
        path = precise.tokenizer
        if path is None and spec is not None:
            resolved = resolve_model_path(spec, model_dir)
            path = str(resolved) if isinstance(resolved, Path) else None
        if path is None:
            raise ValueError(
                f"routing: model '{model.name}' uses precise_prefix but no tokenizer is known; set "
                f"routing.models.{model.name}.precise.tokenizer to the model's Hugging Face directory"
            )
        template = precise.chat_template
        if template is None and spec is not None and spec.chat_template is not None:
            template = chat_template_path(spec.chat_template)
        out[model.name] = (path, template)
    return out


async def build_placements(
    sources: TokenizerSources, routing: RoutingConfig, services: Services, shared: RoutingShared
) -> dict[str, PrecisePlacement]:
    placements: dict[str, PrecisePlacement] = {}
    for model, key in sources.items():
        tokenizer = shared.tokenizers.get(key)
        if tokenizer is None:
            tokenizer = shared.tokenizers[key] = await PromptTokenizer.load(*key)
        placements[model] = PrecisePlacement(model, routing.for_model(model), tokenizer, services.workers, shared)
    return placements


def follow_workers(urls: list[str], routing: RoutingConfig, config: GatewayConfig, services: Services) -> None:
    """Follow exactly ``urls`` (the precise models' workers): KV events and load. Changes what the live
    config's routing relies on, so only for the config that is live (no waiting: ``KvFeed.retarget``)."""
    managed = {w.name: w.url for w in config.engine.workers}
    settings = routing.kv_events
    sources = {
        managed.get(ref, ref): KvSource(s.endpoint, s.replay_endpoint, s.topic) for ref, s in settings.sources.items()
    }
    upstream = services.upstream
    services.workers.kv.retarget(
        urls,
        sources,
        upstream.get,
        FeedSettings(
            max_entries=settings.max_entries,
            expire_s=settings.expire_s,
            replay_timeout_s=settings.replay_timeout_s,
            max_message_bytes=settings.max_message_bytes,
        ),
    )
    if urls or "load" in services.workers.__dict__:
        services.workers.load.follow(
            urls, upstream.get, interval_s=settings.load_interval_s, timeout_s=settings.load_timeout_s
        )
