"""Fakes at the process edge: an OpenAI-compatible upstream served on a real loopback socket, and a
helper that runs any ASGI app with uvicorn in a background thread (so sync and async clients, and real
disconnects, all work against it)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn


def loopback_socket() -> socket.socket:
    """A TCP socket bound to a free loopback port. IPPROTO_TCP is named, as asyncio's own sockets have it:
    asyncio sets TCP_NODELAY only on those, and without it small answers wait out the peer's delayed ACK
    (about 40 ms each)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.bind(("127.0.0.1", 0))
    return s


def free_port() -> int:
    """A port free now, for a server started later (another process): it may be taken in between."""
    with loopback_socket() as s:
        return int(s.getsockname()[1])


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 in a daemon thread with its own event loop."""

    def __init__(
        self,
        app: Any,
        port: int | None = None,
        *,
        lifespan: str = "on",
        start_timeout_s: float = 30,
        http: Any = "httptools",
        options: dict[str, Any] | None = None,
    ) -> None:
        self.start_timeout_s = start_timeout_s
        # Without a given port the socket is bound here and handed to uvicorn, so nothing else on the machine
        # (a vLLM worker's own ports, another test's server) can take the port between choosing and binding it.
        self._socket: socket.socket | None = None
        if port is None:
            self._socket = loopback_socket()
            port = int(self._socket.getsockname()[1])
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_config=None,
            access_log=False,
            lifespan=lifespan,
            loop="asyncio",
            http=http,
            timeout_graceful_shutdown=5,
            **(options or {}),  # a gateway's: Settings.server_options, as `gateway serve` passes them
        )
        self.server = uvicorn.Server(config)
        sockets = None if self._socket is None else [self._socket]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets}, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread died during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start within {self.start_timeout_s:g} s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        if self._socket is not None:
            self._socket.close()


@dataclass
class Behavior:
    """How the fake answers the next requests. Tests set fields between requests."""

    status: int = 200
    error_body: bytes | None = None
    hang: bool = False  # accept, read the request, never answer
    delay_s: float = 0.0  # before response headers
    # Held before answering until the test sets it (after delay_s): lets a test keep requests in flight
    # until all of them have arrived, however slowly a loaded machine sends them.
    hold: threading.Event | None = None
    chunks: int = 3  # content chunks in a stream
    pace_s: float = 0.0  # between stream chunks
    cut_after: int | None = None  # close the stream after this many chunks, without [DONE]
    die_after: int | None = None  # break the connection after this many chunks (no end of the body)
    hang_after: int | None = None  # after this many chunks send nothing more, until the client goes away
    text: str = "Hello from the fake worker."
    finish_reason: str = "stop"
    ignore_max_tokens: bool = False  # a worker that runs past the request's max_tokens (as a faulty one may)
    # Raw bytes sent before a stream's first event (e.g. an SSE comment): a byte pass-through keeps
    # them, a relay that parses events drops them.
    preamble: bytes = b""
    system_fingerprint: str | None = None  # sent on the response and on every stream event when set
    # Chat answers call these tools ([{"id", "name", "arguments"}]) instead of sending ``text``; streamed, each
    # call's arguments arrive in two deltas.
    tool_calls: list[dict[str, str]] | None = None
    # /tokenize: "count" (a prompt counts 5 tokens, as in the usage the fake reports), "missing" (404, as
    # from a worker without the route) or "hang" (no answer until the client goes away).
    tokenize: str = "count"
    # /tokenize with tokenize="chars": a chat prompt counts one token per character of its messages' contents,
    # in a context of max_model_len tokens (what vLLM's /tokenize answers beside the count).
    max_model_len: int = 2048
    # A continuation's prompt counts this many more tokens than the pieces it carries (a retokenized text
    # need not split as the generated tokens did).
    retokenized_extra: int = 0
    # Reported as usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details) when set.
    cached_tokens: int | None = None


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    raw: bytes
    headers: dict[str, str]


class WorkerDied(Exception):
    """Raised by the fake inside a stream: the server drops the connection without ending the body."""


@dataclass
class FakeUpstream:
    """An OpenAI-compatible worker: /v1/chat/completions, /v1/completions, /v1/embeddings, /health."""

    behavior: Behavior = field(default_factory=Behavior)
    requests: list[Seen] = field(default_factory=list)
    disconnects: int = 0
    completed_streams: int = 0
    healthy: bool = True
    name: str = "fake"
    tokenized: list[dict[str, Any]] = field(default_factory=list)  # /tokenize bodies (not in ``requests``)
    # LoRA as a vLLM worker started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: /v1/models
    # lists ``base_model`` and each loaded adapter (with ``parent``), /v1/load_lora_adapter and
    # /v1/unload_lora_adapter answer as vLLM does, and a request naming neither the base model nor a loaded
    # adapter is a 404. Off (``lora`` False): no such routes, any model is answered.
    lora: bool = False
    base_model: str = "m1"
    adapters: dict[str, str] = field(default_factory=dict)  # loaded: lora_name -> lora_path
    lora_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (load|unload, body)
    lora_hold: threading.Event | None = None  # loads wait for it (a test keeps a load in progress)
    lora_missing: set[str] = field(default_factory=set)  # paths that do not exist on this worker

    def reset(self) -> None:
        self.behavior = Behavior()
        self.requests.clear()
        self.tokenized.clear()
        self.disconnects = 0
        self.completed_streams = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if path == "/health":
            await _send_json(send, 200 if self.healthy else 503, {} if self.healthy else {"error": "down"})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = orjson.loads(raw) if raw else {}
        b = self.behavior
        if path == "/tokenize":
            self.tokenized.append(body)
            if b.tokenize == "count":
                await _send_json(send, 200, {"count": 5, "max_model_len": b.max_model_len, "tokens": [1, 2, 3, 4, 5]})
            elif b.tokenize == "chars":
                count = sum(len(str(m.get("content") or "")) for m in body.get("messages") or ())
                await _send_json(send, 200, {"count": count, "max_model_len": b.max_model_len, "tokens": []})
            elif b.tokenize == "hang":
                await _wait_disconnect(receive)
            else:
                await _send_json(send, 404, {"detail": "Not Found"})
            return
        if self.lora and (path == "/v1/models" or path.endswith("_lora_adapter")):
            await self._lora_route(path, body, send)
            return
        if path.endswith("_lora_adapter"):  # as vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: no such route
            await _send_json(send, 404, {"detail": "Not Found"})
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append(Seen(path, body, raw, headers))
        model = body.get("model")
        if self.lora and model != self.base_model and model not in self.adapters:
            await _send_json(send, 404, _vllm_error(f"The model `{model}` does not exist.", "NotFoundError", 404))
            return
        try:
            if b.hang:
                await _wait_disconnect(receive)
                self.disconnects += 1
                return
            if b.delay_s:
                await asyncio.sleep(b.delay_s)
            if b.hold is not None:
                await asyncio.to_thread(b.hold.wait, 30)
            if b.status != 200:
                payload = b.error_body or orjson.dumps(
                    {
                        "object": "error",
                        "message": f"fake failure {b.status}",
                        "type": "BadRequestError",
                        "param": None,
                        "code": b.status,
                    }
                )
                await _send_raw(send, b.status, payload)
                return
            if path == "/v1/embeddings":
                await _send_json(
                    send,
                    200,
                    {
                        "object": "list",
                        "model": body.get("model"),
                        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                        "usage": {"prompt_tokens": 2, "total_tokens": 2},
                    },
                )
                return
            if body.get("stream"):
                await self._stream(path, body, receive, send)
            else:
                await _send_json(send, 200, self.completion(path, body))
        except (OSError, asyncio.CancelledError):
            self.disconnects += 1
            raise

    async def _lora_route(self, path: str, body: dict[str, Any], send: Any) -> None:
        """vLLM's model list and run-time adapter routes, with vLLM's statuses and messages."""
        if path == "/v1/models":
            cards = [{"id": self.base_model, "object": "model", "root": self.base_model, "parent": None}]
            cards += [
                {"id": n, "object": "model", "root": p, "parent": self.base_model} for n, p in self.adapters.items()
            ]
            await _send_json(send, 200, {"object": "list", "data": cards})
            return
        name = body.get("lora_name", "")
        if path == "/v1/unload_lora_adapter":
            self.lora_calls.append(("unload", body))
            if self.adapters.pop(name, None) is None:
                await _send_json(
                    send, 404, _vllm_error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
                )
                return
            await _send_raw(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode())
            return
        self.lora_calls.append(("load", body))
        if self.lora_hold is not None:
            await asyncio.to_thread(self.lora_hold.wait, 30)
        if name in self.adapters and not body.get("load_inplace"):
            message = f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place,"
            await _send_json(send, 400, _vllm_error(message + " set 'load_inplace' to True.", "BadRequestError", 400))
        elif body.get("lora_path") in self.lora_missing:
            message = f"No adapter found for {body.get('lora_path')}"
            await _send_json(send, 404, _vllm_error(message, "NotFoundError", 404))
        else:
            self.adapters[name] = body.get("lora_path", "")
            await _send_raw(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode())

    def completion(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        b = self.behavior
        n = body.get("n") or 1
        usage: dict[str, Any] = {"prompt_tokens": 5, "completion_tokens": b.chunks, "total_tokens": 5 + b.chunks}
        if b.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": b.cached_tokens}
        if path == "/v1/completions":
            choices = [
                {"index": i, "text": b.text, "logprobs": None, "finish_reason": b.finish_reason} for i in range(n)
            ]
            return {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 1,
                "model": body.get("model"),
                "choices": choices,
                "usage": usage,
            }
        message: dict[str, Any] = {"role": "assistant", "content": b.text}
        finish_reason = b.finish_reason
        if b.tool_calls is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [_tool_call(c) for c in b.tool_calls]}
            finish_reason = "tool_calls"
        logprobs = _logprobs(_split(b.text, b.chunks), body) if b.tool_calls is None else None
        choices = [
            {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason} for i in range(n)
        ]
        out = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1,
            "model": body.get("model"),
            "choices": choices,
            "usage": usage,
        }
        if b.system_fingerprint is not None:
            out["system_fingerprint"] = b.system_fingerprint
        return out

    async def _stream(self, path: str, body: dict[str, Any], receive: Any, send: Any) -> None:
        b = self.behavior
        chat = path == "/v1/chat/completions"
        watcher = asyncio.create_task(_wait_disconnect(receive))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        base = {
            "id": "chatcmpl-fake" if chat else "cmpl-fake",
            "created": 1,
            "model": body.get("model"),
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        if b.system_fingerprint is not None:
            base["system_fingerprint"] = b.system_fingerprint
        pieces = _split(b.text, b.chunks)
        # A continuation (the gateway resuming a cut stream) carries the text sent so far at the end of
        # its prompt: go on from there, deterministically, and count the sent pieces as prompt tokens.
        skipped = 0
        prefix = _continued_prefix(chat, body, b.text)
        if prefix:
            skipped = b.retokenized_extra
            done = 0
            while pieces and done + len(pieces[0]) <= len(prefix):
                done += len(pieces.pop(0))
                skipped += 1
            if pieces and done < len(prefix):
                pieces[0] = pieces[0][len(prefix) - done :]
        limit = body.get("max_tokens") or body.get("max_completion_tokens")
        finish_reason = b.finish_reason
        if isinstance(limit, int) and limit < len(pieces) and not b.ignore_max_tokens:
            pieces, finish_reason = pieces[:limit], "length"
        events: list[dict[str, Any]] = []
        if chat:
            events.append(
                {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
        if chat and b.tool_calls is not None:
            pieces = []
            for i, call in enumerate(b.tool_calls):
                half = len(call["arguments"]) // 2
                first = {"index": i, "id": call["id"], "type": "function"}
                first["function"] = {"name": call["name"], "arguments": call["arguments"][:half]}
                rest = {"index": i, "function": {"arguments": call["arguments"][half:]}}
                for delta in (first, rest):
                    choice = {"index": 0, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None}
                    events.append({**base, "choices": [choice]})
        for piece in pieces:
            if chat:
                events.append(
                    {
                        **base,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"content": piece},
                                "logprobs": _logprobs([piece], body),
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            else:
                events.append(
                    {**base, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": None}]}
                )
        if chat and b.tool_calls is not None:
            finish_reason = "tool_calls"
        last = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        last.update({"delta": {}} if chat else {"text": ""})
        events.append({**base, "choices": [last]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(
                {
                    **base,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 5 + skipped,
                        "completion_tokens": len(pieces),
                        "total_tokens": 5 + skipped + len(pieces),
                        **(
                            {"prompt_tokens_details": {"cached_tokens": b.cached_tokens}}
                            if b.cached_tokens is not None
                            else {}
                        ),
                    },
                }
            )
        try:
            if b.preamble:
                await send({"type": "http.response.body", "body": b.preamble, "more_body": True})
            for i, event in enumerate(events):
                if b.cut_after is not None and i >= b.cut_after:
                    return  # the connection ends without [DONE]
                if b.die_after is not None and i >= b.die_after:
                    raise WorkerDied(f"died after {i} chunks")
                if b.hang_after is not None and i >= b.hang_after:
                    await watcher
                    self.disconnects += 1
                    return
                if watcher.done():
                    self.disconnects += 1
                    return
                await send(
                    {"type": "http.response.body", "body": b"data: " + orjson.dumps(event) + b"\n\n", "more_body": True}
                )
                if b.pace_s:
                    await asyncio.wait({watcher}, timeout=b.pace_s)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            self.completed_streams += 1
        finally:
            watcher.cancel()


def _continued_prefix(chat: bool, body: dict[str, Any], text: str) -> str:
    """The part of ``text`` a continuation request says was already sent ("" for a fresh request)."""
    if chat:
        messages = body.get("messages") or []
        if not (body.get("continue_final_message") and messages and messages[-1].get("role") == "assistant"):
            return ""
        sent = messages[-1].get("content") or ""
        return sent if text.startswith(sent) else ""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return ""
    for k in range(len(text), 0, -1):
        if prompt.endswith(text[:k]):
            return text[:k]
    return ""


def _logprobs(pieces: list[str], body: dict[str, Any]) -> dict[str, Any] | None:
    """Chat logprobs for ``pieces`` (one token each) when the request asks for them, as vLLM sends them."""
    if not body.get("logprobs"):
        return None
    top = body.get("top_logprobs") or 0

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(p, -0.25), "top_logprobs": [entry(p if k == 0 else f"alt{k}", -0.25 - k) for k in range(top)]}
            for p in pieces
        ]
    }


def _tool_call(call: dict[str, str]) -> dict[str, Any]:
    return {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}


def _split(text: str, n: int) -> list[str]:
    n = max(1, n)
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _vllm_error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_json(send: Any, status: int, obj: Any) -> None:
    await _send_raw(send, status, orjson.dumps(obj))


async def _send_raw(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def running(app: Any, port: int | None = None) -> Iterator[ServerThread]:
    with ServerThread(app, port) as server:
        yield server
