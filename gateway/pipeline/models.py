"""The model table of one config: the names and aliases clients use, each model's worker URLs, and the
graph of where a request for a model may be served (the moves plugins declare: canaries, fallbacks).

A LoRA adapter's name or alias resolves to its ``AdapterModel`` (the base model's workers, the adapter's
served name), so the rest of the gateway treats it as a model; ``models`` lists the base models only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from gateway.pipeline.config import AdapterModel, GatewayConfig, ModelConfig, is_url


class ModelTable:
    """Client-facing model names and aliases -> model entries and their worker URLs."""

    def __init__(self, config: GatewayConfig, moves: Iterable[Mapping[str, Collection[str]]] = ()) -> None:
        managed = {w.name: w.url for w in config.engine.workers}
        self.models: list[ModelConfig] = list(config.models)
        self._by_name: dict[str, ModelConfig] = {}
        self.worker_urls: dict[str, list[str]] = {}
        #: Every adapter (``AdapterModel``) by its own name.
        self.adapters: dict[str, AdapterModel] = {}
        for model in config.served_models:
            for name in (model.name, *model.aliases):
                self._by_name[name] = model
            self.worker_urls[model.name] = [ref if is_url(ref) else managed[ref] for ref in model.workers]
            if isinstance(model, AdapterModel):
                self.adapters[model.name] = model
        self._reachable = _closure([m.name for m in config.served_models], moves)

    def resolve(self, name: str) -> ModelConfig | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return list(self._by_name)

    def all_worker_urls(self) -> list[str]:
        urls = (url for model in self.models for url in self.worker_urls[model.name])
        return list(dict.fromkeys(url for url in urls if not url.startswith("dns://")))

    def reachable(self, name: str) -> frozenset[str]:
        """Model ``name`` and every model a request for it may end up served by (the plugins' declared
        moves, followed transitively)."""
        return self._reachable.get(name) or frozenset((name,))


def _closure(models: list[str], moves: Iterable[Mapping[str, Collection[str]]]) -> dict[str, frozenset[str]]:
    step: dict[str, set[str]] = {name: set() for name in models}
    for declared in moves:
        for name, targets in declared.items():
            step.setdefault(name, set()).update(targets)
    out: dict[str, frozenset[str]] = {}
    for name in models:
        seen, todo = {name}, [name]
        while todo:
            for nxt in step.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        out[name] = frozenset(seen)
    return out
