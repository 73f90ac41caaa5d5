"""ignition export end to end: reproducible bytes, inspect/verify, and one-line errors for bad input."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helios.core.load import CoreError, load_core
from ignition.export import ExportOptions, export_core

ROOT = Path(__file__).resolve().parents[2]
IGNITION = [sys.executable, "-m", "ignition.cli"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*IGNITION, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def tree_digest(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from tests.ignition.tiny_models import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("src") / "tiny-llama", seed=0, sharded=True)


def test_two_exports_are_byte_identical(tiny_llama, tmp_path):
    a = export_core(tiny_llama, tmp_path / "a", ExportOptions(prompt_logprobs=True))
    b = export_core(tiny_llama, tmp_path / "b", ExportOptions(prompt_logprobs=True))
    assert tree_digest(a) == tree_digest(b)
    manifest = (a / "core.toml").read_text()
    assert str(tmp_path) not in manifest and str(tiny_llama) not in manifest


def test_core_weights_equal_safetensors(tiny_llama, tmp_path):
    core = load_core(export_core(tiny_llama, tmp_path / "c"))
    src = {}
    for f in sorted(tiny_llama.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            src.update({k: st.get_tensor(k) for k in st.keys()})
    n = core.manifest.arch.num_heads * core.manifest.arch.head_dim
    for i in range(core.manifest.arch.num_layers):
        p = f"model.layers.{i}."
        qkv = core.tensors[f"layers.{i}.attn.qkv.weight"]
        torch.testing.assert_close(qkv[:n], src[p + "self_attn.q_proj.weight"].float(), rtol=0, atol=0)
        torch.testing.assert_close(core.tensors[f"layers.{i}.mlp.down.weight"], src[p + "mlp.down_proj.weight"].float(), rtol=0, atol=0)
    torch.testing.assert_close(core.tensors["embed.weight"], src["model.embed_tokens.weight"].float(), rtol=0, atol=0)


def test_manifest_records_options(tiny_llama, tmp_path):
    opts = ExportOptions(prompt_logprobs=True, max_top_logprobs=5, aliases=["tiny", "t2"], sampling_ranges=False)
    m = load_core(export_core(tiny_llama, tmp_path / "c", opts)).manifest
    assert m.logprobs.prompt_logprobs and m.logprobs.max_top_logprobs == 5 and m.logprobs.explicit_token_ids
    assert m.model.aliases == ["tiny", "t2"]
    assert m.dtype == "float32" and m.graph_plan.logprob_outputs == 5
    assert all(getattr(m.sampling.ranges, f) is None for f in m.sampling.ranges.__struct_fields__)
    assert m.vision.enabled is False


def test_flipped_byte_and_other_version_are_refused(tiny_llama, tmp_path):
    core = export_core(tiny_llama, tmp_path / "c")
    weights = next((core / "weights").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(CoreError, match="sha256"):
        load_core(core)
    # helios serve hashes while it builds the engine, and still refuses the core before serving anything
    from helios.server.config import ServerConfig
    from helios.compose import build_runtime

    with pytest.raises(CoreError, match="sha256"):
        build_runtime(core, ServerConfig(kv_cache_tokens=256))
    r = run_cli("verify", str(core))
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    other = export_core(tiny_llama, tmp_path / "v")
    text = (other / "core.toml").read_text().replace("format_version = 1", "format_version = 2")
    (other / "core.toml").write_text(text)
    with pytest.raises(CoreError, match="format version 2"):
        load_core(other)


def test_cli_errors_are_one_line_and_leave_nothing(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (broken / "config.json").unlink()
    unknown = tmp_path / "unknown"
    shutil.copytree(tiny_llama, unknown)
    cfg = (unknown / "config.json").read_text().replace('"llama"', '"mystery"')
    (unknown / "config.json").write_text(cfg)
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_llama, truncated)
    shard = sorted(truncated.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    for src, needle in [(broken, "config.json"), (unknown, "mystery"), (truncated, shard.name), (tmp_path / "nope", "no such")]:
        out = tmp_path / f"out-{src.name}"
        r = run_cli("export", str(src), "-o", str(out))
        assert r.returncode != 0, src
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert needle in r.stderr
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".out-{src.name}")]


def test_inspect_shows_the_core(tiny_llama, tmp_path):
    core = export_core(tiny_llama, tmp_path / "c", ExportOptions(prompt_logprobs=True))
    r = run_cli("inspect", str(core))
    assert r.returncode == 0, r.stderr
    for needle in ("llama", "prompt_logprobs=True", "decode_buckets", "weights/model.safetensors"):
        assert needle in r.stdout
    r = run_cli("verify", str(core))
    assert r.returncode == 0 and r.stdout.startswith("ok:")


@pytest.mark.parametrize("size", [0, 1, 7, 64, 1000])
def test_header_goes_in_front_of_the_data_chunk_by_chunk(tmp_path, size):
    from ignition.write import _prepend

    data = bytes(range(256)) * 4
    data = data[:size]
    src = tmp_path / ".data-0"
    src.write_bytes(data)
    _prepend(b"HEAD", src, tmp_path / "out", chunk=7)
    assert (tmp_path / "out").read_bytes() == b"HEAD" + data
    assert not src.exists()
    src.write_bytes(b"\0" * 5 + data)  # a reserved region of 5 bytes before the data: left out
    _prepend(b"HEAD", src, tmp_path / "out2", chunk=7, skip=5)
    assert (tmp_path / "out2").read_bytes() == b"HEAD" + data


@pytest.mark.parametrize("reserve", [1 << 18, 128])
def test_shards_hold_their_header_in_the_reserved_region_or_move_behind_a_larger_one(tmp_path, monkeypatch, reserve):
    """The data is written once behind HEADER_BYTES; the header, written into that region at close, is padded with
    spaces to fill it (the data starts at HEADER_BYTES); one that outgrows it moves the data behind it. Both read
    back with safetensors, tensor for tensor, and across two shards."""
    import torch
    from safetensors.torch import load_file

    from ignition import write

    monkeypatch.setattr(write, "HEADER_BYTES", reserve)
    monkeypatch.setattr(write, "SHARD_BYTES", 3000)
    tensors = {f"t{i:02d}": torch.arange(i * 40, i * 40 + 40 * (i % 3 + 1), dtype=torch.float32).view(-1, 4)
               for i in range(20)}
    tensors["b"] = torch.randn(3, 5).to(torch.bfloat16)
    writer = write._ShardWriter(tmp_path)
    for name, t in tensors.items():
        writer.add(name, t)
    names = writer.finish()
    assert len(names) > 1 and not list(tmp_path.glob(".data-*"))
    got = {}
    for name in names:
        raw = (tmp_path / name).read_bytes()
        header_len = int.from_bytes(raw[:8], "little")
        assert (8 + header_len) % write.ALIGN == 0
        assert (8 + header_len == reserve) == (reserve > 1000)  # the roomy region holds it; 128 bytes cannot
        got.update(load_file(tmp_path / name))
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
