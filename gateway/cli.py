"""The ``gateway`` command: serve, check-config, model prepare."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gateway.config import ConfigError, load_config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """An OpenAI-compatible gateway in front of vLLM workers."""


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="config.yaml (GATEWAY_CONFIG_PATH)")
@click.option("--host", help="bind address (GATEWAY_HOST)")
@click.option("--port", type=int, help="port (GATEWAY_PORT)")
@click.option("--workers", type=int, help="uvicorn worker processes (GATEWAY_WORKERS)")
@click.option("--no-managed-workers", is_flag=True, help="do not start the engine workers in config.yaml")
def serve(
    config_path: Path | None, host: str | None, port: int | None, workers: int | None, no_managed_workers: bool
) -> None:
    """Run the gateway (uvicorn with uvloop and httptools)."""
    import os

    import uvicorn

    from gateway.logs import configure_logging
    from gateway.settings import Settings

    overrides = {"config_path": config_path, "host": host, "port": port, "workers": workers}
    for key, value in overrides.items():
        if value is not None:
            os.environ[f"GATEWAY_{key.upper()}"] = str(value)
    if no_managed_workers:
        os.environ["GATEWAY_MANAGED_WORKERS"] = "false"
    settings = Settings()
    try:
        config = load_config(settings.config_path)
    except ConfigError as exc:
        raise click.ClickException("config is not valid:\n  " + "\n  ".join(exc.problems)) from None
    configure_logging(settings.log_level or config.logging.level, access_log=config.logging.access_log)
    uvicorn.run(
        "gateway.asgi:app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop",
        http="httptools",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=30,
        lifespan="on",
    )


@main.command("check-config")
@click.argument("path", type=click.Path(path_type=Path))
def check_config(path: Path) -> None:
    """Validate a config file (and every plugin's section) without starting anything."""
    from gateway.config import config_version
    from gateway.registry import PluginRegistry
    from gateway.validate import resolve_plugins

    try:
        config = load_config(path)
        resolve_plugins(config, PluginRegistry())
    except ConfigError as exc:
        click.echo(f"{path}: not valid", err=True)
        for problem in exc.problems:
            click.echo(f"  {problem}", err=True)
        sys.exit(1)
    click.echo(
        f"{path}: ok (version {config_version(config)}, {len(config.models)} models, "
        f"{sum(p.enabled for p in config.plugins)} plugins)"
    )


if __name__ == "__main__":
    main()
