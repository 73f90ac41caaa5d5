"""ignition.archs.muse_spark: MuseSpark checkpoints (text decoder of MuseSparkForConditionalGeneration) -> cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint: the norms and projections against its
modules, the residual gates' (alpha, beta) against MuseSparkResidualGate's own forward; the config's per-layer lists
against what MuseSparkTextConfig derives; the configs the runtime does not implement are refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helios.core.load import load_core
from ignition.archs import convert, decode_weight_bytes, num_params
from ignition.errors import ExportError
from ignition.export import export_core
from ignition.sources.hf import open_hf_dir
from tests.ignition.checkpoint_tools import (
    assert_runtime_tensors,
    convert_all,
    core_files,
    edit_config,
    raw_tensors,
    write_tensors,
)
from tests.ignition.tiny_models import VOCAB_SIZE
from tests.models.muse_spark_tiny import TEXT, build_muse_spark, muse_spark_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, the HF model that wrote it)."""
    path = build_muse_spark(tmp_path_factory.mktemp("muse_spark") / "hf")
    return path, muse_spark_model()


@pytest.fixture
def copy(tiny, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny[0], dst)
    return dst


def _gate(module, h: int) -> torch.Tensor:  # [2, H]: (alpha, beta) as HF's forward applies them
    ones, zeros = torch.ones(h), torch.zeros(h)
    return torch.stack([module(ones, zeros), module(zeros, ones)])


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules (centred norms as 1 + w, output_multiplier folded)."""
    tm, cfg = model.model.language_model, model.config.text_config
    mult, h = cfg.output_multiplier, cfg.hidden_size
    out = {"embed.weight": tm.embed_tokens.weight, "norm.weight": tm.norm.weight,
           "lm_head.weight": model.lm_head.weight * mult}
    for i, block in enumerate(tm.layers):
        L, a, m = f"layers.{i}.", block.self_attn, block.mlp
        out[L + "attn_norm.weight"] = 1 + block.input_layernorm.weight
        out[L + "mlp_norm.weight"] = 1 + block.pre_feedforward_layernorm.weight
        out[L + "mlp_post_norm.weight"] = 1 + block.post_feedforward_layernorm.weight
        out[L + "attn.qkv.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.gate_proj.weight])
        out[L + "attn.o.weight"] = a.o_proj.weight
        out[L + "attn_residual.weight"] = _gate(block.post_attention_residual_gate, h)
        out[L + "mlp_residual.weight"] = _gate(block.post_feedforward_residual_gate, h)
        if not hasattr(m, "experts"):
            out[L + "mlp.gate_up.weight"] = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            out[L + "mlp.down.weight"] = m.down_proj.weight
            continue
        out[L + "moe.router.weight"] = m.gate.weight * mult
        out[L + "moe.router.bias"] = m.gate.e_score_correction_bias
        out[L + "moe.latent_in.weight"] = m.pre_expert_proj.weight
        out[L + "moe.latent_norm.weight"] = 1 + m.pre_expert_norm.weight
        out[L + "moe.gate_up.weight"] = m.experts.gate_up_proj
        out[L + "moe.down.weight"] = m.experts.down_proj
        out[L + "moe.expert_norm.weight"] = 1 + m.experts.post_expert_norm.weight
        out[L + "moe.latent_out.weight"] = m.post_expert_proj.weight
    return {k: v.detach() for k, v in out.items()}


def test_runtime_tensors_equal_hf_modules(tiny):
    path, model = tiny
    _, got = convert_all(path)
    with torch.no_grad():
        assert_runtime_tensors(got, _expected(model))


def test_architecture_matches_config(tiny):
    path, model = tiny
    cfg = model.config.text_config
    arch, got = convert_all(path)
    assert arch.family == "muse_spark" and arch.layer_types == ["full", "sliding", "sliding", "sliding", "full"]
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers) == (VOCAB_SIZE, 64, 128, 5)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.sliding_window) == (4, 2, 16, 8)
    assert arch.query_scale == pytest.approx(cfg.qk_scale_factor / 4) and arch.rope_theta == 10_000.0
    assert arch.nope_layers == [0, 2] and arch.post_norm_eps == cfg.post_norm_eps == 1e-8
    assert arch.final_logit_softcapping == 2.0 and not arch.tie_word_embeddings and arch.attn_output_gate
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.latent_size) == (8, 2, 32, 32)
    assert (moe.scoring, moe.score_bias, moe.shared_expert_intermediate_size, moe.routed_scaling_factor) == (
        "sigmoid", True, 0, 1.5)
    assert moe.dense_layers == [0, 3] and moe.latent_norms and moe.norm_topk_prob
    assert num_params(arch) == sum(t.numel() for t in got.values())
    h, d, lat = 64, 16, 32
    attn = 7 * h + (2 * 4 + 2 * 2) * d * h + h * 4 * d  # 3 norms, 2 gates (2 x H each), qkv + gate, o
    dense, moe_read = 3 * h * 128, 8 * (h + 1) + 2 * h * lat + 2 * lat + 2 * 3 * lat * 32
    n = h + VOCAB_SIZE * h + h + 5 * attn + 2 * dense + 3 * moe_read
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n


def test_per_layer_defaults_are_hfs(copy):
    """Without layer_types, layer_rope_theta and mlp_layer_types the export derives what MuseSparkTextConfig does:
    every 4th layer counted back from the last is full and NoPE, every MLP sparse."""
    from transformers import MuseSparkTextConfig

    def drop(c):
        for key in ("layer_types", "layer_rope_theta", "mlp_layer_types"):
            c.pop(key, None)
        return {**c, "num_hidden_layers": 2}

    raw = raw_tensors(copy)
    # layers 0 and 1 keep their tensors; layer 0's dense MLP becomes layer 4's MoE
    keep = {k: v for k, v in raw.items() if ".layers." not in k or ".layers.0." in k or ".layers.1." in k}
    moe = {k.replace(".layers.4.mlp.", ".layers.0.mlp."): v for k, v in raw.items() if ".layers.4.mlp." in k}
    write_tensors(copy, {**{k: v for k, v in keep.items() if ".layers.0.mlp." not in k}, **moe})
    edit_config(copy, drop)
    arch, _ = convert_all(copy)
    hf = MuseSparkTextConfig(**drop(dict(TEXT)))
    assert arch.layer_types == [{"full_attention": "full", "sliding_attention": "sliding"}[t] for t in hf.layer_types]
    assert arch.layer_types == ["sliding", "full"] and arch.nope_layers == [1] == [
        i for i, t in enumerate(hf.layer_rope_theta) if not t]
    assert arch.moe.dense_layers == [] and hf.mlp_layer_types == ["sparse", "sparse"]


@pytest.mark.parametrize("key, value, message", [
    ("attention_bias", True, "attention_bias"),
    ("layer_rope_theta", [0, 5000.0, 0, 10_000.0, 10_000.0], "layer_rope_theta"),
    ("sliding_window", None, "sliding_window"),
    ("final_logit_softcapping", None, "final_logit_softcapping"),
    ("mlp_layer_types", ["dense", "sparse", "moe", "dense", "sparse"], "mlp_layer_types"),
    ("layer_types", ["full_attention"] * 4, "layer_types"),
    ("layer_types", ["full_attention", "chunked_attention"] * 2 + ["full_attention"], "chunked_attention"),
    ("hidden_act", "relu", "relu"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("quantization_config", {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quantization_config"),
])
def test_unsupported_configs_are_refused(copy, key, value, message):
    edit_config(copy, lambda c: {**c, key: value})
    with pytest.raises(ExportError, match=message):
        convert_all(copy)


def test_a_quantized_release_is_refused(copy):
    """The recipe's checkpoint is NVFP4: its wrapper config's quantization_config is refused by name."""
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "modelopt"}}))
    with pytest.raises(ExportError, match="quantization_config \\(modelopt\\)"):
        convert_all(copy)


def test_unexpected_and_missing_tensors_are_refused(copy):
    raw = raw_tensors(copy)
    write_tensors(copy, {**raw, "model.language_model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    with pytest.raises(ExportError, match="no place for"):
        convert_all(copy)
    write_tensors(copy, {k: v for k, v in raw.items() if not k.endswith("layers.1.mlp.gate.e_score_correction_bias")})
    with pytest.raises(ExportError, match="e_score_correction_bias"):
        convert_all(copy)


def test_a_real_shaped_config_exports(copy):
    """config.json with every key transformers writes for the released model's config (MuseSparkConfig defaults:
    vision, audio, token ids, the text defaults) and the tiny text sizes converts to the same architecture; the flat
    text config (model_type muse_spark_text) too."""
    from transformers import MuseSparkConfig

    want, _ = convert(open_hf_dir(copy), torch.float32)
    full = MuseSparkConfig().to_dict()
    tiny_cfg = json.loads((copy / "config.json").read_text())
    full["text_config"].update({k: tiny_cfg["text_config"][k] for k in (*TEXT, "layer_types")})
    (copy / "config.json").write_text(json.dumps(full))
    assert convert(open_hf_dir(copy), torch.float32)[0] == want
    (copy / "config.json").write_text(json.dumps(full["text_config"]))  # model_type muse_spark_text
    assert convert(open_hf_dir(copy), torch.float32)[0] == want


def test_export_is_reproducible_and_casts(tiny, tmp_path):
    path, _ = tiny
    arch, _ = convert(open_hf_dir(path), torch.float32)
    a, b = export_core(path, tmp_path / "a"), export_core(path, tmp_path / "b")
    assert core_files(a) == core_files(b)
    core = load_core(a)
    assert core.manifest.arch == arch and not any("vision" in n or "audio" in n for n in core.tensors)
    _, got = convert_all(path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    raw = raw_tensors(path)
    assert torch.equal(got["layers.1.moe.router.weight"],
                       (raw["model.language_model.layers.1.mlp.gate.weight"] * 0.5).to(torch.bfloat16))
