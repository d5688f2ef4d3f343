"""LoRA adapters in ``config.yaml``: each listed under the base model it was trained on.

An adapter is served by the base model's workers (vLLM, ``--enable-lora``) and loaded on a worker at run
time when a request first needs it there (``POST /v1/load_lora_adapter``), so adding one is a config
reload, never a worker restart. To every plugin an adapter is a model of its own: the model table resolves
its name and aliases to an ``AdapterModel`` (``gateway.pipeline.config``), so allow-lists, budgets, cache
keys, safety rules and routing policies name adapters as they name models.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.engine.spec import LoraSettings

__all__ = ["AdapterConfig", "LoraSettings"]

_URI = re.compile(r"^[a-z][a-z0-9+.-]*://")


class AdapterConfig(BaseModel):
    """One fine-tune of a base model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256, description='what clients put in "model"')
    path: str = Field(
        min_length=1,
        description="where the workers read the adapter: an absolute path on every worker's disk, or a URI a "
        "worker's LoRA resolver understands; sent as lora_path to /v1/load_lora_adapter",
    )
    aliases: list[str] = Field(default_factory=list, description="other names clients may use for this adapter")
    served_name: str | None = Field(
        None, description="the lora_name the workers load it under (default: name); sent upstream as the model"
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        # A relative path that does not exist on the worker is taken for a hub id and fails offline.
        if not path.startswith("/") and not _URI.match(path):
            raise ValueError(f"adapter path '{path}' must be absolute (/...) or a URI (scheme://...)")
        return path

    @property
    def upstream_name(self) -> str:
        return self.served_name or self.name
