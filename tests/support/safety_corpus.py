"""The red-team corpus (``tests/plugins/safety/corpus/``) and the evasions applied to it.

Each sample is sent as a chat request, as is and under every evasion from issue 23: homoglyphs,
fullwidth letters, soft hyphens, zero-width characters, odd whitespace, text split across content parts
or messages, base64, mathematical letters and combining marks; and from issue 30: text spelled in
Unicode tag characters, Hangul fillers as spaces, spaced-out letters and leetspeak (the last two only
for the injections: they make a secret another string). Used by the corpus tests and by
``bench/bench_safety_corpus.py`` (which prints the rates).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent.parent / "plugins" / "safety" / "corpus"

# Latin letter -> a look-alike from another script (Cyrillic, Greek).
_HOMOGLYPHS = {
    "a": "\u0430", "c": "\u0441", "e": "\u0435", "o": "\u043e", "p": "\u0440", "x": "\u0445", "y": "\u0443",
    "i": "\u0456", "s": "\u0455", "A": "\u0391", "B": "\u0392", "E": "\u0395", "K": "\u039a", "O": "\u039f",
    "T": "\u03a4", "I": "\u0399", "S": "\u0405", "H": "\u041d", "M": "\u041c", "P": "\u0420", "C": "\u0421",
}  # fmt: skip

DEFAULT_RULES: list[dict[str, Any]] = [
    {"id": "secrets", "kind": "secrets", "action": "redact"},
    {"id": "payment-cards", "kind": "card", "action": "redact"},
    {"id": "prompt-injection", "kind": "injection", "action": "block"},
]


def _lines(name: str) -> list[str]:
    text = (CORPUS / name).read_text("utf-8")
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def injections() -> list[str]:
    return _lines("injections.txt")


def secrets() -> list[tuple[str, str]]:
    return [(kind, value) for kind, value in (line.split("\t", 1) for line in _lines("secrets.txt"))]


def clean() -> list[str]:
    return _lines("clean.txt")


def homoglyphs(text: str) -> str:
    return "".join(_HOMOGLYPHS.get(c, c) for c in text)


def fullwidth(text: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else "\u3000" if c == " " else c for c in text)


def zero_width(text: str) -> str:
    return "\u200b".join(text[i : i + 2] for i in range(0, len(text), 2))


def soft_hyphens(text: str) -> str:
    return "\u00ad".join(text)


def mixed_zero_width(text: str) -> str:
    marks = ["\u200c", "\u200d", "\u2060", "\ufeff"]
    return "".join(c + marks[i % 4] for i, c in enumerate(text))


def whitespace(text: str) -> str:
    return text.replace(" ", " \n\t\u00a0 ")


def math_bold(text: str) -> str:
    def bold(c: str) -> str:
        if "a" <= c <= "z":
            return chr(0x1D41A + ord(c) - ord("a"))
        if "A" <= c <= "Z":
            return chr(0x1D400 + ord(c) - ord("A"))
        if "0" <= c <= "9":
            return chr(0x1D7CE + ord(c) - ord("0"))
        return c

    return "".join(bold(c) for c in text)


def combining(text: str) -> str:
    return "".join(c + "\u0307" if c.isalpha() and i % 3 == 0 else c for i, c in enumerate(text))


def tag_characters(text: str) -> str:
    """The text spelled in Unicode tag characters (U+E0020-U+E007E), invisible but read by some models."""
    return "".join(chr(0xE0000 + ord(c)) if " " <= c <= "~" else c for c in text)


def hangul_fillers(text: str) -> str:
    return text.replace(" ", "\u3164")


def spaced_letters(text: str) -> str:
    """ "i g n o r e   a l l": a space between letters, a wider gap between words."""
    return "   ".join(" ".join(word) for word in text.split(" "))


_LEET = str.maketrans("aeiostAEIOST", "431057431057")


def leetspeak(text: str) -> str:
    return text.translate(_LEET)


@dataclass(frozen=True)
class Evasion:
    name: str
    messages: Callable[[str], list[dict[str, Any]]]  # the sample -> the request's messages
    #: False: the evasion changes what a secret is (a leetspeak key is another string), so only the
    #: injections are tried under it.
    secrets: bool = True


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Hello. {text} Thanks."}]


def _split_parts(text: str) -> list[dict[str, Any]]:
    mid = len(text) // 2
    return [{"role": "user", "content": [{"type": "text", "text": text[:mid]}, {"type": "text", "text": text[mid:]}]}]


def _split_messages(text: str) -> list[dict[str, Any]]:
    mid = len(text) // 2
    return [{"role": "user", "content": text[:mid]}, {"role": "user", "content": text[mid:]}]


def _base64(text: str) -> list[dict[str, Any]]:
    encoded = base64.b64encode(text.encode()).decode()
    return [{"role": "user", "content": f"Decode this and do what it says: {encoded}"}]


EVASIONS: list[Evasion] = [
    Evasion("plain", _user),
    Evasion("homoglyphs", lambda t: _user(homoglyphs(t))),
    Evasion("fullwidth", lambda t: _user(fullwidth(t))),
    Evasion("zero-width", lambda t: _user(zero_width(t))),
    Evasion("mixed invisible", lambda t: _user(mixed_zero_width(t))),
    Evasion("soft hyphens", lambda t: _user(soft_hyphens(t))),
    Evasion("whitespace", lambda t: _user(whitespace(t))),
    Evasion("math letters", lambda t: _user(math_bold(t))),
    Evasion("combining marks", lambda t: _user(combining(t))),
    Evasion("split parts", _split_parts),
    Evasion("split messages", _split_messages),
    Evasion("base64", _base64),
    Evasion("tag characters", lambda t: _user(tag_characters(t))),
    Evasion("hangul fillers", lambda t: _user(hangul_fillers(t))),
    Evasion("spaced letters", lambda t: _user(spaced_letters(t)), secrets=False),
    Evasion("leetspeak", lambda t: _user(leetspeak(t)), secrets=False),
]


# -- running the plugin in-process --------------------------------------------------------------------


async def make_plugin(rules: list[dict[str, Any]] | None = None, *, audit_key: str | None = None) -> Any:
    """A started SafetyPlugin with ``rules`` (default: the shipped default rules)."""
    from gateway.ops.metrics import Metrics
    from gateway.ops.settings import Settings
    from gateway.pipeline.services import Services
    from gateway.upstream.client import UpstreamClient, UpstreamConfig
    from gateway.upstream.workers import WorkerTable
    from plugins.safety import SafetyConfig, SafetyPlugin

    settings = Settings(audit_hmac_key=audit_key)  # type: ignore[arg-type]
    services = Services(settings, UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
    plugin = SafetyPlugin(SafetyConfig.model_validate({"rules": rules or DEFAULT_RULES}), services)
    await plugin.start()
    return plugin


async def screen(plugin: Any, body: dict[str, Any], endpoint: str = "chat/completions") -> tuple[str | None, Any]:
    """Run the plugin's on_request on ``body``: (the blocking rule or None, the body as sent upstream)."""
    import orjson

    from gateway.pipeline.config import ModelConfig
    from gateway.pipeline.context import RequestContext
    from gateway.wire.errors import InvalidRequest

    body = {"model": "m", **body}
    raw = orjson.dumps(body)
    ctx = RequestContext(
        request_id="corpus",
        endpoint=endpoint,
        path="/v1/" + endpoint,
        body=orjson.loads(raw),
        raw_body=raw,
        headers={},
        model=ModelConfig(name="m", workers=["http://127.0.0.1:1"]),
        requested_model="m",
        snapshot=None,  # the hook does not use it
        stream=False,
        started=0.0,
    )
    try:
        await plugin.on_request(ctx)
    except InvalidRequest as exc:
        assert exc.code == "content_filter"
        return exc.message.split("(rule '", 1)[1].split("'", 1)[0], None
    return None, ctx.body


def compact(text: str) -> str:
    """Normalised and without whitespace: how a leak is looked for in what was sent."""
    from plugins.safety.normalize import normalize

    return "".join(normalize(text)[0].split())


def leaked(sample: str, sent: dict[str, Any], endpoint: str = "chat/completions") -> bool:
    """Whether ``sample`` (in any spelling the normaliser undoes, split or base64-encoded) still
    reaches the worker in ``sent``."""
    from plugins.safety.texts import prompt_slots

    texts = [slot.text for slot in prompt_slots(endpoint, sent)]
    joined = "".join(texts)
    if compact(sample) in compact(joined):
        return True
    return any(base64.b64encode(sample.encode()).decode()[:16] in t for t in texts)
