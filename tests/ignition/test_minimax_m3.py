"""ignition.archs.minimax_m3: MiniMax-M3 checkpoints (the wrapper with its text_config, or the text ForCausalLM) ->
minimax_m3 cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names); the
fused projections by feeding inputs through HF's own modules. Both namings convert alike (the released one, which
transformers saves for the wrapper, and the one it holds in memory); the released config spellings
(sparse_attention_config, moe_layer_freq) read as the flat ones; the vision tower and MTP weights are ignored; the
configs transformers accepts that we reject, and reproducible exports.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helios.core.load import load_core
from ignition.archs import decode_weight_bytes, num_params
from ignition.export import export_core
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
from tests.models.minimax_m3_tiny import VARIANTS, build_minimax_m3, minimax_m3_model

PREFIX = "language_model.model."  # the wrapper's released naming


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return variant_cache(tmp_path_factory.mktemp("minimax_m3"), build_minimax_m3, minimax_m3_model)


def _text(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules (zero-centred norms stored 1 + w)."""
    tm = _text(model)
    out = {"embed.weight": tm.embed_tokens.weight, "norm.weight": 1 + tm.norm.weight}
    if not model.config.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, block in enumerate(tm.layers):
        L, a = f"layers.{i}.", block.self_attn
        out[L + "attn_norm.weight"] = 1 + block.input_layernorm.weight
        out[L + "mlp_norm.weight"] = 1 + block.post_attention_layernorm.weight
        out[L + "attn.qkv.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        out[L + "attn.q_norm.weight"] = 1 + a.q_norm.weight
        out[L + "attn.k_norm.weight"] = 1 + a.k_norm.weight
        out[L + "attn.o.weight"] = a.o_proj.weight
        if a.indexer is not None:
            x = a.indexer
            out[L + "attn.indexer.qk.weight"] = torch.cat([x.q_proj.weight, x.k_proj.weight])
            out[L + "attn.indexer.q_norm.weight"] = 1 + x.q_norm.weight
            out[L + "attn.indexer.k_norm.weight"] = 1 + x.k_norm.weight
        out.update(swiglu_ffn_expected(L, block.mlp))
    return {k: v.detach() for k, v in out.items()}


# ---- both variants ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_runtime_tensors_equal_hf_modules(tiny, variant):
    path, model = tiny(variant)
    assert_runtime_tensors(convert_all(path)[1], _expected(model))


@pytest.mark.parametrize("variant", VARIANTS)
def test_architecture_matches_config(tiny, variant):
    path, model = tiny(variant)
    cfg = model.config.get_text_config()
    arch, got = convert_all(path)
    assert arch.family == "minimax_m3" and arch.layer_types == [] and arch.qk_norm
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (VOCAB_SIZE, 64, cfg.dense_intermediate_size)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.rms_norm_eps == cfg.rms_norm_eps and arch.max_position_embeddings == 512
    assert arch.rope_theta == 10000.0 and arch.rope_scaling is None
    assert arch.rotary_dim == (None if cfg.rotary_dim == 16 else cfg.rotary_dim)
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (cfg.swiglu_limit, cfg.swiglu_alpha)
    assert arch.tie_word_embeddings == model.config.tie_word_embeddings
    m = arch.msa
    assert (m.num_heads, m.head_dim, m.block_size, m.num_blocks, m.local_blocks) == (
        cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks)
    assert m.layers == [i for i, t in enumerate(cfg.layer_types) if t == "minimax_m3_sparse"]
    assert arch.index_dim == 16
    moe = arch.moe
    assert moe.dense_layers == [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, cfg.intermediate_size)
    assert (moe.scoring, moe.score_bias, moe.shared_expert_gate, moe.norm_topk_prob) == ("sigmoid", True, False, True)
    assert (moe.shared_expert_intermediate_size, moe.routed_scaling_factor) == (48, cfg.routed_scaling_factor)
    assert (moe.num_groups, moe.num_topk_groups) == (1, 1)
    # parameter count: HF's text parameters (lm_head once) plus the routers' score biases (buffers there)
    text = _text(model)
    bias = sum(b.numel() for n, b in text.named_buffers() if n.endswith("e_score_correction_bias"))
    head = 0 if model.config.tie_word_embeddings else model.lm_head.weight.numel()
    assert num_params(arch) == sum(p.numel() for p in text.parameters()) + head + bias
    assert num_params(arch) == sum(t.numel() for t in got.values())


def test_projections_match_hf_forward(tiny):
    """x @ W.T of the fused projections split per the layout equals what HF's modules compute."""
    path, model = tiny("wrapper")
    _, got = convert_all(path)
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1))

    def close(ours, theirs):
        torch.testing.assert_close(ours.reshape(5, -1), theirs.reshape(5, -1), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for i, block in enumerate(_text(model).layers):
            a = block.self_attn
            hf = (a.q_proj(x), a.k_proj(x), a.v_proj(x))
            ours = (x @ got[f"layers.{i}.attn.qkv.weight"].T).split([64, 32, 32], -1)
            if a.indexer is not None:
                hf += (a.indexer.q_proj(x), a.indexer.k_proj(x))
                ours += (x @ got[f"layers.{i}.attn.indexer.qk.weight"].T).split([32, 16], -1)
            for o, t in zip(ours, hf, strict=True):
                close(o, t)


def test_export_is_reproducible(tiny, tmp_path):
    path, _ = tiny("wrapper")
    core = assert_reproducible_export(path, tmp_path)
    assert core.manifest.recipe.name == "minimax_m3"
    assert core.manifest.tokenizer.eos_token_ids == [EOS_ID]


# ---- namings, config spellings, what is ignored ---------------------------------------------------------------


def test_the_wrappers_in_memory_names(tiny, tmp_path):
    """What transformers holds in memory for the wrapper: model.language_model.*, lm_head, stacked experts, fused
    gate_up, self_attn.indexer.*."""
    src, model = tiny("wrapper")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "memory")
    state = dict(model.state_dict())
    assert any(k.startswith("model.language_model.") and ".mlp.experts.gate_up_proj" in k for k in state)
    write_tensors(path, state)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_a_released_style_config(tiny, tmp_path):
    """The published config's spellings: sparse_attention_config (its sparse_* keys override the flat index_* ones,
    sparse_attention_freq gives the layer types), moe_layer_freq, num_experts, flat rope_theta /
    partial_rotary_factor beside rotary_dim, hidden_act swigluoai (transformers reads it as silu)."""
    src, _ = tiny("wrapper")
    want, _ = convert_all(src)
    path = shutil.copytree(src, tmp_path / "released")
    drop = ("layer_types", "mlp_layer_types", "rope_parameters", "num_local_experts") + tuple(
        k for k in json.loads((src / "config.json").read_text())["text_config"] if k.startswith("index_"))

    def respell(c):
        c = {k: v for k, v in c.items() if k not in drop}
        sparse = {"sparse_attention_freq": [1, 0, 1], "sparse_num_index_heads": 2, "sparse_index_dim": 16,
                  "sparse_block_size": 4, "sparse_topk_blocks": 4, "sparse_local_block": 1}
        return {**c, "sparse_attention_config": sparse, "moe_layer_freq": [0, 1, 1], "num_experts": 8,
                "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rotary_dim": 8, "hidden_act": "swigluoai",
                "index_topk_blocks": 99}

    edit_config(path, respell)
    assert convert_all(path)[0] == want


def test_the_text_model_and_its_defaults(tiny, tmp_path):
    """minimax_m3_vl_text reads the config at the top level; without layer_types / mlp_layer_types every layer is
    full attention with experts (no arch.msa, no index keys)."""
    src, _ = tiny("text")
    path = shutil.copytree(src, tmp_path / "defaults")
    edit_config(path, lambda c: {k: v for k, v in c.items() if k not in ("layer_types", "mlp_layer_types")})
    raw = raw_tensors(path)
    write_tensors(path, {k: v for k, v in raw.items() if ".indexer." not in k})
    arch, _ = convert_all(path)
    assert arch.msa is None and arch.index_dim == 0 and arch.moe.dense_layers == []


def test_vision_and_mtp_are_ignored(tiny, tmp_path):
    """The vision tower and its projectors (images are a later issue) and every mtp.* tensor (the DSpark head)."""
    src, _ = tiny("wrapper")
    path = shutil.copytree(src, tmp_path / "mtp")
    raw = raw_tensors(path)
    assert any(k.startswith("vision_tower.") for k in raw) and any(k.startswith("patch_merge_mlp.") for k in raw)
    mtp = {"mtp.layers.0.eh_proj.weight": torch.zeros(64, 128), f"{PREFIX}mtp.norm.weight": torch.zeros(64)}
    write_tensors(path, {**raw, **mtp})
    _, want = convert_all(src)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want)


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny("wrapper")[0])  # sparse + dense MLP, full + moe, sparse + moe
    h, v = 64, VOCAB_SIZE
    attn = 2 * h + (4 + 2 * 2) * 16 * h + h * 64 + 2 * 16
    indexer = (2 + 1) * 16 * h + 2 * 16
    moe_read = 8 * (h + 1) + 2 * 3 * h * 32 + 3 * h * 48  # router + bias, top-2 experts, the shared expert
    n = h + v * h + h + 3 * attn + 2 * indexer + 3 * h * 96 + 2 * moe_read
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n


def test_cast_to_bfloat16(tiny, tmp_path):
    """Every tensor in bf16 but the norms' 1 + w, which stay float32 (as HF computes them) in the core and in the
    bound model (Architecture.float32_norms); the bound model's routers are float32 as well."""
    from helios.models import build_model
    from ignition.export import ExportOptions

    path, _ = tiny("wrapper")
    raw = raw_tensors(path)
    arch, got = convert_all(path, torch.bfloat16)
    norms = {n for n in got if n.endswith("norm.weight")}
    assert arch.float32_norms and len(norms) == 1 + 3 * 4 + 2 * 2  # final; per layer 2 + q/k; the indexers' q/k
    assert all(t.dtype == (torch.float32 if n in norms else torch.bfloat16) for n, t in got.items())
    assert torch.equal(got["layers.0.attn.q_norm.weight"], raw[f"{PREFIX}layers.0.self_attn.q_norm.weight"] + 1)
    core = load_core(export_core(path, tmp_path / "bf16", ExportOptions(dtype="bfloat16")))
    model = build_model(core.manifest.arch, core.tensors, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    # the MoE routers bound in float32 too (helios.layers.moe._Router: the logits are a float32 product)
    routers = {n for n in dtypes if ".router." in n}
    assert routers and core.tensors[next(iter(routers))].dtype == torch.bfloat16
    assert all(dtypes[n] == (torch.float32 if n in norms | routers else torch.bfloat16) for n in dtypes)


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "rotary_dim": 4}, "rotary_dim=4 disagrees with partial_rotary_factor=0.5"),
        (lambda c: {**c, "rotary_dim": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                 "partial_rotary_factor": 0.2}},
         "partial_rotary_factor=0.2 gives 3 rotary dims"),
        (lambda c: {**c, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.5}}, "dynamic rope scaling"),
        (lambda c: {**c, "layer_types": ["minimax_m3_sparse", "sliding_attention", "full_attention"]},
         "type 'sliding_attention'"),
        (lambda c: {**c, "layer_types": ["full_attention"] * 2}, "layer_types has 2 entries for 3 layers"),
        (lambda c: {**c, "mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types"),
        (lambda c: {**c, "index_local_blocks": 5}, "index_local_blocks=5 within 0..4"),
        (lambda c: {**c, "index_n_heads": 3}, "not a multiple of index_n_heads=3"),
        (lambda c: {**c, "index_head_dim": 4}, "index_head_dim=4 is narrower than the 8 rotary dims"),
        (lambda c: {**c, "shared_intermediate_size": 0}, "shared_intermediate_size=0"),
        (lambda c: {**c, "swiglu_limit": None}, "swiglu_limit=None"),
        (lambda c: {**c, "num_experts_per_tok": 9}, "num_experts_per_tok=9 of num_local_experts=8"),
        (lambda c: {**c, "num_key_value_heads": 1},
         r"k_proj.weight' has shape \[32, 64\], the config implies \[16, 64\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny("wrapper")[0], tmp_path, edit, message)


@pytest.mark.parametrize(
    ("name", "shape"),
    [(f"{PREFIX}layers.1.self_attn.o_proj.bias", (64,)), (f"{PREFIX}layers.0.self_attn.index_v_proj.weight", (16, 64))],
)
def test_unexpected_tensor(tiny, tmp_path, name, shape):
    assert_tensor_refused(tiny("wrapper")[0], tmp_path, name, shape)
