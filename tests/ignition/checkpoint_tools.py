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


def assert_runtime_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The converted float32 tensors are exactly `want` (the runtime layout computed from the HF modules)."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous(), name
        assert torch.equal(got[name], t), name


def swiglu_ffn_expected(prefix: str, ffn) -> dict[str, torch.Tensor]:
    """The runtime tensors (names under `prefix`, "layers.L.") of an HF SwiGLU feed-forward: a sigmoid-routed MoE
    block (gate.weight and its e_score_correction_bias, stacked experts, one shared_experts MLP) as moe.*, else a
    dense gate/up/down MLP as mlp.*."""
    if not hasattr(ffn, "experts"):
        return {prefix + "mlp.gate_up.weight": _gate_up(ffn), prefix + "mlp.down.weight": ffn.down_proj.weight}
    shared = ffn.shared_experts
    return {prefix + "moe.router.weight": ffn.gate.weight, prefix + "moe.router.bias": ffn.gate.e_score_correction_bias,
            prefix + "moe.gate_up.weight": ffn.experts.gate_up_proj, prefix + "moe.down.weight": ffn.experts.down_proj,
            prefix + "moe.shared.gate_up.weight": _gate_up(shared),
            prefix + "moe.shared.down.weight": shared.down_proj.weight}


def _gate_up(mlp) -> torch.Tensor:
    """An HF SwiGLU MLP's rows [gate; up]: its fused gate_up_proj (minimax_m3), or gate_proj's and up_proj's."""
    if hasattr(mlp, "gate_up_proj"):
        return mlp.gate_up_proj.weight
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
