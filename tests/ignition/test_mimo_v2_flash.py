"""ignition.archs.mimo_v2_flash: MiMoV2FlashForCausalLM checkpoints and MiMo-V2.5-style mimo_v2 releases ->
mimo_v2_flash cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules): the qkv rows with V
scaled, the sinks, the stacked experts. The mimo_v2 layout (remote-code config keys, a fused qkv_proj in shards, a
vision sub-config, MTP and vision tensors) and transformers' in-memory names convert to the same core; the configs
we reject name their field; exports are reproducible.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ignition.archs import convert, decode_weight_bytes, num_params
from ignition.errors import ExportError
from ignition.sources.hf import open_hf_dir
from tests.ignition.checkpoint_tools import (
    assert_config_refused,
    assert_reproducible_export,
    assert_runtime_tensors,
    assert_tensor_refused,
    convert_all,
    edit_config,
    raw_tensors,
    write_tensors,
)
from tests.ignition.tiny_models import EOS_ID, VOCAB_SIZE
from tests.models.mimo_v2_flash_tiny import build_mimo, mimo_model, write_mimo_v2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_v2_flash")
    return build_mimo(root / "hf"), mimo_model()


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules (V rows times attention_value_scale)."""
    m = model.model
    out = {"embed.weight": m.embed_tokens.weight, "norm.weight": m.norm.weight, "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(m.layers):
        L, a, f = f"layers.{i}.", block.self_attn, block.mlp
        out[L + "attn_norm.weight"] = block.input_layernorm.weight
        out[L + "mlp_norm.weight"] = block.post_attention_layernorm.weight
        out[L + "attn.qkv.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight * a.v_scale])
        out[L + "attn.o.weight"] = a.o_proj.weight
        if a.sinks is not None:
            out[L + "attn.sinks"] = a.sinks
        if hasattr(f, "experts"):
            out[L + "moe.router.weight"] = f.gate.weight
            out[L + "moe.router.bias"] = f.gate.e_score_correction_bias
            out[L + "moe.gate_up.weight"] = f.experts.gate_up_proj
            out[L + "moe.down.weight"] = f.experts.down_proj
        else:
            out[L + "mlp.gate_up.weight"] = torch.cat([f.gate_proj.weight, f.up_proj.weight])
            out[L + "mlp.down.weight"] = f.down_proj.weight
    return {k: v.detach() for k, v in out.items()}


def test_runtime_tensors_equal_hf_modules(tiny):
    path, model = tiny
    assert_runtime_tensors(convert_all(path)[1], _expected(model), rtol=1e-6)  # V rows: one float32 rounding


def test_architecture_matches_config(tiny):
    path, model = tiny
    cfg = model.config
    arch, got = convert_all(path)
    assert arch.family == "mimo_v2_flash" and arch.layer_types == ["full", "sliding", "sliding", "full"]
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_heads) == (VOCAB_SIZE, 64, 128, 8)
    assert (arch.num_kv_heads, arch.sliding_num_kv_heads) == (2, model.model.layers[1].self_attn.k_proj.out_features
                                                              // 24)
    assert (arch.head_dim, arch.v_head_dim, arch.rotary_dim) == (24, 16, int(24 * 0.334))
    assert (arch.sliding_window, arch.attention_sinks, arch.rms_norm_eps) == (17, ["sliding"], cfg.rms_norm_eps)
    assert (arch.rope_theta, arch.rope_local_theta) == (5_000_000.0, 10_000.0)
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.dense_layers) == (8, 2, 32, [0])
    assert (moe.scoring, moe.score_bias, moe.shared_expert_intermediate_size) == ("sigmoid", True, 0)
    assert (moe.num_groups, moe.num_topk_groups, moe.routed_scaling_factor, moe.norm_topk_prob) == (2, 1, 1.5, True)
    # parameter count: HF's parameters plus the routers' score biases (buffers there)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert num_params(arch) == sum(p.numel() for p in model.parameters()) + bias == sum(t.numel()
                                                                                        for t in got.values())


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny[0])
    h, v, nq, d, dv = 64, VOCAB_SIZE, 8, 24, 16
    attn = {2: 2 * h + (nq * d + 2 * (d + dv)) * h + h * nq * dv, 4: 2 * h + (nq * d + 4 * (d + dv)) * h + h * nq * dv}
    moe_read = 8 * (h + 1) + 2 * 3 * h * 32  # router + bias, top-2 experts, no shared expert
    layers = attn[2] + 3 * h * 128 + 2 * (attn[4] + nq + moe_read) + attn[2] + moe_read
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * (h + v * h + h + layers)


def test_export_is_reproducible(tiny, tmp_path):
    path, _ = tiny
    core = assert_reproducible_export(path, tmp_path)
    assert core.manifest.tokenizer.eos_token_ids == [EOS_ID]


def test_a_mimo_v2_release_converts_to_the_same_core(tiny, tmp_path):
    """model_type mimo_v2: remote-code keys, the fused qkv_proj in num_key_value_heads shards, a vision sub-config;
    its vision tensors are ignored."""
    src, _ = tiny
    want_arch, want = convert_all(src)
    path = write_mimo_v2(src, tmp_path / "v2")
    raw = raw_tensors(path)
    assert "model.layers.1.self_attn.qkv_proj.weight" in raw and "model.layers.1.self_attn.q_proj.weight" not in raw
    assert json.loads((path / "config.json").read_text())["model_type"] == "mimo_v2"
    arch, got = convert_all(path)
    assert arch == want_arch
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_a_plain_fused_qkv_is_one_shard(tiny, tmp_path):
    """With num_key_value_heads 1 the shards are one: q, k, v rows in order; a wrong shard count garbles them."""
    from ignition.archs.mimo_v2_flash import _fused_qkv
    from tests.models.mimo_v2_flash_tiny import fuse_qkv

    q, k, v = torch.randn(16, 3), torch.randn(8, 3), torch.randn(4, 3)
    assert torch.equal(_fused_qkv(fuse_qkv(q, k, v, 1), [16, 8, 4], 1), torch.cat([q, k, v]))
    assert torch.equal(_fused_qkv(fuse_qkv(q, k, v, 4), [16, 8, 4], 4), torch.cat([q, k, v]))
    assert not torch.equal(_fused_qkv(fuse_qkv(q, k, v, 4), [16, 8, 4], 2), torch.cat([q, k, v]))


def test_transformers_in_memory_names(tiny, tmp_path):
    """What transformers holds in memory: self_attn.sinks, stacked experts (gate_up_proj / down_proj)."""
    src, model = tiny
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "memory")
    state = dict(model.state_dict())
    assert "model.layers.1.self_attn.sinks" in state and "model.layers.1.mlp.experts.gate_up_proj" in state
    write_tensors(path, state)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_defaults_when_types_and_rope_are_absent(tiny, tmp_path):
    """No mlp_layer_types / rope_parameters: HF's defaults (layer 0 dense; 5e6 / 1e4 at 0.334), the same core;
    sliding_window_size counts the keys before the query (window 17 = 16 + 1). No layer_types: layer 0 and every
    6th full, so the tiny checkpoint's layer 3 (full there) has too few KV heads for a sliding layer."""
    src = tiny[0]
    want, _ = convert_all(src)
    path = shutil.copytree(src, tmp_path / "defaults")
    drop = ("mlp_layer_types", "rope_parameters", "sliding_window")
    edit_config(path, lambda c: {**{k: v for k, v in c.items() if k not in drop}, "sliding_window_size": 16})
    assert convert_all(path)[0] == want
    edit_config(path, lambda c: {k: v for k, v in c.items() if k != "layer_types"})
    with pytest.raises(ExportError, match=r"layers.3.self_attn.k_proj.weight' has shape \[48, 64\], the config "
                                          r"implies \[96, 64\]"):
        convert(open_hf_dir(path), torch.float32)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        (lambda c: {**c, "quantization_config": {"quant_method": "fp8"}}, r"quantization_config \(fp8\)"),
        (lambda c: {**c, "n_shared_experts": 1}, "n_shared_experts=1"),
        (lambda c: {**c, "scoring_func": "softmax"}, "scoring_func 'softmax'"),
        (lambda c: {**c, "swa_head_dim": 32}, "swa_head_dim=32 differs"),
        (lambda c: {**c, "attention_projection_layout": "split"}, "attention_projection_layout 'split'"),
        (lambda c: {**c, "layer_types": ["full_attention"] * 3}, "3 layer types for 4 layers"),
        (lambda c: {**c, "mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "dense / sparse"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "sliding_attention": {
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}},
         "partial_rotary_factor differs"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "full_attention": {
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}}, r"rope scaling \(full_attention\)"),
        (lambda c: {**c, "head_dim": 27}, "partial rotary of 9 dims"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny[0], tmp_path, edit, message)


@pytest.mark.parametrize(("name", "shape"), [("model.layers.1.self_attn.o_proj.bias", (64,)),
                                             ("model.layers.0.self_attn.attention_sink_bias", (8,))])
def test_unexpected_tensor(tiny, tmp_path, name, shape):
    """An o_proj bias, or sinks on a full layer whose config gives it none, have no place."""
    assert_tensor_refused(tiny[0], tmp_path, name, shape)
