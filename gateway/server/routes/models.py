"""GET /v1/models and /v1/models/{id}: every name and alias a client may use, from the live config.

Each request is metered like an inference request (the plugins' ``on_side_request``: tenancy counts it
against the key's request limits) before the plugins' ``on_models`` decide what this caller may see."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.pipeline.config import AdapterModel, ModelConfig
from gateway.pipeline.plugin import SideCall
from gateway.server.routes import JSON
from gateway.server.state import AppState
from gateway.wire.errors import model_not_found
from gateway.wire.protocol import header_dict

router = APIRouter()


def model_card(name: str, model: ModelConfig, created: int) -> dict[str, Any]:
    """The card of ``name`` (the model's own name or an alias). ``root`` names the model it points to,
    as vLLM's cards do; an alias also keeps ``parent``. A LoRA adapter's cards name the base model in
    ``parent``, as a vLLM worker's card of an adapter does. Plugins match a key's allowed models on ``id``
    and ``root``."""
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": model.owned_by,
        "root": model.name,
    }
    if isinstance(model, AdapterModel):
        card["parent"] = model.base
    elif name != model.name:
        card["parent"] = model.name
    if model.max_model_len:
        card["max_model_len"] = model.max_model_len
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> JSON:
    state: AppState = request.app.state.gateway
    headers = header_dict(request.scope["headers"])
    with state.holder.pin() as snapshot:
        await snapshot.pipeline.run_side(SideCall("models", headers))
        created = int(snapshot.loaded_at)
        cards = [model_card(name, m, created) for m in snapshot.config.served_models for name in (m.name, *m.aliases)]
        # Plugins decide what this caller may see (tenancy: the models its key may use).
        data = await snapshot.pipeline.run_models(headers, cards)
    return JSON({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> JSON:
    state: AppState = request.app.state.gateway
    headers = header_dict(request.scope["headers"])
    with state.holder.pin() as snapshot:
        await snapshot.pipeline.run_side(SideCall("model", headers))
        model = snapshot.models.resolve(model_id)
        if model is None:
            await snapshot.pipeline.run_models(headers, [])  # caller first
            raise model_not_found(model_id)
        card = model_card(model_id, model, int(snapshot.loaded_at))
        visible = await snapshot.pipeline.run_models(headers, [card])
    if not visible:
        raise model_not_found(model_id)
    return JSON(visible[0])
