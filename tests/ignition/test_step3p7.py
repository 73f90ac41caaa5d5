"""ignition.archs.step3p7: Step3p7ForConditionalGeneration checkpoints (text only) and flat step3p5 ones -> step3p7
cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names). Both
tensor namings convert alike (the release's, which transformers saves, and the one it holds in memory), and so do the
release's config spellings and transformers' (the wrapper's, and step3p5's flat one); the vision tower and the MTP
layers are ignored; the configs transformers accepts that we reject, and reproducible exports.
"""

from __future__ import annotations

import json
import shutil

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
    swiglu_ffn_expected,
    variant_cache,
    write_tensors,
)
from tests.ignition.tiny_models import EOS_ID, VOCAB_SIZE
from tests.models.step3p7_tiny import TEXT, VARIANTS, build_step3p7, step3p7_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return variant_cache(tmp_path_factory.mktemp("step3p7"), build_step3p7, step3p7_model)


def _shifted(w: torch.Tensor) -> torch.Tensor:
    return w.float() + 1.0  # HF's Step3p7RMSNorm multiplies by 1 + w


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    tm = model.model.language_model
    out = {"embed.weight": tm.embed_tokens.weight, "norm.weight": _shifted(tm.norm.weight)}
    if model.lm_head.weight is not tm.embed_tokens.weight:
        out["lm_head.weight"] = model.lm_head.weight
    for i, block in enumerate(tm.layers):
        L, a, f = f"layers.{i}.", block.self_attn, block.mlp
        out[L + "attn_norm.weight"] = _shifted(block.input_layernorm.weight)
        out[L + "mlp_norm.weight"] = _shifted(block.post_attention_layernorm.weight)
        out[L + "attn.qkv.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.g_proj.weight])
        out[L + "attn.q_norm.weight"] = _shifted(a.q_norm.weight)
        out[L + "attn.k_norm.weight"] = _shifted(a.k_norm.weight)
        out[L + "attn.o.weight"] = a.o_proj.weight
        out.update(swiglu_ffn_expected(L, f))
    return {k: v.detach() for k, v in out.items()}


# ---- both variants ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_runtime_tensors_equal_hf_modules(tiny, variant):
    path, model = tiny(variant)
    assert_runtime_tensors(convert_all(path)[1], _expected(model))


@pytest.mark.parametrize("variant", VARIANTS)
def test_architecture_matches_config(tiny, variant):
    path, model = tiny(variant)
    cfg = model.config.text_config
    arch, got = convert_all(path)
    text = model.model.language_model
    layers = text.layers
    kinds = {"full_attention": "full", "sliding_attention": "sliding"}
    assert arch.family == "step3p7" and arch.layer_types == [kinds[t] for t in cfg.layer_types]
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (VOCAB_SIZE, 64, 96)
    full = next(b.self_attn for b in layers if b.attention_type == "full_attention")
    sliding = next(b.self_attn for b in layers if b.attention_type == "sliding_attention")
    assert (arch.num_heads, arch.sliding_num_heads, arch.num_kv_heads, arch.head_dim) == (
        full.num_heads, sliding.num_heads, 2, 16)
    assert arch.query_scale == full.scaling and arch.sliding_window == cfg.sliding_window
    assert arch.qk_norm and arch.attn_output_gate and arch.attn_gate_per_head and not arch.attention_bias
    rope = text.rotary_emb
    assert arch.rope_theta == cfg.rope_parameters["full_attention"]["rope_theta"]
    assert arch.rope_local_theta == cfg.rope_parameters["sliding_attention"]["rope_theta"]
    full_rope = cfg.rope_parameters["full_attention"]
    assert (arch.rope_scaling.type, arch.rope_scaling.factor) == (full_rope["rope_type"], full_rope["factor"])
    assert 2 * len(rope.full_attention_inv_freq) == (arch.rotary_dim or 16)
    assert 2 * len(rope.sliding_attention_inv_freq) == (arch.sliding_rotary_dim or 16)
    assert arch.tie_word_embeddings == (model.lm_head.weight is text.embed_tokens.weight)
    moe = arch.moe
    assert moe.dense_layers == [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        cfg.n_routed_experts, cfg.num_experts_per_tok, 32)
    assert (moe.scoring, moe.score_bias, moe.shared_expert_gate, moe.norm_topk_prob) == ("sigmoid", True, False, True)
    assert (moe.shared_expert_intermediate_size, moe.routed_scaling_factor) == (
        cfg.share_expert_dim, cfg.moe_router_scaling_factor)
    limits = [b.mlp.experts.limit if hasattr(b.mlp, "experts") else None for b in layers]
    shared = [(b.mlp.shared_experts if hasattr(b.mlp, "experts") else b.mlp).limit for b in layers]
    assert [x or None for x in arch.swiglu_limits or [0] * 5][: len(layers)] == limits
    assert [x or None for x in arch.swiglu_limits_shared or [0] * 5][: len(layers)] == shared
    # parameter count: HF's text parameters (the lm_head once) plus the routers' score biases (buffers there)
    bias = sum(b.numel() for n, b in text.named_buffers() if n.endswith("e_score_correction_bias"))
    hf = sum(p.numel() for p in text.parameters()) + (0 if arch.tie_word_embeddings else model.lm_head.weight.numel())
    assert num_params(arch) == hf + bias == sum(t.numel() for t in got.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_is_reproducible(tiny, variant, tmp_path):
    path, _ = tiny(variant)
    core = assert_reproducible_export(path, tmp_path)
    assert core.manifest.tokenizer.eos_token_ids == [EOS_ID]
    assert core.manifest.recipe.name == "step5"  # Step 5 has no transformers family; step3p7 is its nearest


# ---- namings, config spellings, what is ignored ---------------------------------------------------------------


def test_transformers_in_memory_names(tiny, tmp_path):
    """What transformers holds in memory: model.language_model.*, mlp.gate.e_score_correction_bias, stacked
    experts.gate_up_proj, mlp.shared_experts.*, the vision tower under model.vision_model."""
    src, model = tiny("base")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "memory")
    state = dict(model.state_dict())
    assert any(".mlp.experts.gate_up_proj" in k for k in state) and any(".shared_experts." in k for k in state)
    write_tensors(path, state)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_release_spellings_and_a_flat_step3p5_config(tiny, tmp_path):
    """The release's config.json (num_attention_groups, moe_num_experts / moe_top_k, moe_layers_enum,
    attention_other_setting, per-layer rope_theta / partial_rotary_factors, lists padded with the MTP layer's
    entry), in the step3p7 wrapper and at the top level as step3p5 (tensors without the vision tower)."""
    src, _ = tiny("base")
    want, tensors = convert_all(src)
    top = json.loads((src / "config.json").read_text())
    wrapped = shutil.copytree(src, tmp_path / "wrapped")
    (wrapped / "config.json").write_text(json.dumps({**top, "text_config": {**TEXT, "model_type": "step3p5"}}))
    assert convert_all(wrapped)[0] == want
    flat = shutil.copytree(src, tmp_path / "flat")
    (flat / "config.json").write_text(json.dumps({**TEXT, "model_type": "step3p5", "architectures": ["Step3p5"]}))
    write_tensors(flat, {k: v for k, v in raw_tensors(src).items() if k.startswith(("model.", "lm_head."))})
    arch, got = convert_all(flat)
    assert arch == want and all(torch.equal(got[n], tensors[n]) for n in tensors)


def test_defaults_when_fields_are_absent(tiny, tmp_path):
    """moe_layers_enum as a list reads as mlp_layer_types; with neither, layers from the fourth are MoE (so layer 2
    wants a dense MLP); without layer_types every layer is full (so the sliding layers' 6-head q_proj misfits)."""
    src, _ = tiny("base")
    want, _ = convert_all(src)
    path = shutil.copytree(src, tmp_path / "x")
    edit_config(path, lambda c: {**{k: v for k, v in c.items() if k != "mlp_layer_types"},
                                 "moe_layers_enum": [2, 3, 4]})
    assert convert_all(path)[0] == want
    edit_config(path, lambda c: {k: v for k, v in c.items() if k != "moe_layers_enum"})
    with pytest.raises(ExportError, match="lacks tensor 'model.layers.2.mlp.gate_proj.weight'"):
        convert(open_hf_dir(path), torch.float32)
    path = shutil.copytree(src, tmp_path / "y")
    edit_config(path, lambda c: {k: v for k, v in c.items() if k not in ("layer_types", "per_layer_config")})
    with pytest.raises(ExportError, match=r"layers.1.self_attn.q_proj.weight' has shape \[96, 64\]"):
        convert(open_hf_dir(path), torch.float32)


def test_vision_is_ignored_and_a_partial_mtp_layer_refused(tiny, tmp_path):
    """The vision tower and projector (images are a later issue); an MTP layer stored past num_hidden_layers is
    exported whole or refused (tests/ignition/test_mtp_export.py exports a whole one): a fragment is an ExportError."""
    src, _ = tiny("base")
    raw = raw_tensors(src)
    assert any(k.startswith("vision_model.") for k in raw) and "vit_large_projector.weight" in raw
    assert convert_all(src)[0].mtp is None
    path = shutil.copytree(src, tmp_path / "mtp")
    mtp = {"model.layers.5.eh_proj.weight": torch.zeros(64, 128), "model.layers.5.moe.gate.weight": torch.zeros(8, 64),
           "model.layers.5.self_attn.q_proj.weight": torch.zeros(64, 64)}
    write_tensors(path, {**raw, **mtp})
    with pytest.raises(ExportError, match="MTP module lacks tensor 'model.layers.5.enorm.weight'"):
        convert_all(path)


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny("base")[0])  # full, sliding (6 heads), sliding, full, sliding; 2 dense, 3 MoE
    h, v, d = 64, VOCAB_SIZE, 16

    def attn(heads: int) -> int:
        return 2 * h + (heads * d + 2 * 2 * d + heads) * h + 2 * d + h * heads * d

    moe_read = 8 * (h + 1) + 2 * 3 * h * 32 + 3 * h * 48  # router + bias, top-2 experts, the shared expert
    n = h + v * h + h + 2 * attn(4) + 3 * attn(6) + 2 * 3 * h * 96 + 3 * moe_read
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n


def test_cast_to_bfloat16(tiny):
    path, _ = tiny("base")
    raw = raw_tensors(path)
    _, got = convert_all(path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    want = (raw["model.layers.0.input_layernorm.weight"].float() + 1).to(torch.bfloat16)
    assert torch.equal(got["layers.0.attn_norm.weight"], want)


# ---- bad input ------------------------------------------------------------------------------------------------

SLIDING_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 2.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
        (lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        (lambda c: {**c, "mlp_bias": True}, "mlp_bias=true"),
        (lambda c: {**c, "gating": "per-channel"}, "gating='per-channel'"),
        (lambda c: {**c, "use_head_wise_attn_gate": False}, "use_head_wise_attn_gate=false"),
        (lambda c: {**c, "moe_router_activation": "softmax"}, "moe_router_activation='softmax'"),
        (lambda c: {**c, "use_moe_router_bias": False}, "use_moe_router_bias=false"),
        (lambda c: {**c, "norm_expert_weight": False}, "norm_expert_weight=false"),
        (lambda c: {**c, "zero_centered": False}, "zero_centered=false"),
        (lambda c: {**c, "att_impl_type": "MLA"}, "att_impl_type='MLA'"),
        (lambda c: {**c, "yarn_only_types": ["full_attention", "sliding_attention"]}, "yarn_only_types="),
        (lambda c: {**c, "use_rope_layers": [True, False, True, True, True]}, "use_rope_layers"),
        (lambda c: {**c, "layer_types": c["layer_types"][:4] + ["minimax_m3_sparse"]}, "type 'minimax_m3_sparse'"),
        (lambda c: {**c, "layer_types": c["layer_types"][:4]}, "layer_types has 4 entries for 5 layers"),
        (lambda c: {**c, "sliding_window": None}, "without a sliding_window"),
        (lambda c: {**c, "attention_other_setting": {"num_attention_groups": 1}}, "num_attention_groups=1 differs"),
        (lambda c: {**c, "per_layer_config": {"1": {"head_dim": 8}}}, r"per_layer_config\[1\]"),
        (lambda c: {**c, "per_layer_config": {"1": {"num_attention_heads": 6}}}, "query heads differ"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "sliding_attention": SLIDING_LLAMA3}},
         "rope scaling on sliding layers"),
        (lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}, "one table per layer type"),
        (lambda c: {**c, "rope_parameters": None, "rope_theta": [1e4, 500.0, 600.0, 1e4, 500.0]},
         "rope_theta differs between sliding_attention layers"),
        (lambda c: {**c, "rope_parameters": None, "partial_rotary_factors": [0.1] * 5}, "gives 1 rotary dims"),
        (lambda c: {**c, "swiglu_limits": [0, 1.0]}, "swiglu_limits has 2 entries for 5 layers"),
        (lambda c: {**c, "swiglu_limits_shared": [0, 0, -1.0, 0, 0]}, "swiglu_limits_shared has a negative clamp"),
        (lambda c: {**c, "mlp_layer_types": ["dense", "moe", "sparse", "sparse", "sparse"]}, "mlp_layer_types"),
        (lambda c: {**c, "share_expert_dim": 0}, "share_expert_dim=0"),
        (lambda c: {**c, "num_experts_per_tok": 9}, "num_experts_per_tok=9 of n_routed_experts=8"),
        (lambda c: {**c, "head_dim": 8}, r"q_proj.weight' has shape \[64, 64\], the config implies \[32, 64\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny("base")[0], tmp_path, edit, message)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("model.layers.0.self_attn.o_proj.bias", (64,)), ("model.layers.2.moe.gate.bias", (8,)),
     ("model.layers.2.moe.down_proj.weight_scale_inv", (8, 1, 1))],
)
def test_unexpected_tensor(tiny, tmp_path, name, shape):
    assert_tensor_refused(tiny("base")[0], tmp_path, name, shape)
