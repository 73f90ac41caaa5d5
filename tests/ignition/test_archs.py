"""ignition.archs: HF checkpoints of every family -> Architecture + runtime tensors (helios/core/layout.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ignition.archs import SUPPORTED_MODEL_TYPES, convert, decode_weight_bytes, num_params
from ignition.errors import ExportError
from ignition.sources.hf import open_hf_dir
from tests.ignition.tiny_models import FAMILIES, build_tiny, tiny_config, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    cache: dict = {}

    def get(family: str, sharded: bool = False, dtype=torch.float32) -> Path:
        key = (family, sharded, dtype)
        if key not in cache:
            cache[key] = build_tiny(family, root / f"{family}-{sharded}-{str(dtype)[6:]}", sharded=sharded, dtype=dtype)
        return cache[key]

    return get


def _raw(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _convert(path: Path, dtype=torch.float32):
    arch, tensors = convert(open_hf_dir(path), dtype)
    names = []
    out = {}
    for name, produce in tensors:
        names.append(name)
        out[name] = produce()
    assert names == sorted(names)
    return arch, out


def _expected(family: str, raw: dict, cfg) -> dict[str, torch.Tensor]:
    """The runtime layout written out by hand from the HF tensors, independently of ignition.archs."""
    gemma = family == "gemma3"
    norm = (lambda w: (w.float() + 1).to(w.dtype)) if gemma else (lambda w: w)
    m = lambda n: raw["model." + n]  # noqa: E731
    out = {"embed.weight": m("embed_tokens.weight"), "norm.weight": norm(m("norm.weight"))}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = raw["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        a, p, L = f"layers.{i}.self_attn.", f"layers.{i}.mlp.", f"layers.{i}."
        out[L + "attn.qkv.weight"] = torch.cat([m(a + "q_proj.weight"), m(a + "k_proj.weight"), m(a + "v_proj.weight")])
        if family == "qwen2":
            out[L + "attn.qkv.bias"] = torch.cat([m(a + "q_proj.bias"), m(a + "k_proj.bias"), m(a + "v_proj.bias")])
        if family in ("qwen3", "qwen3_moe", "gemma3"):
            out[L + "attn.q_norm.weight"] = norm(m(a + "q_norm.weight"))
            out[L + "attn.k_norm.weight"] = norm(m(a + "k_norm.weight"))
        out[L + "attn.o.weight"] = m(a + "o_proj.weight")
        out[L + "attn_norm.weight"] = norm(m(L + "input_layernorm.weight"))
        if gemma:
            out[L + "attn_post_norm.weight"] = norm(m(L + "post_attention_layernorm.weight"))
            out[L + "mlp_norm.weight"] = norm(m(L + "pre_feedforward_layernorm.weight"))
            out[L + "mlp_post_norm.weight"] = norm(m(L + "post_feedforward_layernorm.weight"))
        else:
            out[L + "mlp_norm.weight"] = m(L + "post_attention_layernorm.weight")
        if family == "qwen3_moe" and i not in cfg.mlp_only_layers:
            E = cfg.num_experts
            out[L + "moe.router.weight"] = m(p + "gate.weight")
            gate_up = [torch.cat([m(f"{p}experts.{e}.{n}_proj.weight") for n in ("gate", "up")]) for e in range(E)]
            out[L + "moe.gate_up.weight"] = torch.stack(gate_up)
            out[L + "moe.down.weight"] = torch.stack([m(f"{p}experts.{e}.down_proj.weight") for e in range(E)])
        else:
            out[L + "mlp.gate_up.weight"] = torch.cat([m(p + "gate_proj.weight"), m(p + "up_proj.weight")])
            out[L + "mlp.down.weight"] = m(p + "down_proj.weight")
    return out


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_tensors_equal_sources(tiny, family, sharded):
    path = tiny(family, sharded)
    cfg = tiny_config(family)
    _, got = _convert(path)
    want = _expected(family, _raw(path), cfg)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous(), name
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("family", FAMILIES)
def test_architecture_matches_config(tiny, family):
    cfg = tiny_config(family)
    arch, got = _convert(tiny(family))
    assert arch.family == family
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == (
        cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim if family != "qwen2" else 16)
    assert arch.rms_norm_eps == cfg.rms_norm_eps and arch.max_position_embeddings == cfg.max_position_embeddings
    assert arch.tie_word_embeddings == cfg.tie_word_embeddings
    assert ("lm_head.weight" in got) == (not cfg.tie_word_embeddings)
    assert arch.attention_bias == (family == "qwen2")
    assert arch.qk_norm == (family in ("qwen3", "qwen3_moe", "gemma3"))
    assert arch.sandwich_norms == (family == "gemma3")
    rope = cfg.rope_parameters["full_attention"] if family == "gemma3" else cfg.rope_parameters
    assert arch.rope_theta == rope["rope_theta"]
    assert num_params(arch) == tiny_model(family).num_parameters() == sum(t.numel() for t in got.values())
    if family == "llama":
        s = arch.rope_scaling
        assert (s.type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (
            "llama3", 8.0, 1.0, 4.0, 64)
    else:
        assert arch.rope_scaling is None
    if family == "gemma3":
        assert arch.hidden_act == "gelu_tanh"
        assert arch.embedding_scale == 8.0 and arch.query_scale == 24**-0.5
        assert arch.layer_types == ["sliding", "full"] and arch.sliding_window == 8
        assert arch.rope_local_theta == 10000.0 and arch.rope_theta == 1e6
    else:
        assert arch.hidden_act == "silu" and arch.embedding_scale is None and arch.query_scale is None
        assert arch.layer_types == [] and arch.sliding_window is None
    if family == "qwen3_moe":
        moe = arch.moe
        assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
        assert moe.norm_topk_prob is True and moe.dense_layers == [1]
    else:
        assert arch.moe is None


def test_cast_to_bfloat16(tiny):
    raw = _raw(tiny("gemma3"))
    arch, got = _convert(tiny("gemma3"), torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    w = raw["model.layers.0.input_layernorm.weight"]
    assert torch.equal(got["layers.0.attn_norm.weight"], (w.float() + 1).to(torch.bfloat16))
    assert torch.equal(got["embed.weight"], raw["model.embed_tokens.weight"].to(torch.bfloat16))


def test_bfloat16_source_to_float32_is_exact(tiny):
    path = tiny("llama", dtype=torch.bfloat16)
    raw = _raw(path)
    _, got = _convert(path, torch.float32)
    q, k, v = (raw[f"model.layers.1.self_attn.{p}_proj.weight"].float() for p in "qkv")
    assert torch.equal(got["layers.1.attn.qkv.weight"], torch.cat([q, k, v]))


def test_gemma_embedding_scale_is_rounded_to_dtype(tmp_path):
    # HF multiplies by sqrt(hidden) cast to the weight dtype: sqrt(80) = 8.944 is 8.9375 in bfloat16
    path = build_tiny("gemma3", tmp_path / "g", hidden_size=80)
    assert convert(open_hf_dir(path), torch.bfloat16)[0].embedding_scale == 8.9375
    assert convert(open_hf_dir(path), torch.float32)[0].embedding_scale == pytest.approx(80**0.5, rel=1e-7)


def test_producers_are_lazy(tiny):
    ckpt = open_hf_dir(tiny("qwen3"))
    loads = []
    for name, lazy in ckpt.tensors.items():
        original = lazy.load
        lazy.load = lambda original=original, name=name: (loads.append(name), original())[1]
    _, tensors = convert(ckpt, torch.float32)
    assert loads == []
    name, produce = next(tensors)
    assert name == "embed.weight" and loads == []
    produce()
    assert loads == ["model.embed_tokens.weight"]


def test_decode_weight_bytes(tiny):
    arch, _ = _convert(tiny("qwen3_moe"))
    h, v, d, L = 64, 300, 16, 2
    attn = 2 * h + (4 + 2 * 2) * d * h + h * 4 * d + 2 * d  # norms, qkv, o, q/k norms
    dense = 3 * h * 128  # layer 1
    moe_read = 4 * h + 2 * 3 * h * 32  # layer 0: router + top-2 experts of 4
    n = h + v * h + h + L * attn + dense + moe_read  # embedding row, lm_head, final norm, layers
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n
    assert decode_weight_bytes(arch, "float32") == 4 * n
    # tied: the table is read once as the lm_head matmul, plus the gathered row
    tied, _ = _convert(tiny("llama"))
    assert decode_weight_bytes(tied, torch.float32) == 4 * (num_params(tied) + h)  # + the gathered row


# ---- checkpoint variants -------------------------------------------------------------------------------------


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(edit(cfg)))


def _rewrite_tensors(path: Path, edit) -> None:
    raw = _raw(path)
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    save_file(edit(raw), str(path / "model.safetensors"))


def test_gemma3_multimodal_wrapper(tiny, tmp_path):
    src = tiny("gemma3")
    _, want = _convert(src)
    for layout in ("language_model.model.", "model.language_model."):
        path = shutil.copytree(src, tmp_path / layout.strip("."))
        text = json.loads((path / "config.json").read_text())
        _edit_config(path, lambda c: {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 8}})

        def rename(raw):
            out = {layout + k[len("model."):]: v for k, v in raw.items()}
            out["vision_tower.vision_model.patch.weight"] = torch.zeros(2, 2)
            out["multi_modal_projector.proj.weight"] = torch.zeros(2, 2)
            return out

        _rewrite_tensors(path, rename)
        arch, got = _convert(path)
        assert arch.family == "gemma3" and sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_gemma3_legacy_config(tiny, tmp_path):
    path = shutil.copytree(tiny("gemma3"), tmp_path / "g")

    def legacy(c):
        for k in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
            c.pop(k, None)
        return {**c, "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 2,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}}

    _edit_config(path, legacy)
    arch, _ = _convert(path)
    assert arch.layer_types == ["sliding", "full"] and arch.rope_local_theta == 10000.0
    assert arch.rope_scaling.type == "linear" and arch.rope_scaling.factor == 8.0


def test_llama_legacy_rope_config(tiny, tmp_path):
    path = shutil.copytree(tiny("llama"), tmp_path / "l")
    want, _ = _convert(path)

    def legacy(c):
        rp = c.pop("rope_parameters")
        return {**c, "rope_theta": rp.pop("rope_theta"), "rope_scaling": rp}

    _edit_config(path, legacy)
    got, _ = _convert(path)
    assert got == want


def test_qwen3_moe_fused_experts(tiny, tmp_path):
    path = shutil.copytree(tiny("qwen3_moe"), tmp_path / "m")
    _, want = _convert(path)

    def fuse(raw):
        p = "model.layers.0.mlp.experts."
        gate_up = torch.stack([torch.cat([raw.pop(f"{p}{e}.gate_proj.weight"), raw.pop(f"{p}{e}.up_proj.weight")])
                               for e in range(4)])
        down = torch.stack([raw.pop(f"{p}{e}.down_proj.weight") for e in range(4)])
        return {**raw, p + "gate_up_proj": gate_up, p + "down_proj": down}

    _rewrite_tensors(path, fuse)
    _, got = _convert(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_transformers_5_num_local_experts_alias(tiny, tmp_path):
    path = shutil.copytree(tiny("qwen3_moe"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert "num_local_experts" in cfg  # what transformers 5 writes
    _edit_config(path, lambda c: {**{k: v for k, v in c.items() if k != "num_local_experts"}, "num_experts": 4})
    arch, _ = _convert(path)
    assert arch.moe.num_experts == 4


# ---- bad input -----------------------------------------------------------------------------------------------


def test_unknown_model_type(tiny, tmp_path):
    path = shutil.copytree(tiny("llama"), tmp_path / "x")
    _edit_config(path, lambda c: {**c, "model_type": "mamba"})
    with pytest.raises(ExportError) as e:
        convert(open_hf_dir(path), torch.float32)
    assert str(e.value) == f"unsupported architecture 'mamba' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"


def test_missing_tensor(tiny, tmp_path):
    path = shutil.copytree(tiny("qwen2"), tmp_path / "x")
    _rewrite_tensors(path, lambda raw: {k: v for k, v in raw.items() if "layers.1.self_attn.v_proj.bias" not in k})
    with pytest.raises(ExportError, match="lacks tensor 'model.layers.1.self_attn.v_proj.bias'"):
        convert(open_hf_dir(path), torch.float32)


def test_misshapen_tensor(tiny, tmp_path):
    path = shutil.copytree(tiny("llama"), tmp_path / "x")
    _edit_config(path, lambda c: {**c, "intermediate_size": 96})
    message = r"x: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\], the config implies \[96, 64\]"
    with pytest.raises(ExportError, match=message):
        convert(open_hf_dir(path), torch.float32)


def test_unexpected_tensor(tiny, tmp_path):
    path = shutil.copytree(tiny("llama"), tmp_path / "x")
    _rewrite_tensors(path, lambda raw: {**raw, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    with pytest.raises(ExportError, match="no place for: model.layers.0.self_attn.o_proj.bias"):
        convert(open_hf_dir(path), torch.float32)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        (lambda c: {**c, "mlp_bias": True}, "mlp_bias=true"),
        (lambda c: {**c, "hidden_act": "relu"}, "activation 'relu' is not supported"),
        (lambda c: {**c, "rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope scaling 'longrope'"),
        (lambda c: {**c, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8}}, "beta_fast=8"),
        (lambda c: {**c, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "lacks 'hidden_size'"),
        (lambda c: {**c, "tie_word_embeddings": False}, "lacks tensor 'lm_head.weight'"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    path = shutil.copytree(tiny("llama"), tmp_path / "x")
    _edit_config(path, edit)
    with pytest.raises(ExportError, match=message):
        convert(open_hf_dir(path), torch.float32)


def test_yarn_defaults_accepted(tiny, tmp_path):
    path = shutil.copytree(tiny("qwen3"), tmp_path / "x")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6}
    _edit_config(path, lambda c: {**c, "rope_parameters": yarn})
    arch, _ = _convert(path)
    assert (arch.rope_scaling.type, arch.rope_scaling.factor, arch.rope_scaling.original_max_position_embeddings) == (
        "yarn", 4.0, 64)
    assert arch.rope_theta == 1e6
