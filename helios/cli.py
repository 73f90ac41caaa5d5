"""`helios serve CORE`: serve a prepared core over HTTP (Granian, one worker process that owns the engine).

The parent checks the configuration and the manifest (one clear line on failure) and hands the core path
to Granian's worker through the environment; the worker's app factory loads, warms up and reports the
start-up time split. No torch here: the worker imports the torch side through helios.server.runtime.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help="helios: serve prepared Flare cores.")


@app.callback()
def main() -> None:
    """helios: the Flare runtime."""


def _fail(message: str) -> None:
    typer.echo(f"helios: {message}", err=True)
    raise typer.Exit(2)


@app.command()
def serve(
    core: Annotated[Path, typer.Argument(help="A core directory built by ignition.")],
    config: Annotated[Path | None, typer.Option("--config", help="helios.toml with a [server] table.")] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1 or [server] host).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000 or [server] port).")] = None,
    api_key_file: Annotated[
        Path | None, typer.Option("--api-key-file", help="File holding the serving key; overrides api_key.")
    ] = None,
    no_prefix_cache: Annotated[
        bool, typer.Option("--no-prefix-cache", help="Turn the prefix cache off (overrides prefix_caching).")
    ] = False,
    log_level: Annotated[str, typer.Option(help="Granian log level.")] = "warning",
) -> None:
    """Serve CORE on HTTP: OpenAI Chat Completions, Completions, models, /health and /metrics."""
    import msgspec

    from helios.core.manifest import MANIFEST_FILE, decode_manifest
    from helios.server.app import ENV_CONFIG, ENV_CORE, ENV_HOST, ENV_KEY_FILE, ENV_NO_PREFIX_CACHE, ENV_PORT
    from helios.server.config import ConfigError, load_config
    from helios.server.runtime import resolve_serving

    try:
        server = load_config(config).server
    except ConfigError as e:
        _fail(str(e))
    manifest_path = core / MANIFEST_FILE
    if not manifest_path.is_file():
        _fail(f"{core}: not a core (no {MANIFEST_FILE}); build one with `ignition build` or `make core`")
    try:
        manifest = decode_manifest(manifest_path.read_bytes())
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        _fail(f"{manifest_path}: invalid manifest: {e}")
    try:
        resolve_serving(manifest, server)  # the start-up checks that need only the manifest
    except ValueError as e:
        _fail(f"{config}: {e}")
    if api_key_file is not None and not api_key_file.is_file():
        _fail(f"--api-key-file {api_key_file}: no such file")
    host = host or server.host
    port = server.port if port is None else port
    os.environ[ENV_CORE] = str(core.resolve())
    os.environ[ENV_HOST] = host
    os.environ[ENV_PORT] = str(port)
    if config is not None:
        os.environ[ENV_CONFIG] = str(config.resolve())
    if api_key_file is not None:
        os.environ[ENV_KEY_FILE] = str(api_key_file.resolve())
    if no_prefix_cache:
        os.environ[ENV_NO_PREFIX_CACHE] = "1"

    from granian import Granian
    from granian.constants import Interfaces

    # NOTE: one worker: the engine (and its KV pool) lives in exactly one process.
    Granian(
        "helios.server.app:create_app",
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        factory=True,
        log_level=log_level,
        log_access=False,
        websockets=False,
    ).serve()
    sys.exit(0)


if __name__ == "__main__":
    app()
