"""ignition.archs.nemotron_h: NemotronH checkpoints (Mamba-2, positionless attention, relu2 MLP, sigmoid-routed MoE)
-> hybrid cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names);
the in_proj split, the conv and the attention projections by feeding inputs through HF's own modules.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from ignition.archs import convert, decode_weight_bytes, num_params
from ignition.sources.hf import open_hf_dir
from tests.ignition.checkpoint_tools import (
    assert_config_refused,
    assert_reproducible_export,
    assert_tensor_refused,
    convert_all,
    edit_config,
    raw_tensors,
    rewrite_tensors,
)
from tests.ignition.tiny_models import EOS_ID, VOCAB_SIZE
from tests.models.nemotron_h_tiny import VARIANTS, build_nemotron_h, nemotron_h_model

# stand-ins for the multi-token-prediction weights real checkpoints carry (ignored until the speculative issue)
_MTP = {"mtp.layers.0.norm.weight": (64,), "mtp.layers.0.mixer.q_proj.weight": (64, 64)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h")
    cache: dict = {}

    def get(variant: str):
        if variant not in cache:
            path = build_nemotron_h(root / variant, variant)
            gen = torch.Generator().manual_seed(5)
            rewrite_tensors(path, lambda raw: {**raw, **{n: torch.randn(s, generator=gen) for n, s in _MTP.items()}})
            cache[variant] = path, nemotron_h_model(variant)
        return cache[variant]

    return get


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    tm = model.model
    out = {"embed.weight": tm.embeddings.weight, "norm.weight": tm.norm_f.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(tm.layers):
        L, m = f"layers.{i}.", block.mixer
        kind = block.block_type
        out[L + ("mlp_norm" if kind in ("mlp", "moe") else "attn_norm") + ".weight"] = block.norm.weight
        if kind == "linear_attention":
            out[L + "mamba.in_proj.weight"] = m.in_proj.weight
            out[L + "mamba.conv.weight"] = m.conv1d.weight[:, 0, :]
            out[L + "mamba.conv.bias"] = m.conv1d.bias
            for name in ("dt_bias", "A_log", "D"):
                out[L + f"mamba.{name}"] = getattr(m, name)
            out[L + "mamba.norm.weight"] = m.norm.weight
            out[L + "mamba.out.weight"] = m.out_proj.weight
        elif kind == "full_attention":
            out[L + "attn.qkv.weight"] = torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])
            out[L + "attn.o.weight"] = m.o_proj.weight
        elif kind == "mlp":
            out[L + "mlp.up.weight"] = m.up_proj.weight
            out[L + "mlp.down.weight"] = m.down_proj.weight
        else:
            out[L + "moe.router.weight"] = m.gate.weight
            out[L + "moe.router.bias"] = m.gate.e_score_correction_bias
            out[L + "moe.up.weight"] = m.experts.up_proj  # in memory transformers 5 holds them stacked
            out[L + "moe.down.weight"] = m.experts.down_proj
            out[L + "moe.shared.up.weight"] = m.shared_experts.up_proj.weight
            out[L + "moe.shared.down.weight"] = m.shared_experts.down_proj.weight
            if isinstance(m.fc1_latent_proj, torch.nn.Linear):
                out[L + "moe.latent_in.weight"] = m.fc1_latent_proj.weight
                out[L + "moe.latent_out.weight"] = m.fc2_latent_proj.weight
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
    types = {"linear_attention": "linear", "full_attention": "full", "mlp": "ffn", "moe": "ffn"}
    assert arch.family == "nemotron_h" and arch.layer_types == [types[t] for t in cfg.layers_block_type]
    assert arch.attention_layers == [i for i, t in enumerate(cfg.layers_block_type) if t == "full_attention"]
    assert arch.recurrent_layers == [i for i, t in enumerate(cfg.layers_block_type) if t == "linear_attention"]
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (VOCAB_SIZE, 64, 128)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.rms_norm_eps == cfg.layer_norm_epsilon and arch.max_position_embeddings == 512
    assert arch.hidden_act == "relu2" and arch.position_embedding == "none" and not arch.ffn_after_mixer
    assert not arch.tie_word_embeddings and not arch.qk_norm and not arch.attention_bias
    r = arch.recurrent
    assert (r.kind, r.num_heads, r.num_key_heads, r.key_head_dim, r.value_head_dim, r.conv_kernel) == (
        "mamba2", 8, cfg.n_groups, 16, 16, 4)
    assert r.conv_dim == 8 * 16 + 2 * cfg.n_groups * 16  # Mamba-2's conv channels: x, B, C
    assert (r.chunk_size, r.conv_bias, r.time_step_limit) == (cfg.chunk_size, True, None)
    assert r.norm_group_size == 8 * 16 // cfg.n_groups
    moe = arch.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (cfg.n_routed_experts, 2, 32)
    assert moe.dense_layers == [i for i, t in enumerate(cfg.layers_block_type) if t == "mlp"]
    assert (moe.scoring, moe.score_bias, moe.shared_expert_gate, moe.shared_expert_intermediate_size) == (
        "sigmoid", True, False, 32)
    assert (moe.num_groups, moe.num_topk_groups, moe.routed_scaling_factor) == (
        cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    assert moe.norm_topk_prob == cfg.norm_topk_prob and moe.latent_size == (cfg.moe_latent_size or 0)
    # parameter count: HF's parameters plus the router's score bias (a buffer there)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert num_params(arch) == model.num_parameters() + bias == sum(t.numel() for t in got.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_projections_match_hf_forward(tiny, variant):
    """x @ W.T of the runtime in_proj split per the layout, the conv and qkv equal what HF's modules compute."""
    path, model = tiny(variant)
    arch, got = convert_all(path)
    r = arch.recurrent
    inner, groups = r.num_heads * r.value_head_dim, r.num_key_heads * r.key_head_dim
    x = torch.randn(1, 5, arch.hidden_size, generator=torch.Generator().manual_seed(1))

    def close(ours, theirs):
        torch.testing.assert_close(ours.reshape(5, -1), theirs.reshape(5, -1), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for i, block in enumerate(model.model.layers):
            m = block.mixer
            if block.block_type == "full_attention":
                nq, nkv, d = arch.num_heads * 16, arch.num_kv_heads * 16, 16
                q, k, v = (x @ got[f"layers.{i}.attn.qkv.weight"].T).split([nq, nkv, nkv], -1)
                for ours, theirs in ((q, m.q_proj(x)), (k, m.k_proj(x)), (v, m.v_proj(x))):
                    close(ours, theirs)
            if block.block_type != "linear_attention":
                continue
            # as NemotronHMamba2Mixer.forward splits its projection: gate, xBC (then x, B, C), dt
            gate, xbc, dt = m.in_proj(x).split([inner, r.conv_dim, r.num_heads], -1)
            hf = (gate, *xbc.split([inner, groups, groups], -1), dt)
            rows = [inner, inner, groups, groups, r.num_heads]
            ours = (x @ got[f"layers.{i}.mamba.in_proj.weight"].T).split(rows, -1)
            for o, t in zip(ours, hf, strict=True):
                close(o, t)
            # the conv: taps oldest first, the last tap on the current token, plus the bias
            u = torch.randn(1, r.conv_dim, 7, generator=torch.Generator().manual_seed(2))
            w, K = got[f"layers.{i}.mamba.conv.weight"], r.conv_kernel
            padded = torch.nn.functional.pad(u, (K - 1, 0))
            ours_conv = sum(w[None, :, j, None] * padded[:, :, j:j + 7] for j in range(K))
            ours_conv = ours_conv + got[f"layers.{i}.mamba.conv.bias"][None, :, None]
            torch.testing.assert_close(ours_conv, m.conv1d(u)[..., :7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_is_reproducible(tiny, variant, tmp_path):
    path, _ = tiny(variant)
    core = assert_reproducible_export(path, tmp_path)
    assert core.manifest.tokenizer.eos_token_ids == [EOS_ID]
    assert not any(n.startswith("mtp") for n in core.tensors)


# ---- sizes, dtypes, layouts ---------------------------------------------------------------------------------------


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny("grouped")[0])  # mamba, moe, attention, mlp, mamba, moe
    h, v, d, nq, nkv = 64, VOCAB_SIZE, 16, 4, 2
    inner, conv_dim, heads = 8 * 16, 8 * 16 + 2 * 2 * 16, 8
    mamba = h + (inner + conv_dim + heads) * h + conv_dim * 5 + 3 * heads + inner + h * inner  # norm .. out
    attn = h + (nq + 2 * nkv) * d * h + h * nq * d
    moe_read = h + 8 * (h + 1) + 2 * 2 * h * 32 + 2 * h * 32  # norm, router + bias, top-2 experts, shared expert
    mlp = h + 2 * h * 128
    n = h + v * h + h + 2 * mamba + attn + 2 * moe_read + mlp  # embedding row, lm_head, final norm, layers
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n
    assert decode_weight_bytes(arch, "float32") == 4 * n


def test_cast_to_bfloat16(tiny):
    path, _ = tiny("grouped")
    raw = raw_tensors(path)
    _, got = convert_all(path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["layers.0.mamba.A_log"], raw["backbone.layers.0.mixer.A_log"].to(torch.bfloat16))


def test_stacked_experts_under_the_model_prefix(tiny, tmp_path):
    """What transformers holds in memory: model.* names, each MoE layer's experts stacked [E, out, in]."""
    src, _ = tiny("latent")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "stacked")

    def restack(raw):
        raw = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): t for k, t in raw.items()}
        p = "model.layers.2.mixer.experts."
        for proj in ("up", "down"):
            raw[f"{p}{proj}_proj"] = torch.stack([raw.pop(f"{p}{e}.{proj}_proj.weight") for e in range(4)])
        return raw

    rewrite_tensors(path, restack)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_legacy_config_names(tiny, tmp_path):
    """Older configs: hybrid_override_pattern, mamba_* names, legacy block type names, Python's Infinity."""
    src, _ = tiny("grouped")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "legacy")

    def legacy(c):
        c = {k: v for k, v in c.items() if k not in ("layers_block_type", "n_groups", "chunk_size", "time_step_limit")}
        return {**c, "hybrid_override_pattern": "ME*-ME", "num_hidden_layers": 6, "mamba_n_groups": 2,
                "mamba_chunk_size": 8, "mamba_dt_limit": [0.0, "Infinity"]}

    edit_config(path, legacy)
    arch, got = convert_all(path)
    assert arch == convert_all(src)[0] and all(torch.equal(got[n], want[n]) for n in want)
    edit_config(path, lambda c: {k: v for k, v in c.items() if k != "hybrid_override_pattern"}
                 | {"layer_types": ["mamba", "moe", "attention", "mlp", "mamba", "moe"]})
    assert convert_all(path)[0] == arch


def test_time_step_limit_is_kept(tiny, tmp_path):
    path = shutil.copytree(tiny("grouped")[0], tmp_path / "limit")
    edit_config(path, lambda c: {**c, "time_step_limit": [0.001, {"__float__": "Infinity"}]})
    assert convert(open_hf_dir(path), torch.float32)[0].recurrent.time_step_limit == (0.001, math.inf)


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'"),
        (lambda c: {**c, "mamba_hidden_act": "gelu"}, "mamba_hidden_act 'gelu'"),
        (lambda c: {**c, "use_bias": True}, "use_bias=true"),
        (lambda c: {**c, "mlp_bias": True}, "mlp_bias=true"),
        (lambda c: {**c, "layers_block_type": ["linear_attention", "sliding_attention"]},
         "block type 'sliding_attention'"),
        (lambda c: {k: v for k, v in c.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "M?"},
         r"unknown block symbols \['\?'\]"),
        (lambda c: {**c, "mamba_num_heads": 7}, "mamba_num_heads=7 is not a multiple of n_groups=2"),
        (lambda c: {**c, "n_group": 3}, "n_routed_experts=8 does not split into n_group=3"),
        (lambda c: {**c, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "cannot hold"),
        (lambda c: {**c, "moe_shared_expert_intermediate_size": 0}, "moe_shared_expert_intermediate_size=0"),
        (lambda c: {**c, "time_step_limit": [0.1, 0.01]}, "is not 0 <= min <= max"),
        (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "lacks 'vocab_size'"),
        (lambda c: {**c, "ssm_state_size": 8},
         r"in_proj.weight' has shape \[328, 64\], the config implies \[296, 64\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny("grouped")[0], tmp_path, edit, message)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("backbone.layers.2.mixer.o_proj.bias", (64,)), ("backbone.layers.3.mixer.up_proj.bias", (128,))],
)
def test_unexpected_tensor(tiny, tmp_path, name, shape):
    assert_tensor_refused(tiny("grouped")[0], tmp_path, name, shape)
