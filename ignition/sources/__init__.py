"""Checkpoint readers: an HF directory, a GGUF file, or a hub id from the local cache -> Checkpoint."""

from __future__ import annotations

from pathlib import Path

from ignition.errors import ExportError
from ignition.sources.base import Checkpoint, LazyTensor

__all__ = ["Checkpoint", "LazyTensor", "open_source"]


def open_source(source: str | Path) -> Checkpoint:
    """Dispatch on what `source` names; never downloads."""
    path = Path(source)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _is_gguf(path):
            from ignition.sources.gguf import open_gguf

            return open_gguf(path)
        raise ExportError(f"{path}: not a GGUF file or checkpoint directory")
    if path.is_dir():
        from ignition.sources.hf import open_hf_dir

        return open_hf_dir(path)
    text = str(source)
    looks_like_path = text.startswith((".", "/", "~")) or text.endswith(".gguf") or text.count("/") > 1
    if looks_like_path:
        raise ExportError(f"{text}: no such file or directory")
    from ignition.sources.hub import open_hub_id

    return open_hub_id(text)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
