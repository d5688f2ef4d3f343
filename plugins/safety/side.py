"""Size and count bounds for ``POST /tokenize`` and ``/detokenize`` (``on_side_request``).

They generate nothing, so the rules do not run on them, but they cost a worker as much tokenizing as a
chat request's prompt: the same limits apply as to a chat (or completions) request for the model, the
body's bytes, JSON depth, messages and tools, prompt characters and prompt tokens, and a detokenize
request's token ids count against ``max_prompt_tokens``. A model the caller may not see (``call.model``
is None) gets the default limits and no token count (its tokenizer is not looked up), exactly as an
unknown one, so no answer tells the two apart.
"""

from __future__ import annotations

from gateway.pipeline.plugin import SideCall
from plugins.safety.config import LimitsConfig
from plugins.safety.limits import TokenCounter, check_chars, check_shape, check_tokens, limit_error, may_exceed_tokens
from plugins.safety.texts import prompt_slots


async def bound_side_call(limits: LimitsConfig, tokenizer: str | None, counter: TokenCounter, call: SideCall) -> None:
    """Raise ``InvalidRequest`` naming the field when ``call`` is over one of ``limits``."""
    body = call.body
    endpoint = "chat/completions" if "messages" in body else "completions"
    param = "messages" if endpoint == "chat/completions" else "prompt"
    if call.route == "detokenize":
        param = "tokens"
    check_shape(limits, body, call.raw_body, param)
    if call.route == "detokenize":
        tokens = body.get("tokens")
        if limits.max_prompt_tokens is not None and isinstance(tokens, list) and len(tokens) > limits.max_prompt_tokens:
            raise limit_error(
                f"The request has {len(tokens)} tokens; this model accepts at most {limits.max_prompt_tokens}.",
                "tokens",
                code="context_length_exceeded",
            )
        return
    texts = [slot.text for slot in prompt_slots(endpoint, body)]
    check_chars(limits, sum(len(text) for text in texts), param)
    if tokenizer is not None and may_exceed_tokens(limits, sum(len(text.encode()) for text in texts)):
        await check_tokens(limits, counter, tokenizer, texts, param)
