"""The chat template shipped for SmolLM2 with tools (gateway/engine/templates/smollm2_tools.jinja),
rendered by transformers as vLLM renders it: unchanged prompts without tools, and tools, tool calls and
tool results in the format vLLM's xlam parser reads back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.engine.launch import TEMPLATES_DIR
from tests.support.gateways import REPO

TEMPLATE = (TEMPLATES_DIR / "smollm2_tools.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    path = REPO / "models" / "smollm2"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the default model is not prepared (make model)")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = TEMPLATE, **kw: Any) -> str:
    text: str = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kw
    )
    return text


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ],
)
def test_without_tools_it_renders_like_the_models_own_template(tokenizer: Any, messages: list[Any]) -> None:
    assert render(tokenizer, messages) == render(tokenizer, messages, template=None)


def test_tools_calls_and_results_are_rendered_in_the_xlam_format(tokenizer: Any) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = render(tokenizer, messages, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")  # the client's system prompt is kept
    listed = text.split("<tools>", 1)[1].split("</tools>", 1)[0]
    assert json.loads(listed) == TOOLS[0]["function"]
    turn = '<|im_start|>assistant\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert turn + "<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.count("<|im_start|>system") == 1
