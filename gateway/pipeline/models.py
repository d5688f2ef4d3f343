"""The model table of one config: the names and aliases clients use, and each model's worker URLs."""

from __future__ import annotations

from gateway.pipeline.config import GatewayConfig, ModelConfig, is_url


class ModelTable:
    """Client-facing model names and aliases -> model entries and their worker URLs."""

    def __init__(self, config: GatewayConfig) -> None:
        managed = {w.name: w.url for w in config.engine.workers}
        self.models: list[ModelConfig] = list(config.models)
        self._by_name: dict[str, ModelConfig] = {}
        self.worker_urls: dict[str, list[str]] = {}
        for model in config.models:
            for name in (model.name, *model.aliases):
                self._by_name[name] = model
            self.worker_urls[model.name] = [ref if is_url(ref) else managed[ref] for ref in model.workers]

    def resolve(self, name: str) -> ModelConfig | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def all_worker_urls(self) -> list[str]:
        return [url for urls in self.worker_urls.values() for url in urls if not url.startswith("dns://")]
