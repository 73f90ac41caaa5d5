"""ignition.archs.glm5_next: Glm5NextForConditionalGeneration checkpoints (text only) -> glm5_next cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names); the
fused projections by feeding inputs through HF's own modules. Both namings convert alike (the released one, which
transformers saves, and the one it holds in memory); flat configs and glm5_next_text read alike; the vision tower and
the MTP layers are ignored; the configs transformers accepts that we reject, and reproducible exports.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ignition.archs import decode_weight_bytes, num_params
from ignition.errors import ExportError
from tests.ignition.checkpoint_tools import (
    assert_config_refused,
    assert_reproducible_export,
    assert_tensor_refused,
    convert_all,
    edit_config,
    raw_tensors,
    variant_cache,
    write_tensors,
)
from tests.ignition.tiny_models import EOS_ID, VOCAB_SIZE
from tests.models.glm5_next_tiny import VARIANTS, build_glm5_next, glm5_next_model

PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return variant_cache(tmp_path_factory.mktemp("glm5_next"), build_glm5_next, glm5_next_model)


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    tm = model.model.language_model
    out = {"embed.weight": tm.embed_tokens.weight, "norm.weight": tm.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(tm.layers):
        L, m, f = f"layers.{i}.", block.self_attn, block.mlp
        out[L + "attn_norm.weight"] = block.input_layernorm.weight
        out[L + "mlp_norm.weight"] = block.post_attention_layernorm.weight
        for hc, name in ((block.attn_hc, "attn_hc"), (block.ffn_hc, "mlp_hc")):
            out[L + name + ".proj.weight"] = hc.fn
            out[L + name + ".bias"] = hc.base
            out[L + name + ".scale"] = hc.scale
        if block.block_type == "linear_attention":
            gate = m.forget_gate
            out[L + "kda.in_proj.weight"] = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight,
                                                      gate.f_a_proj.weight, m.g_a_proj.weight, m.b_proj.weight])
            out[L + "kda.conv.weight"] = m.conv1d.weight[:, 0, :]
            out[L + "kda.f_b.weight"] = gate.f_b_proj.weight
            out[L + "kda.dt_bias"] = gate.dt_bias
            out[L + "kda.A_log"] = gate.A_log
            out[L + "kda.g_b.weight"] = m.g_b_proj.weight
            out[L + "kda.norm.weight"] = m.o_norm.weight
            out[L + "kda.out.weight"] = m.o_proj.weight
        else:
            out[L + "mla.in_proj.weight"] = torch.cat([m.q_a_proj.weight, m.kv_a_proj_with_mqa.weight])
            out[L + "mla.q_a_norm.weight"] = m.q_a_layernorm.weight
            out[L + "mla.q_b.weight"] = m.q_b_proj.weight
            out[L + "mla.kv_a_norm.weight"] = m.kv_a_layernorm.weight
            out[L + "mla.kv_b.weight"] = m.kv_b_proj.weight
            out[L + "mla.o.weight"] = m.o_proj.weight
            if m.indexer is not None:
                x = m.indexer
                out[L + "mla.indexer.q.weight"] = x.wq_b.weight
                out[L + "mla.indexer.in_proj.weight"] = torch.cat([x.wk.weight, x.index_kpool_compress_gate,
                                                                  x.weights_proj.weight])
                out[L + "mla.indexer.k_norm.weight"] = x.k_norm.weight
                out[L + "mla.indexer.k_norm.bias"] = x.k_norm.bias
                out[L + "mla.indexer.pool_bias"] = x.index_kpool_compress_ape
        if hasattr(f, "experts"):
            out[L + "moe.router.weight"] = f.gate.weight
            out[L + "moe.router.bias"] = f.gate.e_score_correction_bias
            out[L + "moe.gate_up.weight"] = f.experts.gate_up_proj
            out[L + "moe.down.weight"] = f.experts.down_proj
            s = f.shared_experts
            out[L + "moe.shared.gate_up.weight"] = torch.cat([s.gate_proj.weight, s.up_proj.weight])
            out[L + "moe.shared.down.weight"] = s.down_proj.weight
        else:
            out[L + "mlp.gate_up.weight"] = torch.cat([f.gate_proj.weight, f.up_proj.weight])
            out[L + "mlp.down.weight"] = f.down_proj.weight
    return {k: v.detach() for k, v in out.items()}


# ---- both variants ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_runtime_tensors_equal_hf_modules(tiny, variant):
    path, model = tiny(variant)
    _, got = convert_all(path)
    want = _expected(model)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous(), name
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_architecture_matches_config(tiny, variant):
    path, model = tiny(variant)
    cfg = model.config.text_config
    arch, got = convert_all(path)
    types = {"linear_attention": "linear", "indexed_attention": "full"}
    assert arch.family == "glm5_next" and arch.layer_types == [types[t] for t in cfg.layer_types]
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (VOCAB_SIZE, 64, 128)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 4, 16)
    assert arch.rms_norm_eps == cfg.rms_norm_eps and arch.max_position_embeddings == 512
    assert arch.position_embedding == "none" and arch.ffn_after_mixer and not arch.tie_word_embeddings
    assert arch.swiglu_limit == cfg.swiglu_limit
    m = arch.mla
    assert (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank) == (16, 16, 0, 16, 32)
    attn = model.model.language_model.layers[arch.attention_layers[0]].self_attn
    assert m.softmax_scale == attn.scaling and m.norm_eps == cfg.rms_norm_eps
    r = arch.recurrent
    assert (r.kind, r.num_heads, r.key_head_dim, r.conv_kernel, r.chunk_size) == ("kimi_delta", 4, 16, 4, 64)
    assert r.gate_lower_bound == cfg.linear_lower_bound == -5.0
    d = arch.dsa
    assert (d.num_heads, d.head_dim, d.pool_size, d.num_pools) == (
        8, 16, cfg.index_kpool, cfg.index_topk // cfg.index_kpool)
    assert d.shared_layers == [i for i, t in enumerate(cfg.indexer_types)
                               if t == "shared" and cfg.layer_types[i] == "indexed_attention"]
    assert arch.index_dim == d.cache_dim == 32
    h = arch.mhc
    assert (h.num_streams, h.sinkhorn_iterations, h.eps) == (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    moe = arch.moe
    assert moe.dense_layers == [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, cfg.num_experts_per_tok, 32)
    assert (moe.scoring, moe.score_bias, moe.shared_expert_gate) == ("sigmoid", True, False)
    assert moe.shared_expert_intermediate_size == 32 * cfg.n_shared_experts
    assert (moe.num_groups, moe.num_topk_groups, moe.routed_scaling_factor, moe.norm_topk_prob) == (
        cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
    # parameter count: HF's text parameters plus the routers' score biases (buffers there)
    text = model.model.language_model
    bias = sum(b.numel() for n, b in text.named_buffers() if n.endswith("e_score_correction_bias"))
    hf = sum(p.numel() for p in text.parameters()) + model.lm_head.weight.numel()
    assert num_params(arch) == hf + bias == sum(t.numel() for t in got.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_projections_match_hf_forward(tiny, variant):
    """x @ W.T of the fused projections split per the layout equals what HF's modules compute."""
    path, model = tiny(variant)
    arch, got = convert_all(path)
    x = torch.randn(1, 5, arch.hidden_size, generator=torch.Generator().manual_seed(1))

    def close(ours, theirs):
        torch.testing.assert_close(ours.reshape(5, -1), theirs.reshape(5, -1), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for i, block in enumerate(model.model.language_model.layers):
            m = block.self_attn
            if block.block_type == "linear_attention":
                hf = (m.q_proj(x), m.k_proj(x), m.v_proj(x), m.forget_gate.f_a_proj(x), m.g_a_proj(x), m.b_proj(x))
                ours = (x @ got[f"layers.{i}.kda.in_proj.weight"].T).split([64, 64, 64, 16, 16, 4], -1)
            else:
                hf = (m.q_a_proj(x), m.kv_a_proj_with_mqa(x))
                ours = (x @ got[f"layers.{i}.mla.in_proj.weight"].T).split([32, 16], -1)
                if m.indexer is not None:
                    ix = m.indexer
                    hf += (ix.wk(x), torch.nn.functional.linear(x, ix.index_kpool_compress_gate), ix.weights_proj(x))
                    ours += (x @ got[f"layers.{i}.mla.indexer.in_proj.weight"].T).split([16, 16, 8], -1)
            for o, t in zip(ours, hf, strict=True):
                close(o, t)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_is_reproducible(tiny, variant, tmp_path):
    path, _ = tiny(variant)
    core = assert_reproducible_export(path, tmp_path)
    assert core.manifest.tokenizer.eos_token_ids == [EOS_ID]


# ---- namings, config spellings, what is ignored ---------------------------------------------------------------


def test_transformers_in_memory_names(tiny, tmp_path):
    """What transformers holds in memory: one conv1d, self_attn.forget_gate.*, attn_hc / ffn_hc, stacked experts."""
    src, model = tiny("shared")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "memory")
    state = dict(model.state_dict())
    assert any(".mlp.experts.gate_up_proj" in k for k in state) and any(".attn_hc.fn" in k for k in state)
    write_tensors(path, state)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_flat_and_text_configs(tiny, tmp_path):
    """The text fields at the top level (Glm5NextConfig reads them as its text_config), and glm5_next_text."""
    src, _ = tiny("base")
    arch, _ = convert_all(src)
    top = json.loads((src / "config.json").read_text())
    for model_type in ("glm5_next", "glm5_next_text"):
        path = shutil.copytree(src, tmp_path / model_type)
        flat = {**top["text_config"], "model_type": model_type, "architectures": top["architectures"]}
        (path / "config.json").write_text(json.dumps(flat))
        assert convert_all(path)[0] == arch


def test_config_spellings(tiny, tmp_path):
    """linear_attn_config's keys, num_local_experts, index_topk_pattern, and the defaults of layer_types /
    mlp_layer_types / indexer_types when absent."""
    src, _ = tiny("shared")
    arch, _ = convert_all(src)
    path = shutil.copytree(src, tmp_path / "spellings")

    def respell(c):
        c = {k: v for k, v in c.items() if k not in ("linear_head_dim", "linear_num_heads", "n_routed_experts",
                                                      "indexer_types")}
        return {**c, "num_local_experts": 8, "index_topk_pattern": "FFSF",
                "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}}

    edit_config(path, respell)
    assert convert_all(path)[0] == arch
    base, _ = tiny("base")
    want, _ = convert_all(base)
    path = shutil.copytree(base, tmp_path / "defaults")
    edit_config(path, lambda c: {k: v for k, v in c.items()
                                       if k not in ("layer_types", "mlp_layer_types", "indexer_types")})
    assert convert_all(path)[0] == want


def test_an_unbounded_gate(tiny, tmp_path):
    """linear_lower_bound null: kimi's softplus gate (gate_lower_bound None), unless linear_attn_config's safe_gate
    restores -5 (as Glm5NextTextConfig does)."""
    path = shutil.copytree(tiny("base")[0], tmp_path / "x")
    edit_config(path, lambda c: {**c, "linear_lower_bound": None})
    assert convert_all(path)[0].recurrent.gate_lower_bound is None
    edit_config(path, lambda c: {**c, "linear_attn_config": {"safe_gate": True}})
    assert convert_all(path)[0].recurrent.gate_lower_bound == -5.0


def test_vision_is_ignored_and_a_partial_mtp_block_refused(tiny, tmp_path):
    """model.visual.* (images are a later issue); the MTP block stored as the layer past num_hidden_layers is exported
    whole or refused (tests/ignition/test_mtp_export.py exports a whole one): a fragment is an ExportError."""
    raw = raw_tensors(tiny("base")[0])
    assert any(k.startswith("model.visual.") for k in raw) and convert_all(tiny("base")[0])[0].mtp is None
    path = shutil.copytree(tiny("base")[0], tmp_path / "mtp")
    mtp = {f"{PREFIX}layers.4.eh_proj.weight": torch.zeros(64, 128),
           f"{PREFIX}layers.4.shared_head.norm.weight": torch.zeros(64)}
    write_tensors(path, {**raw, **mtp})
    with pytest.raises(ExportError, match=f"MTP module lacks tensor '{PREFIX}layers.4.enorm.weight'"):
        convert_all(path)


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny("base")[0])  # kda + dense MLP (x3), mla + dsa + moe
    h, v, d, heads, inner, s = 64, VOCAB_SIZE, 16, 4, 64, 2
    kda = (3 * inner + 2 * d + heads) * h + 3 * inner * 4 + 2 * inner * d + inner + heads + d + h * inner
    mla = (32 + 16) * h + 16 + 32 + heads * 16 * 32 + heads * 32 * 16 + h * heads * 16
    dsa = 8 * 16 * 32 + (2 * 16 + 8) * h + 2 * 16 + 4 * 16
    mhc = 2 * ((2 + s) * s * (s * h + 1) + 3)
    moe_read = 8 * (h + 1) + 2 * 3 * h * 32 + 3 * h * 32  # router + bias, top-2 experts, one shared expert
    n = h + v * h + h + 4 * (2 * h + mhc) + 3 * (kda + 3 * h * 128) + mla + dsa + moe_read
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n


def test_cast_to_bfloat16(tiny):
    path, _ = tiny("base")
    raw = raw_tensors(path)
    _, got = convert_all(path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["layers.0.attn_hc.bias"], raw[f"{PREFIX}layers.0.hc_attn_base"].to(torch.bfloat16))


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        (lambda c: {**c, "num_key_value_heads": 2}, "num_key_value_heads=2 differs"),
        (lambda c: {**c, "q_lora_rank": None}, "q_lora_rank is required"),
        (lambda c: {**c, "qk_rope_head_dim": 8}, "qk_rope_head_dim=8"),
        (lambda c: {**c, "index_kpool_always_select_tail": False}, "index_kpool_always_select_tail=false"),
        (lambda c: {**c, "index_topk": 18}, "index_topk=18 must be a positive multiple of index_kpool=4"),
        (lambda c: {**c, "indexer_types": ["full", "full", "full", "shared"]}, "layer 3 reuses the DSA selection"),
        (lambda c: {**c, "indexer_types": ["full"] * 3}, "indexer_types must be"),
        (lambda c: {**c, "layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
         "type 'sliding_attention'"),
        (lambda c: {**c, "mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
        (lambda c: {**c, "n_group": 3}, "n_routed_experts=8 does not split into n_group=3"),
        (lambda c: {**c, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "cannot hold"),
        (lambda c: {**c, "n_shared_experts": 0}, "n_shared_experts=0"),
        (lambda c: {**c, "swiglu_limit": None}, "swiglu_limit=None"),
        (lambda c: {**c, "hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters=0"),
        (lambda c: {**c, "index_head_dim": 8}, r"wq_b.weight' has shape \[128, 32\], the config implies \[64, 32\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny("base")[0], tmp_path, edit, message)


@pytest.mark.parametrize(
    ("name", "shape"),
    [(f"{PREFIX}layers.3.self_attn.o_proj.bias", (64,)), (f"{PREFIX}layers.0.self_attn.q_conv1d.bias", (64,)),
     (f"{PREFIX}layers.3.self_attn.indexer.wk.bias", (16,))],
)
def test_unexpected_tensor(tiny, tmp_path, name, shape):
    assert_tensor_refused(tiny("base")[0], tmp_path, name, shape)
