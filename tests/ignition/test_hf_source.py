"""ignition.sources.hf / hub: HF directories and the local hub cache -> Checkpoint, and their failure modes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ignition.errors import ExportError
from ignition.sources.hf import looks_like_hub_id, open_hf_dir
from ignition.sources.hub import open_hub_id
from tests.ignition.tiny_models import CHATML_TEMPLATE, build_tiny


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "single": build_tiny("qwen2", root / "single"),
        "sharded": build_tiny("qwen2", root / "sharded", sharded=True),
        "bf16": build_tiny("llama", root / "bf16", dtype=torch.bfloat16),
    }


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _raw(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_tensors_match_safetensors(tiny_dirs, kind):
    path = tiny_dirs[kind]
    ckpt = open_hf_dir(path)
    raw = _raw(path)
    assert sorted(ckpt.tensors) == sorted(raw)
    for name, lazy in ckpt.iter_tensors():
        t = lazy.load()
        assert lazy.shape == tuple(raw[name].shape) and lazy.dtype == "float32"
        assert t.dtype == torch.float32 and torch.equal(t, raw[name])


def test_sharded_equals_single(tiny_dirs):
    a, b = open_hf_dir(tiny_dirs["single"]), open_hf_dir(tiny_dirs["sharded"])
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        assert torch.equal(a.tensors[name].load(), b.tensors[name].load())
    shards = [p.name for p in b.source_files if p.name.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in {p.name for p in b.source_files}


def test_load_keeps_source_dtype(tiny_dirs):
    ckpt = open_hf_dir(tiny_dirs["bf16"])
    lazy = ckpt.tensors["model.embed_tokens.weight"]
    assert lazy.dtype == "bfloat16" and lazy.load().dtype == torch.bfloat16


def test_metadata_files(tiny_dirs):
    path = tiny_dirs["single"]
    ckpt = open_hf_dir(path)
    assert ckpt.config["model_type"] == "qwen2"
    assert json.loads(ckpt.tokenizer_json)["model"]["type"] == "BPE"
    assert ckpt.chat_template == CHATML_TEMPLATE
    assert "chat_template" not in ckpt.tokenizer_config
    assert ckpt.tokenizer_config["eos_token"] == "<|im_end|>"
    assert ckpt.generation_config["eos_token_id"] == 2
    assert ckpt.identifier == "single"
    names = [p.name for p in ckpt.source_files]
    assert names == sorted(names)
    assert set(names) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"}
    assert ckpt.source_files == sorted(ckpt.source_files)


def test_chat_template_jinja_wins_and_named_templates(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "chat_template.jinja").write_text("JINJA {{ messages }}")
    ckpt = open_hf_dir(path)
    assert ckpt.chat_template == "JINJA {{ messages }}"
    assert path / "chat_template.jinja" in ckpt.source_files

    (path / "chat_template.jinja").unlink()
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tc["bos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    ckpt = open_hf_dir(path)
    assert ckpt.chat_template == "D"
    assert ckpt.tokenizer_config["bos_token"] == "<|endoftext|>"


def test_no_template_no_optional_files(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "tokenizer_config.json").unlink()
    (path / "generation_config.json").unlink()
    ckpt = open_hf_dir(path)
    assert ckpt.chat_template is None and ckpt.tokenizer_config == {} and ckpt.generation_config == {}


@pytest.mark.parametrize(
    ("name_or_path", "expected"),
    [("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"), ("/tmp/some/dir", "m"), ("./x/y", "m"),
     ("a/b/c", "m"), ("plain", "m")],
)
def test_identifier_rule(tiny_dirs, tmp_path, name_or_path, expected):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["_name_or_path"] = name_or_path
    (path / "config.json").write_text(json.dumps(config))
    assert open_hf_dir(path).identifier == expected


def test_looks_like_hub_id():
    assert looks_like_hub_id("google/gemma-3-1b-it") and looks_like_hub_id("HuggingFaceTB/SmolLM2-135M")
    for bad in ("gemma", "/abs/path", "./rel/x", "a/b/c", "a/../b", "~/x", "org/"):
        assert not looks_like_hub_id(bad), bad


# ---- bad input ---------------------------------------------------------------------------------------------


def test_missing_config(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(ExportError, match=r"m: no config\.json"):
        open_hf_dir(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(ExportError, match="not a directory"):
        open_hf_dir(tmp_path / "absent")


def test_missing_tokenizer(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match=r"no tokenizer\.json"):
        open_hf_dir(path)


def test_bad_config_json(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ExportError, match=r"config\.json: not valid JSON"):
        open_hf_dir(path)


def _cut_in_half(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_truncated_single_file(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    _cut_in_half(path / "model.safetensors")
    with pytest.raises(ExportError, match=r"model\.safetensors: truncated safetensors file"):
        open_hf_dir(path)


def test_truncated_shard(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["sharded"], tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    _cut_in_half(shard)
    with pytest.raises(ExportError, match=f"{shard.name}: truncated"):
        open_hf_dir(path)


@pytest.mark.parametrize("content", [b"", b"\x01\x02", (10**6).to_bytes(8, "little") + b"{}"])
def test_truncated_header(tiny_dirs, tmp_path, content):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "model.safetensors").write_bytes(content)
    with pytest.raises(ExportError, match=r"model\.safetensors: truncated"):
        open_hf_dir(path)


def test_corrupt_header(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{nope")
    with pytest.raises(ExportError, match="corrupt safetensors header"):
        open_hf_dir(path)


def test_missing_shard(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["sharded"], tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ExportError, match=f"shard '{shard.name}' is missing"):
        open_hf_dir(path)


def test_index_names_absent_tensor(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["sharded"], tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = sorted(index["weight_map"].values())[0]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ExportError, match="lacks tensor 'model.extra.weight'"):
        open_hf_dir(path)


def test_no_weights_or_only_bin(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs["single"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ExportError, match=r"no model\.safetensors"):
        open_hf_dir(path)
    (path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ExportError, match="safetensors only"):
        open_hf_dir(path)


# ---- the local hub cache -------------------------------------------------------------------------------------


def _fake_cache(root: Path, repo_id: str, src: Path, revision: str = "0123456789abcdef0123456789abcdef01234567"):
    """The huggingface_hub cache layout: models--org--name/{refs/main, snapshots/<rev>/...} (blobs skipped)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(src, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def test_hub_id_from_cache(tiny_dirs, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = _fake_cache(cache, "acme/tiny-qwen2", tiny_dirs["single"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    ckpt = open_hub_id("acme/tiny-qwen2")
    assert ckpt.identifier == "acme/tiny-qwen2"
    assert all(p.parent == snapshot for p in ckpt.source_files)
    raw = _raw(tiny_dirs["single"])
    assert torch.equal(ckpt.tensors["lm_head.weight"].load(), raw["lm_head.weight"])


def test_hub_id_via_hf_home(tiny_dirs, tmp_path, monkeypatch):
    _fake_cache(tmp_path / "home" / "hub", "acme/tiny-qwen2", tiny_dirs["single"])
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert open_hub_id("acme/tiny-qwen2").identifier == "acme/tiny-qwen2"


def test_hub_id_not_cached(tiny_dirs, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    _fake_cache(cache, "acme/other", tiny_dirs["single"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ExportError) as e:
        open_hub_id("acme/absent-model")
    msg = str(e.value)
    assert "model 'acme/absent-model' is not in the local Hugging Face cache" in msg
    assert str(cache) in msg and "never downloads" in msg and "pass a directory" in msg


def test_hub_id_unknown_revision(tiny_dirs, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    _fake_cache(cache, "acme/tiny-qwen2", tiny_dirs["single"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ExportError, match="not in the local Hugging Face cache"):
        open_hub_id("acme/tiny-qwen2", revision="dev")


def test_hub_id_invalid(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ExportError, match="repo id"):
        open_hub_id("not a repo")


def test_open_source_dispatch(tiny_dirs, tmp_path, monkeypatch):
    from ignition.sources import open_source

    assert open_source(tiny_dirs["single"]).identifier == "single"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ExportError, match="not in the local Hugging Face cache"):
        open_source("acme/nothing-here")
