"""Helpers of the family export tests: a module's tiny checkpoints built once, a checkpoint's raw tensors and config
edited in place, its conversion with every producer run, a core directory's files (for byte-identity), and the checks
every family repeats: reproducible exports, refused configs and unexpected tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ignition.archs import convert, decode_weight_bytes
from ignition.errors import ExportError
from ignition.sources.hf import open_hf_dir


def variant_cache(root: Path, build, model):
    """The family tests' `tiny` fixture: variant -> (build(root / variant, variant), model(variant)), the checkpoint
    directory and the HF model that wrote it, each built on first use only."""
    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            cache[variant] = build(root / variant, variant), model(variant)
        return cache[variant]

    return get


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


def assert_runtime_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 0.0) -> None:
    """The converted float32 tensors are exactly `want` (the runtime layout computed from the HF modules); rtol > 0:
    within rtol of it (rows the converter rescales, rounded once in float32)."""
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous(), name
        if rtol:
            torch.testing.assert_close(got[name], t, atol=0, rtol=rtol, msg=name)
        else:
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


def assert_reproducible_export(path: Path, tmp_path: Path):
    """Two float32 exports of the checkpoint are byte-identical; the core loads with the converted architecture and
    its decode weight bytes. Returns the loaded core (for the family's own checks)."""
    from helios.core.load import load_core
    from ignition.export import export_core

    arch, _ = convert(open_hf_dir(path), torch.float32)
    a, b = export_core(path, tmp_path / "a"), export_core(path, tmp_path / "b")
    assert core_files(a) == core_files(b)
    core = load_core(a)
    assert core.manifest.arch == arch
    assert core.manifest.decode_weight_bytes == decode_weight_bytes(arch, "float32")
    return core


def assert_config_refused(src: Path, tmp_path: Path, edit, message: str) -> None:
    """A copy of the checkpoint whose text config went through `edit` (edit_config) fails to convert with an
    ExportError matching `message`."""
    path = shutil.copytree(src, tmp_path / "x")
    edit_config(path, edit)
    with pytest.raises(ExportError, match=message):
        convert(open_hf_dir(path), torch.float32)


def assert_tensor_refused(src: Path, tmp_path: Path, name: str, shape: tuple[int, ...]) -> None:
    """A copy of the checkpoint with one more tensor (zeros of `shape` under `name`) fails to convert: no place for
    it."""
    path = shutil.copytree(src, tmp_path / "x")
    write_tensors(path, {**raw_tensors(path), name: torch.zeros(shape)})
    with pytest.raises(ExportError, match=f"no place for: {name}"):
        convert(open_hf_dir(path), torch.float32)
