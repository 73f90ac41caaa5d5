"""Helpers of the family export tests: a tiny checkpoint's raw tensors and config edited in place, its conversion
with every producer run, and a core directory's files (for byte-identity)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ignition.archs import convert
from ignition.sources.hf import open_hf_dir


def raw_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, by name."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the checkpoint's weights with `tensors`, in one file."""
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def rewrite_tensors(path: Path, edit) -> None:
    """The checkpoint's tensors through `edit` (raw -> new raw)."""
    write_tensors(path, edit(raw_tensors(path)))


def edit_config(path: Path, edit) -> None:
    """Apply `edit` to config.json's text config (a multimodal wrapper's text_config, else the config)."""
    cfg = json.loads((path / "config.json").read_text())
    if "text_config" in cfg:
        cfg["text_config"] = edit(cfg["text_config"])
    else:
        cfg = edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def convert_all(path: Path, dtype=torch.float32):
    """(Architecture, {runtime name: tensor}) with every producer run."""
    arch, tensors = convert(open_hf_dir(path), dtype)
    return arch, {name: produce() for name, produce in tensors}


def core_files(path: Path) -> dict[str, bytes]:
    """A core directory's files by relative path (two exports of one source compare equal)."""
    return {f.relative_to(path).as_posix(): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}
