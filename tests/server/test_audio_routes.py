"""vLLM's speech-to-text routes through the gateway, with the real ``openai`` SDK: the multipart upload is
routed by its ``model`` field to a worker that serves the route (over either upstream client), arrives there
as the same form with the served model name and the same bytes, and runs the pipeline (tenancy's key and
allowed models, safety over the text prompt); what the gateway cannot honour is refused in OpenAI's shape
before any worker sees it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from starlette.requests import Request

from plugins.tenancy.keys import hash_key
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory

PEPPER = "pepper-" + uuid.uuid4().hex
KEYS = {"all": "sk-all-" + uuid.uuid4().hex, "chat-only": "sk-chat-" + uuid.uuid4().hex}
AUDIO = b"RIFF\x00\x01WAVEfmt " + bytes(range(256)) * 8  # any bytes: the fake worker does not decode them
SECRET = "AKIAIOSFODNN7EXAMPLE"


class AudioWorker:
    """A speech-to-text model's vLLM server: reads the form as vLLM's FastAPI does (404 for other routes)."""

    def __init__(self, served: bool) -> None:
        self.served = served
        self.forms: list[tuple[str, str, dict[str, Any], bytes]] = []  # path, content-type, fields, file

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        path = scope["path"]
        status, answer = 404, {"detail": "Not Found"}
        if path == "/health":
            status, answer = 200, {}
        elif self.served and path.startswith("/v1/audio/"):
            async with request.form() as form:
                upload = form["file"]
                assert not isinstance(upload, str)
                fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
                self.forms.append((path, request.headers["content-type"], fields, await upload.read()))
            status, answer = 200, {"text": f"heard {len(self.forms[-1][3])} bytes"}
        raw = repr(answer).replace("'", '"').encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": raw})


@pytest.fixture
def setup(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerThread, AudioWorker]]:
    monkeypatch.setenv("GATEWAY_TENANCY_PEPPER", PEPPER)
    prefix = f"test:audio:{uuid.uuid4().hex[:12]}"
    keys = [
        {"id": "all", "tenant": "acme", "hash": hash_key(KEYS["all"], PEPPER.encode())},
        {"id": "chat-only", "tenant": "acme", "hash": hash_key(KEYS["chat-only"], PEPPER.encode()), "models": ["m1"]},
    ]
    rules = [{"id": "secrets", "kind": "secrets", "action": "redact"}]
    worker, other = AudioWorker(served=True), AudioWorker(served=False)
    with ServerThread(worker) as speech, ServerThread(other) as chat:
        config = {
            "models": [
                {"name": "m1", "workers": [chat.url]},
                {"name": "whisper", "aliases": ["stt"], "served_name": "openai/whisper-small", "workers": [speech.url]},
            ],
            "plugins": [
                {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}},
                {"name": "safety", "config": {"rules": rules}},
                {"name": "routing"},
            ],
            "limits": {"max_body_bytes": 64 * 1024},
        }
        client = getattr(request, "param", "http1")
        with gateway_factory(config, upstream_client=client) as (_, server):
            yield server, worker
    store = redis.Redis()
    stale = list(store.scan_iter(match=f"{prefix}*"))
    if stale:
        store.delete(*stale)
    store.close()


def sdk(server: ServerThread, key: str = "all") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=20)


@pytest.mark.parametrize("setup", ["http1", "aiohttp"], indirect=True)
def test_uploads_reach_a_worker_of_the_model_as_the_same_form(setup: tuple[ServerThread, AudioWorker]) -> None:
    server, worker = setup
    text = sdk(server).audio.transcriptions.create(
        model="stt", file=("clip.wav", AUDIO, "audio/wav"), language="en", prompt=f"key {SECRET}", temperature=0
    )
    assert text.text == f"heard {len(AUDIO)} bytes"
    path, content_type, fields, data = worker.forms[-1]
    assert path == "/v1/audio/transcriptions" and content_type.startswith("multipart/form-data; boundary=")
    assert data == AUDIO
    assert fields["model"] == "openai/whisper-small" and fields["language"] == "en" and fields["temperature"] == "0"
    assert fields["prompt"] == "key [SECRET]"  # safety read the prompt; the form was rebuilt from its rewrite

    translated = sdk(server).audio.translations.create(model="whisper", file=("clip.wav", AUDIO, "audio/wav"))
    assert translated.text and worker.forms[-1][0] == "/v1/audio/translations"


def test_refusals_reach_no_worker(setup: tuple[ServerThread, AudioWorker]) -> None:
    server, worker = setup
    url = server.url + "/v1/audio/transcriptions"
    upload = {"file": ("clip.wav", AUDIO, "audio/wav")}
    auth = {"authorization": f"Bearer {KEYS['all']}"}

    def refused(data: dict[str, Any], headers: dict[str, str] = auth, **extra: Any) -> tuple[int, str | None]:
        reply = httpx.post(url, data=data, files=extra.get("files", upload), headers=headers)
        body = reply.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        return reply.status_code, body["error"]["code"]

    assert refused({"model": "whisper"}, headers={}) == (401, "invalid_api_key")
    assert refused({"model": "whisper"}, headers={"authorization": f"Bearer {KEYS['chat-only']}"}) == (
        404,
        "model_not_found",
    )
    assert refused({"model": "nope"}) == (404, "model_not_found")
    assert refused({"model": "whisper", "stream": "true"})[0] == 400
    assert refused({"model": "whisper", "response_format": "srt"}) == (400, "unsupported_parameter")
    assert refused({"model": "whisper", "vllm_xargs": "{}"}) == (400, "unsupported_parameter")
    assert refused({"model": "whisper"}, files={"audio": ("clip.wav", AUDIO, "audio/wav")}) == (
        400,
        "missing_required_parameter",
    )
    assert refused({"model": "whisper"}, files={"file": ("big.wav", b"x" * 70_000, "audio/wav")})[0] == 413
    json_body = httpx.post(url, json={"model": "whisper"}, headers=auth)
    assert json_body.status_code == 415 and json_body.json()["error"]["code"] == "unsupported_media_type"
    assert worker.forms == []
    # a model whose workers do not serve the route: a 404 that names it
    assert refused({"model": "m1"}) == (404, "unsupported_endpoint")
