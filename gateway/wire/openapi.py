"""Request models of the inference endpoints, for the OpenAPI schema only.

The inference endpoints are served at the ASGI level (``gateway.server.routes.openai``), which parses each
body once with orjson and checks only what it needs (``gateway.wire.protocol``, ``gateway.wire.allowlist``);
these pydantic models never parse a request. They exist so ``/openapi.json`` documents the bodies
clients send (fields in the order of OpenAI's API reference, with OpenAI's documented bounds) and so
a schema fuzzer generates meaningful requests. The request bodies document the fields most clients
use and say ``additionalProperties: false``: the gateway refuses a field that is not on its allow-list
(``gateway.wire.allowlist``, which also admits the rest of OpenAI's fields and vLLM's sampling extras).
Nested objects (messages, parts) tolerate unknown fields, as the hot path does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.wire.errors import ServerError

_Texts = Annotated[list[str], Field(min_length=1)]
_Tokens = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
_TokenLists = Annotated[list[_Tokens], Field(min_length=1)]
_Prompt = str | _Texts | _Tokens | _TokenLists


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, ...")
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error a client sees, whatever the status."""

    error: ErrorDetail


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImageURL(_Open):
    url: str = Field(
        pattern=r"^(https?|data):",
        description="a public http(s) URL or a data: URL; URLs that point inside the network are refused",
    )
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Open):
    include_usage: bool | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"description": "Other accepted fields: see gateway/wire/allowlist.py, limits.extra_params."},
    )

    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    user: str | None = None
    # vLLM's sampling extras (a few of those allowed)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    structured_outputs: dict[str, Any] | None = Field(None, description='{"json" | "regex" | "choice" | ...: ...}')


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {...}}'
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    prompt: _Prompt = Field(description="text, texts, or token ids")
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    input: _Prompt
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's utility route, answered by a worker of the model): ``prompt`` or ``messages``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's utility route, answered by a worker of the model)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    tokens: _Tokens


class RerankRequest(BaseModel):
    """vLLM's rerank (``/v1/rerank``, ``/rerank``, ``/v2/rerank``), answered by a worker of the model."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    query: str
    documents: _Texts
    top_n: int | None = Field(None, ge=0)


class ScoreRequest(BaseModel):
    """vLLM's score (``/v1/score``, ``/score``); also ``queries`` with ``documents`` or ``items``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    text_1: str | _Texts
    text_2: str | _Texts


class PoolingInputRequest(BaseModel):
    """vLLM's ``/classify`` and ``/pooling``: ``input`` (or ``messages``), answered by a worker of the model."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="a name or alias from GET /v1/models")
    input: str | _Texts


def documented_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its body itself: the body's schema, inlined."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    if defs:  # nested models are inlined: the route's schema must stand alone
        schema = _inline(schema, defs)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return _inline(defs[ref.rsplit("/", 1)[1]], defs)
        return {key: _inline(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    return node


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/rerank": RerankRequest,
    "/rerank": RerankRequest,
    "/v2/rerank": RerankRequest,
    "/v1/score": ScoreRequest,
    "/score": ScoreRequest,
    "/classify": PoolingInputRequest,
    "/pooling": PoolingInputRequest,
}

#: Statuses the inference endpoints may answer with an error body, for the schema's ``responses``.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "malformed JSON, a bad field, or a parameter that is not allowed (param names it)"),
        (401, "missing or unknown API key (tenancy)"),
        (403, "a refusal by policy"),
        (404, "unknown model"),
        (413, "body larger than limits.max_body_bytes"),
        (429, "rate limit or budget"),
        (502, "the worker failed"),
        (503, "no healthy worker"),
        (504, "the worker was too slow"),
    )
}


def placeholder_for(path: str) -> Any:
    """A FastAPI endpoint whose signature documents the body of ``path``. It is never called: POSTs
    to inference paths are answered by the ASGI handler before FastAPI sees them."""
    model = REQUEST_MODELS[path]

    async def served_by_asgi(body: Any) -> None:
        raise ServerError("This route is served by the inference handler.")

    # Set after definition: with postponed annotations a local class cannot be named in the signature.
    served_by_asgi.__annotations__ = {"body": model, "return": None}
    served_by_asgi.__name__ = "create_" + path.removeprefix("/v1/").strip("/").replace("/", "_")
    return served_by_asgi


#: The body ``POST /v1/responses`` documents (for /openapi.json and the schema fuzzer; never used to parse).
RESPONSES_CREATE_DOC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["model", "input"],
                    "additionalProperties": False,
                    "properties": {
                        "model": {"type": "string", "minLength": 1},
                        "input": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "minItems": 1, "items": {"type": "object"}},
                            ]
                        },
                        "instructions": {"type": "string"},
                        "max_output_tokens": {"type": "integer", "minimum": 1},
                        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
                        "stream": {"type": "boolean"},
                        "store": {"type": "boolean"},
                        "previous_response_id": {"type": "string"},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        "tools": {"type": "array", "items": {"type": "object"}},
                        "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}]},
                        "parallel_tool_calls": {"type": "boolean"},
                        "text": {"type": "object"},
                        "user": {"type": "string"},
                    },
                }
            }
        },
    }
}
