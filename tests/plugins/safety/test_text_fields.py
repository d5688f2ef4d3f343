"""Every text field of vLLM's own request models is either scanned or listed as unscanned with a reason.

The models come from the installed vllm package, so a vLLM upgrade that adds a text field (to the
request, a message or a content part) fails here until ``plugins/safety/texts.py`` scans it or says
why not. A field listed as scanned is checked to really be scanned: a marker put there comes out of
``prompt_slots``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from plugins.safety.texts import (
    MEDIA_PART_KEYS,
    SCANNED,
    UNSCANNED,
    UNSCANNED_MESSAGE_FIELDS,
    completion_slots,
    prompt_slots,
)

vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
vllm_completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
vllm_embed = pytest.importorskip("vllm.entrypoints.pooling.embed.protocol")
chat_utils = pytest.importorskip("vllm.renderers.chat_utils")

MARK = "zq-marker-7731"

REQUEST_MODELS = {
    "chat/completions": [vllm_chat.ChatCompletionRequest],
    "completions": [vllm_completion.CompletionRequest],
    "embeddings": [
        vllm_embed.EmbeddingCompletionRequest,
        vllm_embed.EmbeddingChatRequest,
        vllm_embed.EmbeddingBatchChatRequest,
    ],
}


def carries_text(annotation: Any, seen: set[int] | None = None) -> bool:
    """Whether a value of this type can hold a string (str, Any, containers, models, TypedDicts)."""
    seen = set() if seen is None else seen
    if id(annotation) in seen:
        return False
    seen.add(id(annotation))
    if annotation is str or annotation is Any or annotation is object:
        return True
    origin = get_origin(annotation)
    if origin is typing.Literal:
        return False
    if origin is typing.Annotated:
        return carries_text(get_args(annotation)[0], seen)
    if origin is not None or isinstance(annotation, types.UnionType):
        return any(carries_text(arg, seen) for arg in get_args(annotation))
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return any(carries_text(t, seen) for t in typing.get_type_hints(annotation).values())
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return any(carries_text(f.annotation, seen) for f in annotation.model_fields.values())
    if typing.is_typeddict(annotation):
        return any(carries_text(t, seen) for t in typing.get_type_hints(annotation).values())
    return False


def union_members(alias: Any) -> list[Any]:
    out: list[Any] = []
    stack = [alias]
    while stack:
        node = stack.pop()
        if get_origin(node) in (Union, types.UnionType):
            stack.extend(get_args(node))
        else:
            out.append(node)
    return out


def fields_of(model: Any) -> dict[str, Any]:
    if isinstance(model, type) and issubclass(model, BaseModel):
        return {name: f.annotation for name, f in model.model_fields.items()}
    return dict(typing.get_type_hints(model))


@pytest.mark.parametrize("endpoint", list(REQUEST_MODELS))
def test_every_text_field_of_vllms_request_models_is_scanned_or_explained(endpoint: str) -> None:
    unlisted = sorted(
        f"{model.__name__}.{name}"
        for model in REQUEST_MODELS[endpoint]
        for name, annotation in fields_of(model).items()
        if carries_text(annotation) and name not in SCANNED[endpoint] and name not in UNSCANNED
    )
    assert not unlisted, f"text fields neither scanned nor listed in texts.UNSCANNED: {unlisted}"


def test_unscanned_reasons_are_given() -> None:
    assert all(reason.strip() for reason in UNSCANNED.values())
    assert not set(UNSCANNED) & set().union(*SCANNED.values())


#: A request that carries MARK in one scanned field: endpoint, field -> body.
SCANNED_SAMPLES: dict[tuple[str, str], dict[str, Any]] = {
    ("chat/completions", "messages"): {"messages": [{"role": "user", "content": MARK}]},
    ("chat/completions", "tools"): {
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {MARK: {}}}}}]
    },
    ("chat/completions", "functions"): {"functions": [{"name": "f", "description": MARK}]},
    ("chat/completions", "documents"): {"documents": [{"title": "t", "text": MARK}]},
    ("chat/completions", "chat_template_kwargs"): {"chat_template_kwargs": {"persona": {"bio": MARK}}},
    ("chat/completions", "prediction"): {
        "prediction": {"type": "content", "content": [{"type": "text", "text": MARK}]}
    },
    ("completions", "prompt"): {"prompt": ["a", MARK]},
    ("completions", "suffix"): {"prompt": "a", "suffix": MARK},
    ("embeddings", "input"): {"input": [[{"role": "user", "content": MARK}]]},
    ("embeddings", "messages"): {"input": "a", "messages": [{"role": "user", "content": [MARK]}]},
    ("embeddings", "chat_template_kwargs"): {"input": "a", "chat_template_kwargs": {"k": [MARK]}},
}


@pytest.mark.parametrize(("endpoint", "field"), sorted((e, f) for e, fs in SCANNED.items() for f in fs))
def test_a_field_listed_as_scanned_is_scanned(endpoint: str, field: str) -> None:
    body = SCANNED_SAMPLES[(endpoint, field)]
    assert MARK in [slot.text for slot in prompt_slots(endpoint, body)]


# -- messages and content parts -----------------------------------------------------------------------

#: Sample values for message keys whose value is not a plain string.
_MESSAGE_VALUES: dict[str, Any] = {
    "content": [{"type": "text", "text": MARK}],
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "' + MARK + '"}'}}],
    "function_call": {"name": "f", "arguments": MARK},
    "tools": [{"type": "function", "function": {"name": "f", "description": MARK}}],
    "author": {"role": "user", "name": MARK},
}


def _message_types() -> list[Any]:
    return union_members(chat_utils.ChatCompletionMessageParam)


@pytest.mark.parametrize("message_type", _message_types(), ids=lambda t: t.__name__)
def test_every_text_key_of_every_message_type_is_scanned_or_explained(message_type: Any) -> None:
    for key, annotation in fields_of(message_type).items():
        if not carries_text(annotation) or key in UNSCANNED_MESSAGE_FIELDS:
            continue
        value = _MESSAGE_VALUES.get(key, MARK)
        for endpoint, wrap in [
            ("chat/completions", lambda m: {"messages": [m]}),
            ("embeddings", lambda m: {"input": "x", "messages": [m]}),
        ]:
            message = {"role": "assistant", key: value} if key != "role" else {"role": value}
            texts = [slot.text for slot in prompt_slots(endpoint, wrap(message))]
            assert any(MARK in t for t in texts), f"{message_type.__name__}.{key} is not scanned on {endpoint}"


def _part_types() -> list[Any]:
    return [t for t in union_members(chat_utils.ChatCompletionContentPartParam) if t is not str]


@pytest.mark.parametrize("part_type", _part_types(), ids=lambda t: t.__name__)
def test_every_text_key_of_every_content_part_type_is_scanned_or_media(part_type: Any) -> None:
    for key, annotation in fields_of(part_type).items():
        if not carries_text(annotation) or key in MEDIA_PART_KEYS:
            continue
        value: Any = MARK
        if get_origin(annotation) is None and typing.is_typeddict(annotation):
            value = {name: MARK for name in typing.get_type_hints(annotation)}
        body = {"messages": [{"role": "user", "content": [{"type": "x", key: value}]}]}
        texts = [slot.text for slot in prompt_slots("chat/completions", body)]
        assert MARK in texts, f"{part_type.__name__}.{key} is neither scanned nor in MEDIA_PART_KEYS"


def test_vllms_text_part_types_are_all_scanned() -> None:
    """vLLM's own list of content-part types it renders as text: each one's text reaches the rules."""
    for part_type in sorted(chat_utils.TEXT_PART_TYPES):
        key = {"refusal": "refusal", "thinking": "thinking"}.get(part_type, "text")
        body = {"messages": [{"role": "user", "content": [{"type": part_type, key: MARK}]}]}
        assert MARK in [s.text for s in prompt_slots("chat/completions", body)], part_type


def test_bare_string_parts_and_tool_reference_names_are_scanned() -> None:
    body = {"messages": [{"role": "user", "content": [MARK, {"type": "tool_reference", "name": MARK + "2"}]}]}
    texts = [s.text for s in prompt_slots("chat/completions", body)]
    assert MARK in texts and MARK + "2" in texts


# -- what the client reads --------------------------------------------------------------------------


def test_every_text_of_a_chat_answer_is_an_answer_slot() -> None:
    answer = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "c-" + MARK,
                    "reasoning_content": "rc-" + MARK,
                    "reasoning": "r-" + MARK,
                    "refusal": "ref-" + MARK,
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "a-" + MARK}}
                    ],
                    "function_call": {"name": "f", "arguments": "fc-" + MARK},
                },
            },
            {"index": 1, "text": "t-" + MARK},
        ]
    }
    texts = sorted(slot.text for _, slot in completion_slots(answer))
    assert texts == sorted(f"{p}-{MARK}" for p in ("c", "rc", "r", "ref", "a", "fc", "t"))
    legacy = {"choices": [{"index": 0, "text": "t-" + MARK}]}
    assert [slot.text for _, slot in completion_slots(legacy)] == ["t-" + MARK]
