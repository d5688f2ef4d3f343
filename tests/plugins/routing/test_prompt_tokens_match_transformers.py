"""The gateway's prompt tokens (``tokenizers`` + ``render_jinja_template``, no torch) are those of the model's
Hugging Face tokenizer's own ``apply_chat_template`` as vLLM calls it (``tokenize=True``,
``return_dict=False``), with the model's template and with the one shipped for managed workers' tools."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.engine.launch import chat_template_path
from plugins.routing.prompt_tokens import PromptTokenizer
from tests.support.gateways import REPO

MODEL_DIR = REPO / "models" / "smollm2"
TOOLS = [{"type": "function", "function": {"name": "track", "description": "Track a parcel",
          "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}]  # fmt: skip
BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {"messages": [{"role": "system", "content": "Be brief. Ünïcödé ✓"}, {"role": "user", "content": "Where?"}]},
    {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    },
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]},
    {"messages": [{"role": "user", "content": "Track X1"}], "tools": TOOLS},
    {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
]


@pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="the default model is not prepared (models/smollm2)")
@pytest.mark.parametrize("template", [None, "smollm2_tools"])
def test_prompt_tokens_are_the_hugging_face_tokenizers(template: str | None) -> None:
    transformers = pytest.importorskip("transformers")
    path = chat_template_path(template) if template else None
    reference = transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)
    text = open(path).read() if path else None  # noqa: SIM115 - read once, closed by the GC of a test
    ours = asyncio.run(PromptTokenizer.load(str(MODEL_DIR), path))
    for body in BODIES:
        messages = [{**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list)
                    else m for m in body["messages"]]  # fmt: skip
        expected = reference.apply_chat_template(
            messages, tools=body.get("tools"), chat_template=text, tokenize=True, return_dict=False,
            add_generation_prompt=body.get("add_generation_prompt", True),
            continue_final_message=body.get("continue_final_message", False),
        )  # fmt: skip
        assert ours.tokens("chat/completions", body) == list(expected), body
    for prompt in ("Once upon a time", "  spaces and\\nnewlines "):
        assert ours.tokens("completions", {"prompt": prompt}) == reference(prompt)["input_ids"]
        assert (
            ours.tokens("completions", {"prompt": prompt, "add_special_tokens": False})
            == reference(prompt, add_special_tokens=False)["input_ids"]
        )
