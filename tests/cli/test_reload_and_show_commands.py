"""``gateway reload`` and ``gateway config show`` against a running gateway's admin API."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from gateway.cli import main
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "cli-admin-token"


def test_reload_and_config_show(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, tmp_path: Path
) -> None:
    config = base_config([upstream_url])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    runner = CliRunner()
    with gateway_factory(config, admin_token=TOKEN, config_path=path) as (app, server):
        args = ["--url", server.url, "--token", TOKEN]
        shown = runner.invoke(main, ["config", "show", *args])
        assert shown.exit_code == 0, shown.output
        version = app.state.holder.current.version
        assert f"# version {version}" in shown.output
        assert yaml.safe_load(shown.output)["models"][0]["name"] == "m1"

        same = runner.invoke(main, ["reload", *args])
        assert same.exit_code == 0 and f"config {version} unchanged" in same.output

        config["models"][0]["aliases"] = ["from-cli"]
        pushed = tmp_path / "pushed.yaml"
        pushed.write_text(yaml.safe_dump(config))
        changed = runner.invoke(main, ["reload", "--file", str(pushed), *args])
        assert changed.exit_code == 0 and "now live" in changed.output
        assert app.state.holder.current.version != version

        broken = tmp_path / "broken.yaml"
        broken.write_text("models: [unclosed\n")
        refused = runner.invoke(main, ["reload", "--file", str(broken), *args])
        assert refused.exit_code == 1 and "400" in refused.output and "not valid YAML" in refused.output

        denied = runner.invoke(main, ["config", "show", "--url", server.url, "--token", "wrong"])
        assert denied.exit_code == 1 and "403" in denied.output
