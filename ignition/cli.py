"""The `ignition` command: export, build, inspect, verify. Errors are one line, never a traceback."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from helios.core.load import CoreError, load_core, read_manifest, verify_files
from ignition.errors import ExportError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Export checkpoints into helios cores.")
err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 160)


def _one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ExportError, CoreError) as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except OSError as exc:
            err.print(f"[red]error:[/red] {exc.strerror or exc}: {exc.filename or ''}", highlight=False)
            raise typer.Exit(1) from None

    return wrapper


def _export_with_progress(source: str, output: Path, options, force: bool) -> Path:
    from ignition.export import export_core

    with Progress(
        TextColumn("[bold]converting"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=False,
        disable=not sys.stderr.isatty(),
    ) as progress:
        task = progress.add_task("", total=None)

        def on_tensor(name: str, total: int) -> None:
            progress.update(task, total=total, advance=1, description=name)

        path = export_core(source, output, options, on_tensor=on_tensor, force=force)
    err.print(f"wrote core [bold]{path}[/bold]", highlight=False)
    return path


@app.command()
@_one_line_errors
def export(
    source: Annotated[str, typer.Argument(help="HF directory, GGUF file, or hub id in the local cache")],
    output: Annotated[Path, typer.Option("-o", "--output", help="core directory to write")],
    recipe: Annotated[str | None, typer.Option(help="recipe name (default: picked from the family)")] = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    target: Annotated[
        str, typer.Option(help="cpu | cuda-sm90 (precompiles the Triton kernels) | auto (the visible GPU, else cpu)")
    ] = "cpu",
    prompt_logprobs: Annotated[bool, typer.Option("--prompt-logprobs", help="prepare scored prefill")] = False,
    max_top_logprobs: Annotated[int, typer.Option(help="natural alternatives, 0..20")] = 20,
    no_sampling_ranges: Annotated[
        bool, typer.Option("--no-sampling-ranges", help="fix sampling parameters at their defaults")
    ] = False,
    alias: Annotated[list[str] | None, typer.Option("--alias", help="served model name (repeatable)")] = None,
    context_length: Annotated[int | None, typer.Option(help="cap the serving context")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace an existing output")] = False,
) -> None:
    """Export SOURCE into a prepared core."""
    from ignition.export import ExportOptions

    options = ExportOptions(
        recipe=recipe,
        dtype=dtype,
        target=target,
        prompt_logprobs=prompt_logprobs,
        max_top_logprobs=max_top_logprobs,
        sampling_ranges=not no_sampling_ranges,
        aliases=alias or [],
        context_length=context_length,
    )
    _export_with_progress(source, output, options, force)


@app.command()
@_one_line_errors
def build(
    spec: Annotated[Path, typer.Argument(help="cores/NAME.toml")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="override the spec's output")] = None,
    force: Annotated[bool, typer.Option("--force", help="accepted for symmetry: a build replaces its output")] = True,
) -> None:
    """Fetch the source a build file names and export it (replacing the previous build)."""
    from ignition.build import load_spec, repo_root, resolve_source

    parsed = load_spec(spec)
    root = repo_root(spec)
    source = resolve_source(parsed, root)
    target = output if output is not None else root / parsed.output
    _export_with_progress(source, target, parsed.export, force=True)


@app.command()
@_one_line_errors
def inspect(core: Annotated[Path, typer.Argument(help="core directory")]) -> None:
    """Show what a core holds."""
    m = read_manifest(core)
    table = Table(title=f"core {core}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    a = m.arch
    rows = [
        ("format", f"v{m.format_version} (ignition {m.ignition_version})"),
        ("model", f"{m.model.id}  aliases: {', '.join(m.model.aliases) or '-'}"),
        ("source sha256", m.model.source_sha256),
        ("family", f"{a.family}  dtype {m.dtype}  recipe {m.recipe.name}"),
        (
            "dims",
            f"layers {a.num_layers}  hidden {a.hidden_size}  ffn {a.intermediate_size}  heads "
            f"{a.num_heads}/{a.num_kv_heads}  head_dim {a.head_dim}  vocab {a.vocab_size}",
        ),
        ("rope", f"theta {a.rope_theta}  scaling {a.rope_scaling.type if a.rope_scaling else '-'}"),
        ("tokenizer", _fmt(m.tokenizer)),
        ("template", _fmt(m.template)),
        ("sampling defaults", _fmt(m.sampling.defaults)),
        ("sampling ranges", _fmt(m.sampling.ranges) or "none: every parameter fixed at its default"),
        ("logprobs", _fmt(m.logprobs)),
        ("vision", "on" if m.vision.enabled else "off"),
        ("limits", _fmt(m.limits)),
        ("graph plan", _fmt(m.graph_plan)),
        ("decode weight bytes", f"{m.decode_weight_bytes:,}"),
        ("kernels", ", ".join(k.target for k in m.kernels) or "none (compiled on first use)"),
        ("files", "\n".join(f"{f.path}  {f.size:,} B  {f.sha256[:16]}" for f in m.files)),
    ]
    for key, value in rows:
        table.add_row(key, value)
    out.print(table)


def _fmt(struct) -> str:
    data = msgspec.to_builtins(struct)
    return "  ".join(f"{k}={v}" for k, v in data.items() if v is not None)


@app.command()
@_one_line_errors
def verify(core: Annotated[Path, typer.Argument(help="core directory")]) -> None:
    """Check a core's format version, files and digests, and that its weights map."""
    manifest = read_manifest(core)
    verify_files(core, manifest, digests=True)
    loaded = load_core(core, verify_digests=False)
    out.print(f"ok: {core} ({len(manifest.files)} files, {len(loaded.tensors)} tensors, format v{manifest.format_version})")


if __name__ == "__main__":
    app()
