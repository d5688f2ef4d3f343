"""The OpenAI SDK example of docs/responses.md runs as written, with the real ``openai`` SDK against the
gateway on the fake worker (only the URL and the model name are put in): a streamed turn whose answer is
whole ends ``completed``, and one cut by ``max_output_tokens`` ends ``incomplete`` with its reason,
where the SDK's ``get_final_response()`` raises."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import REPO, GatewayFactory
from tests.support.responses import responses_gateway

DOC = Path(REPO, "docs", "responses.md")


def sdk_example() -> str:
    """The first Python block under "### OpenAI SDK"."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("### OpenAI SDK") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None
    return found.group(1)


@pytest.fixture
def server(gateway_factory: GatewayFactory, upstream_url: str) -> Iterator[ServerThread]:
    with responses_gateway(gateway_factory, upstream_url) as srv:
        yield srv


def run_example(server: ServerThread) -> dict[str, Any]:
    code = sdk_example().replace("http://127.0.0.1:8000/v1", server.url + "/v1").replace('"smollm2"', '"m1"')
    scope: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(code, str(DOC), "exec"), scope)  # the documentation's own example
    scope["printed"] = printed.getvalue()
    return scope


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut_by_max_output_tokens"])
def test_the_documented_streaming_example_works_whole_and_cut(
    server: ServerThread, upstream: FakeUpstream, cut: bool
) -> None:
    upstream.behavior.text = "word " * 50
    upstream.behavior.chunks = 50 if cut else 3  # the fake stops at max_tokens (32) pieces: finish "length"
    scope = run_example(server)
    second = scope["second"]
    assert second.status == ("incomplete" if cut else "completed")
    if cut:
        assert second.incomplete_details is not None and second.incomplete_details.reason == "max_output_tokens"
    assert second.output_text and second.output_text in scope["printed"]
    # the same turn through the SDK's helper: it only accepts response.completed
    if cut:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with (
            client.responses.stream(model="m1", input="x", max_output_tokens=32) as stream,
            pytest.raises(RuntimeError, match=r"response\.completed"),
        ):
            stream.get_final_response()
