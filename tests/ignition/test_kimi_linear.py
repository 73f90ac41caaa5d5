"""ignition.archs.kimi_linear: KimiLinear checkpoints (Kimi delta attention, NoPE multi-head latent attention, a
SwiGLU MLP or sigmoid-routed experts with shared experts) -> hybrid cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names);
the fused projections and the conv by feeding inputs through HF's own modules. Both namings convert alike: the
released checkpoints' (what transformers saves) and the one transformers holds in memory.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from ignition.archs import decode_weight_bytes, num_params
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
from tests.models.kimi_linear_tiny import VARIANTS, build_kimi_linear, kimi_linear_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return variant_cache(tmp_path_factory.mktemp("kimi_linear"), build_kimi_linear, kimi_linear_model)


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    tm = model.model
    out = {"embed.weight": tm.embed_tokens.weight, "norm.weight": tm.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(tm.layers):
        L, m, f = f"layers.{i}.", block.self_attn, block.mlp
        out[L + "attn_norm.weight"] = block.input_layernorm.weight
        out[L + "mlp_norm.weight"] = block.post_attention_layernorm.weight
        if block.block_type == "linear_attention":
            gate = m.forget_gate
            out[L + "kda.in_proj.weight"] = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight,
                                                      gate.f_a_proj.weight, m.g_a_proj.weight, m.b_proj.weight])
            out[L + "kda.conv.weight"] = m.conv1d.weight[:, 0, :]
            out[L + "kda.f_b.weight"] = gate.f_b_proj.weight
            out[L + "kda.dt_bias"] = gate.dt_bias
            out[L + "kda.A_log"] = gate.A_log.reshape(-1)
            out[L + "kda.g_b.weight"] = m.g_b_proj.weight
            out[L + "kda.norm.weight"] = m.o_norm.weight
            out[L + "kda.out.weight"] = m.o_proj.weight
        else:
            q = m.q_proj if m.q_lora_rank is None else m.q_a_proj
            out[L + "mla.in_proj.weight"] = torch.cat([q.weight, m.kv_a_proj_with_mqa.weight])
            if m.q_lora_rank is not None:
                out[L + "mla.q_a_norm.weight"] = m.q_a_layernorm.weight
                out[L + "mla.q_b.weight"] = m.q_b_proj.weight
            out[L + "mla.kv_a_norm.weight"] = m.kv_a_layernorm.weight
            out[L + "mla.kv_b.weight"] = m.kv_b_proj.weight
            out[L + "mla.o.weight"] = m.o_proj.weight
        if hasattr(f, "experts"):
            out[L + "moe.router.weight"] = f.gate.weight
            out[L + "moe.router.bias"] = f.gate.e_score_correction_bias
            out[L + "moe.gate_up.weight"] = f.experts.gate_up_proj  # in memory transformers 5 holds them stacked
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
    cfg = model.config
    arch, got = convert_all(path)
    types = {"linear_attention": "linear", "full_attention": "full"}
    assert arch.family == "kimi_linear" and arch.layer_types == [types[t] for t in cfg.layer_types]
    assert arch.attention_layers == [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert arch.recurrent_layers == [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (VOCAB_SIZE, 64, 128)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 4, 16 + 8)
    assert arch.rms_norm_eps == cfg.rms_norm_eps and arch.max_position_embeddings == 512
    assert arch.position_embedding == "none" and arch.ffn_after_mixer and not arch.tie_word_embeddings
    m = arch.mla
    assert (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank) == (
        16, 16, 8, 16, cfg.q_lora_rank)
    assert m.softmax_scale == model.model.layers[arch.attention_layers[0]].self_attn.scaling and m.norm_eps == 1e-6
    r = arch.recurrent
    assert (r.kind, r.num_heads, r.num_key_heads, r.key_head_dim, r.value_head_dim, r.conv_kernel) == (
        "kimi_delta", 4, 4, 16, 16, 4)
    assert r.conv_dim == 3 * 4 * 16 and r.chunk_size == 64 and not r.conv_bias
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, cfg.num_experts_per_tok, 32)
    assert moe.dense_layers == [i for i, t in enumerate(cfg.mlp_layer_types) if t == "dense"]
    assert (moe.scoring, moe.score_bias, moe.shared_expert_gate) == ("sigmoid", True, False)
    assert moe.shared_expert_intermediate_size == 32 * cfg.n_shared_experts
    assert (moe.num_groups, moe.num_topk_groups, moe.routed_scaling_factor, moe.norm_topk_prob) == (
        cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob)
    # parameter count: HF's parameters plus the routers' score biases (buffers there)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert num_params(arch) == model.num_parameters() + bias == sum(t.numel() for t in got.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_projections_match_hf_forward(tiny, variant):
    """x @ W.T of the fused projections split per the layout, and the conv, equal what HF's modules compute."""
    path, model = tiny(variant)
    arch, got = convert_all(path)
    x = torch.randn(1, 5, arch.hidden_size, generator=torch.Generator().manual_seed(1))

    def close(ours, theirs):
        torch.testing.assert_close(ours.reshape(5, -1), theirs.reshape(5, -1), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            m = block.self_attn
            if block.block_type == "full_attention":
                q = m.q_proj(x) if m.q_lora_rank is None else m.q_a_proj(x)
                kv, rope = m.kv_a_proj_with_mqa(x).split([16, 8], -1)
                ours = (x @ got[f"layers.{i}.mla.in_proj.weight"].T).split([q.shape[-1], 16, 8], -1)
                for o, t in zip(ours, (q, kv, rope), strict=True):
                    close(o, t)
                continue
            hf = (m.q_proj(x), m.k_proj(x), m.v_proj(x), m.forget_gate.f_a_proj(x), m.g_a_proj(x), m.b_proj(x))
            ours = (x @ got[f"layers.{i}.kda.in_proj.weight"].T).split([64, 64, 64, 16, 16, 4], -1)
            for o, t in zip(ours, hf, strict=True):
                close(o, t)
            # the conv: taps oldest first, the last tap on the current token; q, k, v channels in that order
            u = torch.randn(1, 3 * 64, 7, generator=torch.Generator().manual_seed(2))
            w, k = got[f"layers.{i}.kda.conv.weight"], 4
            padded = torch.nn.functional.pad(u, (k - 1, 0))
            ours_conv = sum(w[None, :, j, None] * padded[:, :, j:j + 7] for j in range(k))
            torch.testing.assert_close(ours_conv, m.conv1d(u)[..., :7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_is_reproducible(tiny, variant, tmp_path):
    path, _ = tiny(variant)
    core = assert_reproducible_export(path, tmp_path)
    assert core.manifest.tokenizer.eos_token_ids == [EOS_ID]


# ---- namings, config spellings, sizes -----------------------------------------------------------------------------


def test_transformers_in_memory_names(tiny, tmp_path):
    """What transformers holds in memory: one conv1d, self_attn.forget_gate.*, mlp.* with experts stacked, A_log
    flat."""
    src, model = tiny("grouped")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "memory")
    state = {k: v for k, v in model.state_dict().items()}
    state["model.layers.0.self_attn.forget_gate.A_log"] = state["model.layers.0.self_attn.forget_gate.A_log"].flatten()
    write_tensors(path, state)
    assert any(".mlp.experts.gate_up_proj" in k for k in state) and any("forget_gate" in k for k in state)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_config_spellings(tiny, tmp_path):
    """linear_attn_config's 1-indexed layer lists for layer_types, first_k_dense_replace for mlp_layer_types, and
    KimiLinearConfig's alias names for the checkpoint's."""
    src, _ = tiny("base")
    arch, _ = convert_all(src)
    path = shutil.copytree(src, tmp_path / "spellings")
    renames = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
               "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group",
               "num_shared_experts": "n_shared_experts", "model_max_length": "max_position_embeddings"}

    def respell(c):
        c = {renames.get(k, k): v for k, v in c.items() if k not in ("layer_types", "mlp_layer_types")}
        return {**c, "first_k_dense_replace": 1}

    edit_config(path, respell)
    assert convert_all(path)[0] == arch


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny("base")[0])  # kda + dense MLP, kda + moe, kda + moe, mla + moe
    h, v, d, heads, inner = 64, VOCAB_SIZE, 16, 4, 64
    kda = (3 * inner + 2 * d + heads) * h + 3 * inner * 4 + 2 * inner * d + inner + heads + d + h * inner
    mla = (heads * 24 + 16 + 8) * h + 16 + heads * 32 * 16 + h * heads * 16
    moe_read = 8 * (h + 1) + 2 * 3 * h * 32 + 3 * h * 32  # router + bias, top-2 experts, one shared expert
    n = h + v * h + h + 4 * 2 * h + 3 * kda + mla + 3 * h * 128 + 3 * moe_read  # embedding row, lm_head, norms
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n


def test_cast_to_bfloat16(tiny):
    path, _ = tiny("base")
    raw = raw_tensors(path)
    _, got = convert_all(path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["layers.0.kda.dt_bias"], raw["model.layers.0.self_attn.dt_bias"].to(torch.bfloat16))


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        (lambda c: {**c, "num_key_value_heads": 2}, "num_key_value_heads=2 differs"),
        (lambda c: {**c, "moe_router_activation_func": "softmax"}, "moe_router_activation_func 'softmax'"),
        (lambda c: {**c, "layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
         "type 'sliding_attention'"),
        (lambda c: {k: v for k, v in c.items() if k != "layer_types"}
         | {"linear_attn_config": {**c["linear_attn_config"], "full_attn_layers": [5]}}, "names layer 5"),
        (lambda c: {**c, "mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
        (lambda c: {**c, "num_expert_group": 3}, "num_experts=8 does not split into num_expert_group=3"),
        (lambda c: {**c, "num_expert_group": 4, "topk_group": 1, "num_experts_per_token": 3}, "cannot hold"),
        (lambda c: {**c, "num_shared_experts": 0}, "num_shared_experts=0"),
        (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "lacks 'vocab_size'"),
        (lambda c: {**c, "kv_lora_rank": 8},
         r"kv_a_proj_with_mqa.weight' has shape \[24, 64\], the config implies \[16, 64\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny("base")[0], tmp_path, edit, message)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("model.layers.3.self_attn.o_proj.bias", (64,)), ("model.layers.0.self_attn.q_conv1d.bias", (64,))],
)
def test_unexpected_tensor(tiny, tmp_path, name, shape):
    assert_tensor_refused(tiny("base")[0], tmp_path, name, shape)
