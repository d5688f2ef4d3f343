"""Which top-level request fields a client may send through the gateway, per endpoint.

vLLM's OpenAI server accepts, beside OpenAI's fields, options meant for the operator or for other
parts of a deployment: ``kv_transfer_params`` (where disaggregated serving fetches KV blocks from),
``vllm_xargs`` (custom extension arguments), ``mm_processor_kwargs`` / ``media_io_kwargs`` (keyword
arguments into the HF processor and media loaders), ``chat_template`` (a client-written Jinja
template), ``prompt_embeds`` (tensors deserialised by the engine), ``priority`` (queue-jumping under
priority scheduling), ``request_id`` (the engine's internal id). A client must not pick those.

So the gateway passes through an allow-list, not a deny-list: OpenAI's documented fields, vLLM's
documented sampling and output extras that only shape the client's own answer, and the legacy
guided-decoding fields the guided_json plugin translates. Anything else is refused with 400 naming
the field (``code: unsupported_parameter``), like OpenAI's "Unrecognized request argument". Refusing
rather than dropping: a silently ignored option (``priority``, say) would make the client believe it
took effect. An operator who runs an extension adds its fields under ``limits.extra_params``.

The check is a frozenset lookup per top-level key (plus one nested look into
``chat_template_kwargs``), done once per request before any plugin runs.

Classification of vLLM 0.32's ``ChatCompletionRequest`` / ``CompletionRequest`` / embedding request
fields that are not OpenAI's (allowed unless listed under "refused"):

- sampling: top_k, min_p, repetition_penalty, length_penalty, use_beam_search, stop_token_ids,
  include_stop_str_in_output, ignore_eos, min_tokens, allowed_token_ids, bad_words, watermarking,
  repetition_detection, thinking_token_budget, include_reasoning, structured_outputs;
- output shape: skip_special_tokens, spaces_between_special_tokens, prompt_logprobs,
  logprob_token_ids, return_tokens_as_token_ids, return_token_ids, echo, stream_interval;
- prompt shape: truncate_prompt_tokens, truncation_side, add_generation_prompt,
  continue_final_message, add_special_tokens, documents, chat_template_kwargs (but not its
  ``chat_template`` key, which would swap the template), cache_salt (it can only narrow prefix-cache
  sharing, never widen it); embeddings: encoding_format, dimensions, embed_dtype, endianness,
  use_activation, padding;
- refused: kv_transfer_params, ec_transfer_params, vllm_xargs, mm_processor_kwargs, media_io_kwargs,
  chat_template, prompt_embeds, priority, request_id, session_id, return_prompt_text (shows the
  templated prompt, including anything a plugin inserted), return_token_offsets / mm_payload /
  return_mm_kwargs (render endpoints only), routed_experts_prompt_start (MoE debugging).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.wire.errors import InvalidRequest

_OPENAI_SAMPLING = frozenset(
    {
        "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
        "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user",
    }
)  # fmt: skip
_OPENAI_CHAT = frozenset(
    {
        "messages", "audio", "function_call", "functions", "max_completion_tokens", "metadata",
        "modalities", "moderation", "parallel_tool_calls", "prediction", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
        "response_format", "safety_identifier", "service_tier", "store", "tool_choice", "tools",
        "top_logprobs", "verbosity", "web_search_options",
    }
)  # fmt: skip
_OPENAI_COMPLETIONS = frozenset({"prompt", "echo", "best_of", "suffix"})
_OPENAI_EMBEDDINGS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})

_VLLM_SAMPLING = frozenset(
    {
        "top_k", "min_p", "repetition_penalty", "length_penalty", "use_beam_search", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "allowed_token_ids", "bad_words",
        "watermarking", "repetition_detection", "thinking_token_budget", "structured_outputs",
        "skip_special_tokens", "spaces_between_special_tokens", "prompt_logprobs", "logprob_token_ids",
        "return_tokens_as_token_ids", "return_token_ids", "stream_interval", "truncate_prompt_tokens",
        "truncation_side", "add_special_tokens", "cache_salt", "response_format",
    }
)  # fmt: skip
_VLLM_CHAT = frozenset(
    {
        "include_reasoning",
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "chat_template_kwargs",
    }
)
_VLLM_EMBEDDINGS = frozenset(
    {
        "add_special_tokens", "padding", "embed_dtype", "endianness", "use_activation", "truncate_prompt_tokens",
        "truncation_side", "cache_salt", "messages", "add_generation_prompt", "continue_final_message",
        "chat_template_kwargs",
    }
)  # fmt: skip
#: Read and rewritten by the guided_json plugin; vLLM 0.32 itself ignores them.
_GUIDED_LEGACY = frozenset(
    {
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    }
)

#: vLLM's utility routes (``gateway.server.routes.utility``). Refused there as on chat: ``chat_template`` (a
#: client-written template), ``mm_processor_kwargs`` and ``media_io_kwargs``.
_VLLM_TOKENIZE = frozenset(
    {
        "model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt",
        "continue_final_message", "chat_template_kwargs", "return_token_strs",
    }
)  # fmt: skip
_VLLM_DETOKENIZE = frozenset({"model", "tokens"})

#: vLLM's pooling routes (``gateway.wire.protocol.MODEL_ROUTES``): the request fields of vLLM 0.32's rerank,
#: score, classification and pooling requests, less those refused everywhere (priority, request_id,
#: mm_processor_kwargs, media_io_kwargs, chat_template).
_VLLM_POOLING_BASE = frozenset(
    {"model", "user", "cache_salt", "padding", "truncate_prompt_tokens", "truncation_side", "use_activation"}
)
_VLLM_SCORING = _VLLM_POOLING_BASE | {
    "chat_template_kwargs", "instruction", "max_tokens_per_doc", "max_tokens_per_query",
}  # fmt: skip
_VLLM_POOLING_INPUT = _VLLM_POOLING_BASE | {
    "input", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs",
}  # fmt: skip
_VLLM_RERANK = _VLLM_SCORING | {"query", "documents", "top_n"}
_VLLM_SCORE = _VLLM_SCORING | {"text_1", "text_2", "queries", "documents", "items", "data_1", "data_2"}
_VLLM_CLASSIFY = _VLLM_POOLING_INPUT
_VLLM_POOLING = _VLLM_POOLING_INPUT | {"task", "data", "dimensions", "encoding_format", "embed_dtype", "endianness"}
#: vLLM 0.32's transcription and translation form fields, less ``vllm_xargs`` (the array field is sent as
#: ``timestamp_granularities[]`` by OpenAI's SDK).
_VLLM_AUDIO = frozenset(
    {
        "file", "model", "language", "to_language", "prompt", "response_format", "temperature", "stream",
        "timestamp_granularities", "timestamp_granularities[]", "hotwords", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "length_penalty", "min_p", "top_k", "top_p", "seed", "max_completion_tokens",
        "use_beam_search", "include_stop_str_in_output", "watermarking",
    }
)  # fmt: skip
_PATHS = {  # not under /v1, as on vLLM
    "tokenize": "/tokenize", "detokenize": "/detokenize", "classify": "/classify", "pooling": "/pooling",
    "v2/rerank": "/v2/rerank",
}  # fmt: skip

#: OpenAI's routing hint on chat and Responses (requests with the same key share their cache lineage; the
#: routing plugin places by it), accepted on completions too: multi-turn clients of vLLM's completions API
#: have conversations as well. vLLM ignores it.
_ROUTING_HINTS = frozenset({"prompt_cache_key"})

ALLOWED: dict[str, frozenset[str]] = {
    "chat/completions": _OPENAI_SAMPLING | _OPENAI_CHAT | _VLLM_SAMPLING | _VLLM_CHAT | _GUIDED_LEGACY,
    "completions": _OPENAI_SAMPLING | _OPENAI_COMPLETIONS | _VLLM_SAMPLING | _GUIDED_LEGACY | _ROUTING_HINTS,
    "embeddings": _OPENAI_EMBEDDINGS | _VLLM_EMBEDDINGS,
    "tokenize": _VLLM_TOKENIZE,
    "detokenize": _VLLM_DETOKENIZE,
    "rerank": _VLLM_RERANK,
    "v2/rerank": _VLLM_RERANK,
    "score": _VLLM_SCORE,
    "classify": _VLLM_CLASSIFY,
    "pooling": _VLLM_POOLING,
    "audio/transcriptions": _VLLM_AUDIO,
    "audio/translations": _VLLM_AUDIO,
}

#: Endpoints whose requests carry a ``cache_salt`` to vLLM, which hashes it into the prompt's first KV block.
SALTED = frozenset(endpoint for endpoint, names in ALLOWED.items() if "cache_salt" in names)


class ParamAllowList:
    """The allow-list of one config snapshot: the built-in sets plus ``limits.extra_params``."""

    __slots__ = ("_allowed", "max_n")

    def __init__(self, extra: Iterable[str] = (), *, max_n: int = 128) -> None:
        extra = frozenset(extra)
        self._allowed = {endpoint: names | extra for endpoint, names in ALLOWED.items()}
        self.max_n = max_n

    def check(self, endpoint: str, body: dict[str, Any]) -> None:
        """Raise a 400 naming the first field a client may not send on ``endpoint``."""
        allowed = self._allowed[endpoint]
        for name in body:
            if name not in allowed:
                raise InvalidRequest(
                    f"Unrecognized request argument supplied: {name}. This gateway does not pass it to the"
                    f" model worker on {_PATHS.get(endpoint, '/v1/' + endpoint)}; remove it.",
                    param=name,
                    code="unsupported_parameter",
                )
        n = body.get("n")
        if isinstance(n, int) and n > self.max_n:
            # Each choice is a sequence in the engine's batch: an unbounded n is an unbounded request.
            raise InvalidRequest(
                f"'n' must be at most {self.max_n} (got {n}).", param="n", code="integer_above_max_value"
            )
        key = body.get("prompt_cache_key")
        if key is not None and not isinstance(key, str):  # routing reads only strings; OpenAI refuses the rest
            raise InvalidRequest(
                f"Invalid type for 'prompt_cache_key': expected a string, but got {type(key).__name__} instead.",
                param="prompt_cache_key",
                code="invalid_type",
            )
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and "chat_template" in kwargs and "chat_template" not in allowed:
            raise InvalidRequest(
                "chat_template_kwargs.chat_template is not accepted: the chat template is the operator's choice.",
                param="chat_template_kwargs.chat_template",
                code="unsupported_parameter",
            )
