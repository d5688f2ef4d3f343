"""A request's prompt tokens, as the worker will make them, for predicting which of its blocks are cached.

Chat: the model's own tokenizer applies the chat template the worker uses (its ``--chat-template`` when
one was given) with the request's tools and template arguments, as vLLM's renderer calls it
(``vllm/renderers/hf.py``: ``apply_chat_template(tokenize=True, return_dict=False)``, which encodes the
rendered text without adding special tokens). Completions: the prompt text encoded with special tokens
(vLLM's default there), or the token ids given. What this module cannot reproduce exactly (images,
audio, earlier tool calls, several prompts in one request) yields None: such a request is not
predicted, and routing places it by approximate affinity.

The tokenizer is the model's ``tokenizer.json`` (the ``tokenizers`` package, as Hugging Face's fast
tokenizers use it) and the template is rendered by ``transformers``' own ``render_jinja_template`` with the
special tokens its tokenizer would pass: what ``apply_chat_template`` does, without importing the model
side of ``transformers`` (and torch: half a GiB and seconds per gateway process). ``transformers`` comes
with the engine; it is imported only when a model uses the precise policy, in a thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
_MESSAGE_FIELDS = ("role", "content", "name")
_ROLES = ("system", "user", "assistant")


class TokenizerBusy(Exception):
    """``tokens(..., wait=False)`` while another thread is using the tokenizer."""


class PromptTokenizer:
    """The tokenizer and chat template of one model. One call at a time: a Hugging Face fast tokenizer
    used from several threads at once can fail ("Already borrowed")."""

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self._tok = tokenizer  # encode(text, add_special_tokens) -> ids, apply_chat_template(...) -> ids
        self._template = chat_template
        self._lock = threading.Lock()
        self._turn = asyncio.Lock()  # held while a prompt of ``run`` uses the tokenizer; the others wait
        self._waiting = 0  # requests of ``run`` waiting for their turn
        # one thread, as the tokenizer serves one prompt at a time
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-tokens")

    @classmethod
    async def load(cls, path: str, chat_template: str | None = None) -> PromptTokenizer:
        """Load ``path`` (a Hugging Face model directory) and ``chat_template`` (a Jinja file) off the loop."""

        def build() -> PromptTokenizer:
            template = Path(chat_template).read_text() if chat_template else None
            return cls(_ModelTokenizer(Path(path)), template)

        return await asyncio.to_thread(build)

    async def run(self, work: Callable[[], T], *, in_thread: bool, wait_s: float) -> T:
        """Run ``work`` (which calls ``tokens``) when the tokenizer is free: on the loop, or in this
        tokenizer's own thread (``in_thread``, for long prompts). Raises ``TokenizerBusy``, without starting
        ``work``, when another prompt keeps the tokenizer for longer than ``wait_s``.

        Why the bound: the tokenizer serves one prompt at a time, and a long one holds it for seconds (a
        4 MiB chat body: about 7 s). Waiting for it would put every other request of the model behind one
        client's prompt; a request that is not predicted is placed by approximate affinity instead. Why the
        own thread: work waiting or running there does not hold a thread of the loop's default pool, which
        also serves the gateway's file I/O, config reads and other plugins' work."""
        if self._turn.locked() or self._waiting:  # (a turn just released may be promised to a waiter)
            self._waiting += 1
            try:
                await asyncio.wait_for(self._turn.acquire(), wait_s)
            except TimeoutError:
                raise TokenizerBusy from None
            finally:
                self._waiting -= 1
        else:
            await self._turn.acquire()  # free and nobody waiting: taken at once, the loop does not switch
        if not in_thread:
            try:
                return work()
            finally:
                self._turn.release()
        done = asyncio.get_running_loop().run_in_executor(self._thread, work)
        # the turn ends when the thread is done, even if the request that started it went away first
        done.add_done_callback(lambda _: self._turn.release())
        return await asyncio.shield(done)

    def tokens(
        self, endpoint: str, body: dict[str, Any], *, wait: bool = True, at_most: int | None = None
    ) -> list[int] | None:
        """The prompt's token ids, or None when they cannot be known exactly. With ``wait=False`` (on the
        event loop) it raises ``TokenizerBusy`` instead of waiting for a thread using the tokenizer. With
        ``at_most``, a prompt whose length in characters alone proves more tokens than that may also give
        None, without being tokenized."""
        if not self._lock.acquire(blocking=wait):
            raise TokenizerBusy
        try:
            return self._tokens(endpoint, body, {} if at_most is None else {"at_most": at_most})
        finally:
            self._lock.release()

    def _tokens(self, endpoint: str, body: dict[str, Any], bound: dict[str, int]) -> list[int] | None:
        if endpoint == "chat/completions":
            return self._chat(body, bound)
        if endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                add = body.get("add_special_tokens", True) is True
                ids: list[int] | None = self._tok.encode(prompt, add_special_tokens=add, **bound)
                return ids
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
        return None

    def _chat(self, body: dict[str, Any], bound: dict[str, int]) -> list[int] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        conversation: list[dict[str, Any]] = []
        for message in messages:
            plain = _plain_message(message)
            if plain is None:
                return None
            conversation.append(plain)
        kwargs = body.get("chat_template_kwargs")
        extra: dict[str, Any] = dict(kwargs) if isinstance(kwargs, dict) else {}
        extra.setdefault("add_generation_prompt", body.get("add_generation_prompt", True))
        extra.setdefault("continue_final_message", body.get("continue_final_message", False))
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        if body.get("add_special_tokens") is True:
            return None  # vLLM then adds them on top of the template's: not reproduced here
        ids = self._tok.apply_chat_template(conversation, tools=tools, chat_template=self._template, **bound, **extra)
        return None if ids is None else list(ids)


def _plain_message(message: object) -> dict[str, Any] | None:
    """A message as vLLM hands a string-content template: text parts joined by newlines. Roles vLLM may
    rewrite first (``developer`` becomes ``system`` for templates without it) and tool turns are not
    guessed at: a tenant's unusual request must not count as a misprediction against everyone's model."""
    if not isinstance(message, dict) or message.get("tool_calls") or message.get("role") not in _ROLES:
        return None
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        return None
    plain = {k: message[k] for k in _MESSAGE_FIELDS if k in message}
    plain["content"] = content
    return plain


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _ModelTokenizer:
    """A model directory's tokenizer and chat template, as a Hugging Face fast tokenizer applies them
    (``PreTrainedTokenizerBase.apply_chat_template``: the named special tokens are template variables, the
    rendered text is encoded without adding special tokens)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer
        from transformers.utils.chat_template_utils import render_jinja_template  # seconds: here, in the thread

        self._render = render_jinja_template
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.special_tokens = {name: _token_text(config[name]) for name in _SPECIAL_TOKENS if config.get(name)}
        template_file = path / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self.chars_per_token = _most_chars_per_token(json.loads(self._tokenizer.to_str()))

    def encode(self, text: str, add_special_tokens: bool, at_most: int | None = None) -> list[int] | None:
        """The text's token ids, or None when ``at_most`` is given and the text is longer in characters than
        ``at_most`` tokens can be: not tokenized at all (a 4 MiB prompt takes seconds)."""
        if at_most is not None and self.chars_per_token is not None and len(text) > at_most * self.chars_per_token:
            return None
        # encode_batch, not encode: only the batch call lets go of the GIL while the Rust side tokenizes, and
        # a long prompt (seconds) in the tokenizer's thread must not stop the event loop for all that time
        return list(self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tools: list[Any] | None,
        chat_template: str | None,
        at_most: int | None = None,
        **kwargs: Any,
    ) -> list[int] | None:
        template = _pick_template(chat_template or self.chat_template, tools)
        rendered: Any = self._render(
            conversations=[conversation], tools=tools, chat_template=template, **{**self.special_tokens, **kwargs}
        )
        return self.encode(rendered[0][0], add_special_tokens=False, at_most=at_most)  # (texts, generation indices)


def _most_chars_per_token(spec: dict[str, Any]) -> int | None:
    """The most characters of text one token can stand for, or None when the tokenizer gives no such bound.

    A byte-level BPE tokenizer without a normalizer (GPT-2's, Llama 3's, SmolLM2's) turns text into bytes
    (at least one per character) and each token into at most its vocabulary entry's length in bytes (an
    entry's characters are bytes there), or an added token's content: so a text has at least
    ``len(text) / this`` tokens. A normalizer may shorten the text, a pre-tokenizer may drop some of it,
    and an unknown-token model may fold a whole word into one token: no bound then."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    keeps_text = all(
        s.get("type") in ("ByteLevel", "Digits") or (s.get("type") == "Split" and s.get("behavior") != "Removed")
        for s in steps
    )
    model = spec.get("model") or {}
    if (
        spec.get("normalizer") is not None
        or not keeps_text
        or not any(step.get("type") == "ByteLevel" for step in steps)
        or model.get("type") != "BPE"
        or not isinstance(model.get("vocab"), dict)
    ):
        return None
    added = [len(str(token.get("content", ""))) for token in spec.get("added_tokens") or []]
    return max([len(entry) for entry in model["vocab"]] + added) or None


def _token_text(value: Any) -> str:
    return str(value.get("content", "")) if isinstance(value, dict) else str(value)


def _pick_template(template: Any, tools: list[Any] | None) -> str:
    """A single template, or the right one of several named ones (as ``get_chat_template`` picks it)."""
    if isinstance(template, list):  # [{"name": ..., "template": ...}] in tokenizer_config.json
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):
        if tools is not None and "tool_use" in template:
            return str(template["tool_use"])
        return str(template["default"])
    if not isinstance(template, str):
        raise ValueError("the model has no chat template")
    return template
