"""ignition.archs.qwen3_5: qwen3_5(_text), qwen3_5_moe(_text) and qwen3_next checkpoints -> hybrid cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names):
projections by feeding inputs through HF's own code, norms by running HF's norm modules.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ignition.archs import convert, decode_weight_bytes, num_params
from ignition.errors import ExportError
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
from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, write_tokenizer

MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
WRAPPERS = ("qwen3_5", "qwen3_5_moe")
FAMILY = {"qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
          "qwen3_5_moe": "qwen3_5_moe", "qwen3_next": "qwen3_next"}
LIN, FULL = "linear_attention", "full_attention"

# dk != dv and Nq*D != H where possible, so a swapped dimension shows up as a shape error
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=4, max_position_embeddings=256, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
               pad_token_id=PAD_ID, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24)
# What each tiny config exercises:
#   qwen3_5_text      head_dim 32 (Nq*D != H), default layer types (interval 4: lin lin lin full), tied embeddings
#   qwen3_5           M-RoPE keys, theta 1e7; the wrapper's tie_word_embeddings (true) beats its text_config's
#   qwen3_5_moe_text  explicit layer_types lin full lin full
#   qwen3_5_moe       every layer MoE with a shared expert, full_attention_interval 2
#   qwen3_next        partial_rotary_factor 0.5, mlp_only_layers [1], norm_topk_prob false
_TEXT = {
    "qwen3_5_text": dict(head_dim=32, intermediate_size=128, tie_word_embeddings=True),
    "qwen3_5": dict(head_dim=32, intermediate_size=128, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    "qwen3_5_moe_text": dict(**_MOE, layer_types=[LIN, FULL, LIN, FULL]),
    "qwen3_5_moe": dict(**_MOE, full_attention_interval=2),
    "qwen3_next": dict(**_MOE, intermediate_size=128, mlp_only_layers=[1], norm_topk_prob=False,
                       layer_types=[LIN, LIN, FULL, LIN],
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
}
_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)


def tiny_hf_model(model_type: str, seed: int = 0):
    """The HF model of `model_type`'s tiny config, every parameter re-drawn from `seed`."""
    import transformers as T

    text = {**_COMMON, **_TEXT[model_type]}
    if model_type == "qwen3_5_text":
        model = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**text))
    elif model_type == "qwen3_5":
        model = T.Qwen3_5ForConditionalGeneration(
            T.Qwen3_5Config(text_config=text, vision_config=_VISION, tie_word_embeddings=True))
    elif model_type == "qwen3_5_moe_text":
        model = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**text))
    elif model_type == "qwen3_5_moe":
        model = T.Qwen3_5MoeForConditionalGeneration(T.Qwen3_5MoeConfig(text_config=text, vision_config=_VISION))
    else:
        model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**text))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):  # the gated norm multiplies by w (around 1)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:  # zero-centred norms multiply by 1 + w
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # A_log, dt_bias, vision biases
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.eval()


def build_tiny_hybrid(model_type: str, out_dir: Path, seed: int = 0):
    """Save the tiny model and a tokenizer to `out_dir` (MTP heads: tests/ignition/test_mtp_export.py); returns (dir,
    the HF model)."""
    model = tiny_hf_model(model_type, seed)
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir)
    return out_dir, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    cache: dict = {}

    def get(model_type: str):
        if model_type not in cache:
            cache[model_type] = build_tiny_hybrid(model_type, root / model_type)
        return cache[model_type]

    return get


def _text_model(model):
    return model.model.language_model if model.config.model_type in WRAPPERS else model.model


def _text_config(model):
    return model.config.text_config if model.config.model_type in WRAPPERS else model.config


def _rows(fn, hidden: int) -> torch.Tensor:
    """The [out, hidden] weight of the linear map `fn` ([1, T, hidden] -> [1, T, out]), read by feeding the
    identity: exact, and independent of how the module stores its weights."""
    return fn(torch.eye(hidden)[None]).reshape(hidden, -1).T


def _is_moe(model, i: int) -> bool:
    return hasattr(_text_model(model).layers[i].mlp, "experts")


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    tm, cfg = _text_model(model), _text_config(model)
    h, nq, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    shift = lambda w: w.detach() + 1  # noqa: E731  zero-centred RMSNorm: x * (1 + w)
    out = {"embed.weight": tm.embed_tokens.weight, "norm.weight": shift(tm.norm.weight)}
    if model.lm_head.weight is not tm.embed_tokens.weight:
        out["lm_head.weight"] = model.lm_head.weight
    for i, lyr in enumerate(tm.layers):
        L = f"layers.{i}."
        out[L + "attn_norm.weight"] = shift(lyr.input_layernorm.weight)
        out[L + "mlp_norm.weight"] = shift(lyr.post_attention_layernorm.weight)
        if hasattr(lyr, "self_attn"):
            a = lyr.self_attn
            # as Qwen3NextAttention.forward splits q_proj's output: per head [q, gate]
            q, gate = torch.chunk(a.q_proj(torch.eye(h)).view(h, nq, 2 * d), 2, dim=-1)
            rows = [q.reshape(h, -1).T, a.k_proj.weight, a.v_proj.weight, gate.reshape(h, -1).T]
            out[L + "attn.qkv.weight"] = torch.cat(rows)
            out[L + "attn.q_norm.weight"] = shift(a.q_norm.weight)
            out[L + "attn.k_norm.weight"] = shift(a.k_norm.weight)
            out[L + "attn.o.weight"] = a.o_proj.weight
        else:
            g = lyr.linear_attn
            if hasattr(g, "in_proj_qkvz"):  # qwen3_next: HF's own unpacking of the grouped projections
                eye = torch.eye(h)[None]
                parts = g.fix_query_key_value_ordering(g.in_proj_qkvz(eye), g.in_proj_ba(eye))
                rows = [p.reshape(h, -1).T for p in parts]
            else:
                rows = [_rows(getattr(g, f"in_proj_{p}"), h) for p in ("qkv", "z", "b", "a")]
            out[L + "linear.in_proj.weight"] = torch.cat(rows)
            out[L + "linear.conv.weight"] = g.conv1d.weight[:, 0, :]
            out[L + "linear.dt_bias"] = g.dt_bias
            out[L + "linear.A_log"] = g.A_log
            out[L + "linear.norm.weight"] = g.norm.weight  # the gated norm is not zero-centred
            out[L + "linear.out.weight"] = g.out_proj.weight
        m = lyr.mlp
        if _is_moe(model, i):
            out[L + "moe.router.weight"] = m.gate.weight
            out[L + "moe.gate_up.weight"] = m.experts.gate_up_proj  # in memory transformers 5 holds them fused
            out[L + "moe.down.weight"] = m.experts.down_proj
            s = m.shared_expert
            out[L + "moe.shared.gate_up.weight"] = torch.cat([s.gate_proj.weight, s.up_proj.weight])
            out[L + "moe.shared.down.weight"] = s.down_proj.weight
            out[L + "moe.shared_gate.weight"] = m.shared_expert_gate.weight
        else:
            out[L + "mlp.gate_up.weight"] = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            out[L + "mlp.down.weight"] = m.down_proj.weight
    return {k: v.detach() for k, v in out.items()}


# ---- every model type ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_runtime_tensors_equal_hf_modules(tiny, model_type):
    path, model = tiny(model_type)
    _, got = convert_all(path)
    with torch.no_grad():
        want = _expected(model)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous(), name
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_architecture_matches_config(tiny, model_type):
    path, model = tiny(model_type)
    cfg = _text_config(model)
    arch, got = convert_all(path)
    assert arch.family == FAMILY[model_type]
    assert (arch.vocab_size, arch.hidden_size, arch.num_layers) == (VOCAB_SIZE, 64, 4)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, cfg.head_dim)
    assert arch.layer_types == [{LIN: "linear", FULL: "full"}[t] for t in cfg.layer_types]
    assert arch.recurrent_layers == [i for i, t in enumerate(cfg.layer_types) if t == LIN]
    r = arch.recurrent
    assert (r.kind, r.num_heads, r.num_key_heads, r.key_head_dim, r.value_head_dim, r.conv_kernel) == (
        "gated_delta", 4, 2, 16, 8, 4)
    assert r.conv_dim == 2 * 2 * 16 + 4 * 8
    assert arch.qk_norm and arch.attn_output_gate and not arch.attention_bias and not arch.sandwich_norms
    rope = cfg.rope_parameters
    assert arch.rope_theta == rope["rope_theta"] and arch.rope_scaling is None
    assert arch.rotary_dim == int(cfg.head_dim * rope["partial_rotary_factor"])
    assert arch.rms_norm_eps == cfg.rms_norm_eps and arch.max_position_embeddings == 256
    assert arch.hidden_act == "silu" and arch.embedding_scale is None and arch.query_scale is None
    tied = model.lm_head.weight is _text_model(model).embed_tokens.weight
    assert arch.tie_word_embeddings == tied and ("lm_head.weight" in got) == (not tied)
    if FAMILY[model_type] == "qwen3_5":
        assert arch.moe is None and arch.intermediate_size == 128
    else:
        moe = arch.moe
        assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
        assert moe.shared_expert_intermediate_size == 24
        assert moe.dense_layers == [i for i in range(4) if not _is_moe(model, i)]
        # qwen3_5_moe's router renormalises unconditionally; qwen3_next follows its config (false here)
        assert moe.norm_topk_prob is (model_type != "qwen3_next")
    # parameter count: the HF model without the vision tower
    hf = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual."))
    assert num_params(arch) == hf == sum(t.numel() for t in got.values())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_projections_match_hf_forward(tiny, model_type):
    """x @ W.T of the runtime qkv and in_proj, split per the layout, equals what HF's forward computes."""
    path, model = tiny(model_type)
    cfg = _text_config(model)
    arch, got = convert_all(path)
    r = arch.recurrent
    key, value, hv = r.num_key_heads * r.key_head_dim, r.num_heads * r.value_head_dim, r.num_heads
    nq, nkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    x = torch.randn(1, 5, arch.hidden_size, generator=torch.Generator().manual_seed(1))

    def close(ours, theirs):
        torch.testing.assert_close(ours.reshape(5, -1), theirs.reshape(5, -1), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        for i, lyr in enumerate(_text_model(model).layers):
            if cfg.layer_types[i] == FULL:
                a = lyr.self_attn
                q_hf, gate_hf = torch.chunk(a.q_proj(x).view(1, 5, nq, 2 * d), 2, dim=-1)
                q, k, v, gate = (x @ got[f"layers.{i}.attn.qkv.weight"].T).split([nq * d, nkv * d, nkv * d, nq * d], -1)
                for ours, theirs in ((q, q_hf), (k, a.k_proj(x)), (v, a.v_proj(x)), (gate, gate_hf)):
                    close(ours, theirs)
                continue
            g = lyr.linear_attn
            if model_type == "qwen3_next":
                hf = g.fix_query_key_value_ordering(g.in_proj_qkvz(x), g.in_proj_ba(x))
            else:
                hf = (*g.in_proj_qkv(x).split([key, key, value], -1), g.in_proj_z(x), g.in_proj_b(x), g.in_proj_a(x))
            ours = (x @ got[f"layers.{i}.linear.in_proj.weight"].T).split([key, key, value, value, hv, hv], -1)
            for o, t in zip(ours, hf, strict=True):
                close(o, t)
            # the conv: taps oldest first, the last tap on the current token (HF's causal conv1d)
            u = torch.randn(1, r.conv_dim, 7, generator=torch.Generator().manual_seed(2))
            w, K = got[f"layers.{i}.linear.conv.weight"], r.conv_kernel
            padded = F.pad(u, (K - 1, 0))
            ours_conv = sum(w[None, :, j, None] * padded[:, :, j:j + 7] for j in range(K))
            torch.testing.assert_close(ours_conv, g.conv1d(u)[..., :7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_norms_match_hf_modules(tiny, model_type):
    """Every RMSNorm of the text model, run by HF, equals x / rms(x) * stored weight (times silu(z) when gated)."""
    path, model = tiny(model_type)
    _, got = convert_all(path)
    eps = _text_config(model).rms_norm_eps
    gen = torch.Generator().manual_seed(3)
    checked = 0
    with torch.no_grad():
        for name, module in _text_model(model).named_modules():
            kind = type(module).__name__
            if not kind.endswith(("RMSNorm", "RMSNormGated")):
                continue
            runtime = {"norm": "norm", "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
                       "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
                       "linear_attn.norm": "linear.norm"}
            parts = name.split(".")
            target = runtime[".".join(parts[2:])] if parts[0] == "layers" else runtime[name]
            target = (f"layers.{parts[1]}." if parts[0] == "layers" else "") + target + ".weight"
            x = torch.randn(3, module.weight.shape[0], generator=gen)
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * got[target]
            if kind.endswith("Gated"):
                z = torch.randn(x.shape, generator=gen)
                torch.testing.assert_close(module(x, z), normed * F.silu(z), rtol=1e-5, atol=1e-6)
            else:
                torch.testing.assert_close(module(x), normed, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == sum(1 for n in got if n.endswith("norm.weight"))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_export_is_reproducible(tiny, model_type, tmp_path):
    path, _ = tiny(model_type)
    core = assert_reproducible_export(path, tmp_path)
    assert core.manifest.tokenizer.eos_token_ids == [EOS_ID]
    assert not any(n.startswith(("mtp", "visual")) for n in core.tensors)


# ---- sizes, dtypes, layouts ---------------------------------------------------------------------------------------


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny("qwen3_next")[0])  # layers: lin (MoE), lin (dense), full (MoE), lin (MoE)
    h, v, d, nq, nkv = 64, VOCAB_SIZE, 16, 4, 2
    conv_dim, value, hv = 2 * 2 * 16 + 4 * 8, 4 * 8, 4
    recurrent = 2 * h + (conv_dim + value + 2 * hv) * h + conv_dim * 4 + 2 * hv + 8 + h * value
    attn = 2 * h + (2 * nq * d + 2 * nkv * d) * h + h * nq * d + 2 * d  # norms, qkv + gate rows, o, q/k norms
    moe_read = 4 * h + 2 * 3 * h * 32 + 3 * h * 24 + h  # router, top-2 of 4 experts, shared expert and its gate
    dense = 3 * h * 128
    n = h + v * h + h + 3 * recurrent + attn + 3 * moe_read + dense  # embedding row, lm_head, final norm, layers
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * n
    assert decode_weight_bytes(arch, "float32") == 4 * n


def test_cast_to_bfloat16_shifts_in_float32(tiny):
    path, _ = tiny("qwen3_5_text")
    raw = raw_tensors(path)
    _, got = convert_all(path, torch.bfloat16)
    # the zero-centred norms' 1 + w stays float32 (Architecture.float32_norms); every other tensor is bf16
    kept = {n for n, t in got.items() if t.dtype == torch.float32}
    assert kept and all(n == "norm.weight" or n.endswith(("_norm.weight")) for n in kept)
    assert all(t.dtype == torch.bfloat16 for n, t in got.items() if n not in kept)
    w = raw["model.layers.3.self_attn.q_norm.weight"]
    assert torch.equal(got["layers.3.attn.q_norm.weight"], w.float() + 1)
    g = raw["model.layers.0.linear_attn.norm.weight"]
    assert torch.equal(got["layers.0.linear.norm.weight"], g.to(torch.bfloat16))


def test_fused_experts_layout(tiny, tmp_path):
    src, _ = tiny("qwen3_5_moe")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "fused")

    def fuse(raw):
        for i in range(4):
            p = f"model.language_model.layers.{i}.mlp.experts."
            gate_up = [torch.cat([raw.pop(f"{p}{e}.gate_proj.weight"), raw.pop(f"{p}{e}.up_proj.weight")])
                       for e in range(4)]
            raw[p + "gate_up_proj"] = torch.stack(gate_up)
            raw[p + "down_proj"] = torch.stack([raw.pop(f"{p}{e}.down_proj.weight") for e in range(4)])
        return raw

    rewrite_tensors(path, fuse)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_text_type_reads_the_multimodal_prefix(tiny, tmp_path):
    # transformers loads qwen3_5_text from model.language_model.* too (its PrefixChange conversion)
    src, _ = tiny("qwen3_5_text")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "prefixed")

    def prefix(raw):
        out = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in raw.items()}
        return {**out, "model.visual.patch_embed.proj.weight": torch.zeros(2)}

    rewrite_tensors(path, prefix)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_transformers_4_config(tmp_path):
    """Hub configs of qwen3_next are 4.x-shaped: rope_theta / partial_rotary_factor / full_attention_interval."""
    import transformers as T

    text = {k: v for k, v in {**_COMMON, **_TEXT["qwen3_next"]}.items() if k not in ("layer_types", "rope_parameters")}
    legacy = {**text, "model_type": "qwen3_next", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
              "rope_scaling": None, "full_attention_interval": 2}
    model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig.from_dict(legacy))
    assert model.config.layer_types == [LIN, FULL, LIN, FULL]
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    arch, _ = convert_all(tmp_path)
    assert arch.layer_types == ["linear", "full", "linear", "full"]
    assert arch.rope_theta == 1e6 and arch.rotary_dim == 8 and arch.rope_scaling is None
    assert num_params(arch) == model.num_parameters()


def test_rope_scaling_and_defaults(tiny, tmp_path):
    path = shutil.copytree(tiny("qwen3_5")[0], tmp_path / "yarn")
    yarn = {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0, "original_max_position_embeddings": 64,
            "mrope_section": [2, 1, 1]}  # no partial_rotary_factor: the config classes' 0.25
    edit_config(path, lambda c: {**c, "rope_parameters": yarn})
    arch, _ = convert_all(path)
    assert arch.rotary_dim == 8 and arch.rope_theta == 1e7
    s = arch.rope_scaling
    assert (s.type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 64)


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "edit", "message"),
    [
        ("qwen3_5_text", lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        ("qwen3_next", lambda c: {**c, "hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
        ("qwen3_5", lambda c: {**c, "rope_parameters": {"rope_type": "longrope", "factor": 2.0}},
         "rope scaling 'longrope'"),
        ("qwen3_5_moe", lambda c: {**c, "layer_types": [LIN, "sliding_attention", LIN, FULL]},
         "layer type 'sliding_attention'"),
        ("qwen3_5_moe_text", lambda c: {**c, "layer_types": [LIN, FULL]}, "layer_types has 2 entries for 4 layers"),
        ("qwen3_next", lambda c: {**c, "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.1}},
         "partial_rotary_factor=0.1 gives 1 rotary dims"),
        ("qwen3_5_text", lambda c: {**c, "linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple"),
        ("qwen3_5_moe", lambda c: {**c, "shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
        ("qwen3_5_text", lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "lacks 'hidden_size'"),
        ("qwen3_5_moe_text", lambda c: {**c, "linear_value_head_dim": 16},
         r"in_proj_qkv.weight' has shape \[96, 64\], the config implies \[128, 64\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, model_type, edit, message):
    assert_config_refused(tiny(model_type)[0], tmp_path, edit, message)


def test_wrapper_without_text_config(tiny, tmp_path):
    path = shutil.copytree(tiny("qwen3_5")[0], tmp_path / "x")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["text_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="model_type qwen3_5 without a text_config"):
        convert(open_hf_dir(path), torch.float32)


@pytest.mark.parametrize(
    ("model_type", "name", "shape"),
    [
        ("qwen3_5_text", "model.layers.3.self_attn.o_proj.bias", (64,)),
        ("qwen3_next", "model.layers.0.linear_attn.conv1d.bias", (96,)),
        ("qwen3_5_moe", "model.language_model.layers.0.mlp.shared_expert_gate.bias", (1,)),
    ],
)
def test_unexpected_tensor(tiny, tmp_path, model_type, name, shape):
    assert_tensor_refused(tiny(model_type)[0], tmp_path, name, shape)
