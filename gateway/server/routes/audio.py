"""vLLM's speech-to-text routes: ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``.

An upload is ``multipart/form-data`` (the audio ``file`` and form fields such as ``model``, ``language``,
``prompt``), read whole within the body limit. It is routed by its ``model`` field and takes the path of the
inference endpoints: the form fields are the request body the plugins see (tenancy authenticates and
limits it, safety reads the ``prompt``, routing places it), and the worker receives the form again
(``gateway.proxy.form_upstream``). Not streamed: ``stream=true`` is refused, as are the answer formats
that are not JSON (``text``, ``srt``, ``vtt``), which the plugins could not read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser

from gateway.pipeline.context import RequestContext
from gateway.proxy.form_upstream import FilePart, form_services
from gateway.proxy.forward import Proxy
from gateway.server.cycle import Receive, RequestCycle, Scope, Send
from gateway.server.routes.openai import _WATCH_AFTER_S, InferenceEndpoints
from gateway.wire.errors import (
    InvalidRequest,
    MethodNotAllowed,
    ServerError,
    UnsupportedMediaType,
    model_not_found,
)
from gateway.wire.protocol import Endpoint, header_dict

AUDIO_ROUTES = {
    "/v1/audio/transcriptions": Endpoint("audio/transcriptions", "/v1/audio/transcriptions", False),
    "/v1/audio/translations": Endpoint("audio/translations", "/v1/audio/translations", False),
}
_JSON_FORMATS = (None, "json", "verbose_json")


async def parse_form(headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[dict[str, Any], list[FilePart]]:
    """The form's fields (a field sent twice: a list) and its files; 415 for a body that is not a form."""
    media = dict(headers).get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    if media != b"multipart/form-data":
        raise UnsupportedMediaType(
            "Send the audio as multipart/form-data (a 'file' part and the form fields).",
            code="unsupported_media_type",
        )

    async def chunks() -> AsyncGenerator[bytes, None]:
        yield body

    try:
        form = await MultiPartParser(Headers(raw=headers), chunks(), max_files=1, max_fields=64).parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"The form could not be read: {exc.message}", code="invalid_form") from None
    fields: dict[str, Any] = {}
    files: list[FilePart] = []
    try:
        for name, value in form.multi_items():
            if isinstance(value, str):
                previous = fields.get(name)
                if previous is None:
                    fields[name] = value
                else:  # a repeated field (timestamp_granularities[]) is a list, sent back repeated
                    fields[name] = [*previous, value] if isinstance(previous, list) else [previous, value]
            else:
                data = await value.read()
                files.append(FilePart(name, value.filename or "audio", value.content_type or "", data))
    finally:
        await form.close()
    return fields, files


def check_upload(endpoint: Endpoint, fields: dict[str, Any], files: list[FilePart]) -> str:
    """The model name, after the checks the gateway relies on (the worker checks the rest)."""
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if [f.name for f in files] != ["file"]:
        raise InvalidRequest(
            "Send the audio as one form part named 'file'.", param="file", code="missing_required_parameter"
        )
    if fields.get("stream") not in (None, "false", "False"):
        raise InvalidRequest(f"'stream' is not supported on /v1/{endpoint.name} by this gateway.", param="stream")
    if fields.get("response_format") not in _JSON_FORMATS:
        raise InvalidRequest(
            "'response_format' must be 'json' or 'verbose_json' on this gateway: its plugins read JSON answers.",
            param="response_format",
            code="unsupported_parameter",
        )
    return model


class AudioEndpoints(InferenceEndpoints):
    """ASGI app for the two audio routes, served like the inference endpoints: the same body limit,
    request ids, disconnect watch, metrics, access log and error shape."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = AUDIO_ROUTES[scope["path"]]
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        cycle = RequestCycle(self.request_ids(raw_headers), time.perf_counter(), task=asyncio.current_task())
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"Method {scope['method']} is not allowed on {scope['path']}.")
            fields, files = await parse_form(raw_headers, await self._read_body(raw_headers, receive))
            model_name = check_upload(endpoint, fields, files)
            self._watch(receive, cycle, _WATCH_AFTER_S)
            if not self.holder.loaded:
                raise ServerError("The gateway has no config loaded yet.", code="not_ready", status=503)
            with self.holder.pin() as snapshot:
                self._allow_list(snapshot.config.limits).check(endpoint.name, {**fields, "file": None})
                model = snapshot.models.resolve(model_name)
                if model is None:
                    await snapshot.pipeline.run_models(header_dict(raw_headers), [])  # who is asking comes first
                    raise model_not_found(model_name)
                cycle.model = model.name
                fields["model"] = model.upstream_name
                cycle.ctx = ctx = RequestContext(
                    request_id=cycle.request_id,
                    endpoint=endpoint.name,
                    path=endpoint.path,
                    body=fields,
                    raw_body=orjson.dumps(fields),
                    headers=header_dict(raw_headers),
                    model=model,
                    requested_model=model_name,
                    snapshot=snapshot,
                    stream=False,
                    started=cycle.started,
                )
                reply = await Proxy(form_services(self.services, files)).serve(ctx)
                await self._send_reply(reply, send, cycle)
        except BaseException as exc:  # _answer_failure raises again what it does not answer
            await self._answer_failure(exc, send, cycle)
        finally:
            self._stop_watching(cycle)
            if cycle.ctx is not None:
                cycle.ctx.finalize()
            self._record(endpoint, cycle)
