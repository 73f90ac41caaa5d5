"""`helios serve CORE`: serve a prepared core over HTTP (Granian embedded in this process, which owns the engine);
`helios top [URL]`: the serving terminal dashboard over a server's /metrics.

`serve` checks the configuration and the manifest (one clear line on failure), applies the command line's
overrides to the ServerConfig and hands it to the composition root (helios/compose.py), which builds core ->
runner -> engine -> app and serves; settings travel as arguments. No torch here (compose imports it lazily).
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
    tensor_parallel: Annotated[
        int | None, typer.Option("--tensor-parallel", min=1, help="Split the model over N ranks (GPUs) by tensor "
                                 "parallelism (default 1 or [server] tensor_parallel).")
    ] = None,
    kv_events_config: Annotated[
        str | None, typer.Option("--kv-events-config", help="vLLM's KV events JSON, e.g. "
                                 "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                 "\"topic\": \"kv@POD@MODEL\"}'; overrides the config's server.kv_events table; "
                                 "needs pyzmq (the kv-events extra).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="Granian log level.")] = "warning",
    engine_samples: Annotated[
        Path | None, typer.Option("--engine-samples", help="Sample the engine thread's stack every 5 ms and write "
                                  "where its time went to this file at exit (a statistical profile).")
    ] = None,
) -> None:
    """Serve CORE on HTTP: OpenAI Chat Completions, Completions, models, /health and /metrics."""
    from helios.server.startup import Timeline

    timeline = Timeline()  # the ready line's split, from this process's start
    timeline.mark("cli")
    import msgspec

    from helios.core.manifest import MANIFEST_FILE, decode_manifest
    from helios.server.config import ConfigError, KVEventsConfig, load_config
    from helios.server.runtime import resolve_serving
    from helios.switches import SwitchError, Switches

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
    try:
        switches = Switches.from_environ(os.environ)  # the execution switches, read once, then passed down
    except SwitchError as e:
        _fail(str(e))
    if api_key_file is not None and not api_key_file.is_file():
        _fail(f"--api-key-file {api_key_file}: no such file")
    overrides: dict = {"host": host or server.host, "port": server.port if port is None else port}
    if api_key_file is not None:
        try:
            overrides["api_key"] = api_key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            _fail(f"--api-key-file {api_key_file}: {e}")
    if no_prefix_cache:
        overrides["prefix_caching"] = False
    if tensor_parallel is not None:
        overrides["tensor_parallel"] = tensor_parallel
    if kv_events_config is not None:
        try:
            overrides["kv_events"] = msgspec.json.decode(kv_events_config, type=KVEventsConfig)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            _fail(f"--kv-events-config: {e}")
    server = msgspec.structs.replace(server, **overrides)
    timeline.mark("checks")

    from helios.compose import serve as serve_core

    timeline.mark("compose")
    sys.exit(serve_core(core.resolve(), server, switches, log_level=log_level, timeline=timeline,
                        engine_samples=engine_samples))


class _FetchError(Exception):
    """One line on why /metrics gave no Snapshot (unreachable, an HTTP error, not the JSON object)."""


def _fetch_snapshot(url: str, timeout_s: float):
    """GET URL/metrics?format=json decoded into a Snapshot (stdlib HTTP: httpx is only a test dependency)."""
    import urllib.error
    import urllib.request

    import msgspec

    from helios.server.metrics import Snapshot

    metrics_url = url.rstrip("/") + "/metrics?format=json"
    request = urllib.request.Request(metrics_url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        raise _FetchError(f"{metrics_url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise _FetchError(f"cannot reach {metrics_url}: {e.reason}") from None
    except (OSError, ValueError) as e:  # timeouts, resets mid-body, a malformed URL
        raise _FetchError(f"cannot reach {metrics_url}: {e}") from None
    try:
        return msgspec.json.decode(body, type=Snapshot)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _FetchError(f"{metrics_url}: not a helios metrics object ({e})") from None


@app.command()
def top(
    url: Annotated[str, typer.Argument(help="The server's base URL.")] = "http://127.0.0.1:8000",
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between polls of /metrics.")] = 1.0,
    window: Annotated[float, typer.Option(min=1.0, help="Sampling window of the rates, in seconds.")] = 60.0,
    once: Annotated[bool, typer.Option("--once", help="Two samples INTERVAL apart, one frame, then exit.")] = False,
) -> None:
    """Watch a helios server: tok/s, WEIGHTS, DEPTH, KV pages and admission, polled from /metrics?format=json."""
    import time

    from rich.console import Console
    from rich.live import Live

    from helios.server.view import RateHistory, render_frame

    history = RateHistory(window_s=window)
    timeout_s = max(2.0, min(interval, 10.0))
    if once:
        for i in range(2):
            if i:
                time.sleep(interval)
            try:
                snap = _fetch_snapshot(url, timeout_s)
            except _FetchError as e:
                typer.echo(f"helios top: {e}", err=True)
                raise typer.Exit(1) from None
            history.add(time.monotonic(), snap)
        console = Console()
        console.print(render_frame(history, url, width=console.width))
        return
    error = None
    try:
        with Live(auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                try:
                    snap = _fetch_snapshot(url, timeout_s)
                    history.add(time.monotonic(), snap)
                    error = None
                except _FetchError as e:
                    error = f"{e} (retrying every {interval:g} s)"
                # the console width is read per frame, so the layout follows a resized terminal
                live.update(render_frame(history, url, error, width=live.console.width), refresh=True)
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    app()
