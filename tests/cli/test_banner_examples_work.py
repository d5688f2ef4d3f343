"""The start-up banner of `make run`: its curl and SDK examples work as printed."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.server.lifecycle import ready_banner
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config


def test_banner_examples_run_against_the_gateway(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    with gateway_factory(config) as (_, server):
        port = int(server.url.rsplit(":", 1)[1])
        banner = ready_banner(Settings(host="0.0.0.0", port=port), GatewayConfig.model_validate(config))
        assert f"http://127.0.0.1:{port}/v1" in banner.splitlines()[0]
        curl_line = next(line for line in banner.splitlines() if line.strip().startswith("curl"))
        args = shlex.split(curl_line)
        json.loads(args[args.index("-d") + 1])  # the body is valid JSON
        curl = subprocess.run(args, capture_output=True, text=True, timeout=30, check=True)
        assert json.loads(curl.stdout)["choices"][0]["message"]["content"] == "Hello from the fake worker."
        sdk_line = next(line for line in banner.splitlines() if line.strip().startswith("python -c"))
        code = shlex.split(sdk_line)[2]
        sdk = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert sdk.stdout.strip() == "Hello from the fake worker."
