"""ignition.archs.qwen4_exp: qwen4_exp_text and qwen4_exp (multimodal wrapper) checkpoints -> qwen4_exp cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names):
projections by feeding the identity through HF's own code, norms by running HF's norm modules; the PLE hash
constants against HF's buffers; then the configs transformers accepts that we reject, and reproducible exports.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from ignition.archs import convert, decode_weight_bytes, num_params
from ignition.archs.qwen4_exp import ple_head_vocab_sizes, ple_multipliers
from ignition.errors import ExportError
from ignition.sources.hf import open_hf_dir
from tests.ignition.checkpoint_tools import (
    assert_config_refused,
    assert_reproducible_export,
    assert_tensor_refused,
    convert_all,
    edit_config,
    rewrite_tensors,
)
from tests.ignition.tiny_models import EOS_ID, VOCAB_SIZE, write_tokenizer
from tests.models.qwen4_exp_tiny import _COMMON, IDX, LIN, VARIANTS

# What each checkpoint exercises beyond tests/models/qwen4_exp_tiny's variants:
#   plain     qwen4_exp_text, two indexed layers, sigmoid output gate, partial rotary
#   ple       qwen4_exp_text, PLE on layers 0 and 2 with the table in two shards, 3 streams
#   wrapper   qwen4_exp (Qwen4ExpForConditionalGeneration: a 1-block vision tower, ignored) with PLE, tied
#             embeddings, "full_attention" in layer_types (transformers reads it as indexed_attention)
KINDS = ("plain", "ple", "wrapper")
_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
_MTP = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,)}  # stand-ins for the MTP weights (ignored)


def tiny_hf_model(kind: str, seed: int = 0):
    import transformers as T

    if kind == "wrapper":
        text = {**_COMMON, **VARIANTS["ple"], "layer_types": [LIN, LIN, LIN, "full_attention"]}
        model = T.Qwen4ExpForConditionalGeneration(
            T.Qwen4ExpConfig(text_config=text, vision_config=_VISION, tie_word_embeddings=True))
    else:
        model = T.Qwen4ExpForCausalLM(T.Qwen4ExpTextConfig(**_COMMON, **VARIANTS[kind]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name or p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_exp")
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            model = tiny_hf_model(kind)
            path = root / kind
            model.save_pretrained(path)
            gen = torch.Generator().manual_seed(1)
            rewrite_tensors(path, lambda raw: {**raw, **{n: torch.randn(s, generator=gen) for n, s in _MTP.items()}})
            write_tokenizer(path)
            cache[kind] = (path, model)
        return cache[kind]

    return get


def _text_model(model):
    return model.model.language_model if model.config.model_type == "qwen4_exp" else model.model


def _rows(fn, width: int) -> torch.Tensor:
    """The [out, width] weight of the linear map `fn`, read by feeding it the identity."""
    return fn(torch.eye(width)[None]).reshape(width, -1).T


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    tm = _text_model(model)
    cfg = tm.config
    h, nq, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    shift = lambda w: w.detach() + 1  # noqa: E731  zero-centred RMSNorm: x * (1 + w)

    def hyper(prefix: str, hc) -> dict:
        out = {f"{prefix}.norm.weight": shift(hc.hc_norm.weight),
               f"{prefix}.down.weight": hc.input_mix_weight_down.weight,
               f"{prefix}.up.weight": hc.input_mix_weight_up.weight}
        if hc.block_inject_weight is not None:
            out[f"{prefix}.inject.weight"] = hc.block_inject_weight.weight
        return out

    out = {"embed.weight": tm.embed_tokens.weight, **hyper("hc_head", tm.hyper_connection_mixer)}
    if model.lm_head.weight is not tm.embed_tokens.weight:
        out["lm_head.weight"] = model.lm_head.weight
    for i, lyr in enumerate(tm.layers):
        L = f"layers.{i}."
        out |= hyper(L + "attn_hc", lyr.attn_hyper_connection) | hyper(L + "mlp_hc", lyr.mlp_hyper_connection)
        if hasattr(lyr, "self_attn"):
            a = lyr.self_attn
            q, gate = torch.chunk(a.q_proj(torch.eye(h)).view(h, nq, 2 * d), 2, dim=-1)  # per head [q, gate]
            out[L + "attn.qkv.weight"] = torch.cat([q.reshape(h, -1).T, a.k_proj.weight, a.v_proj.weight,
                                                    gate.reshape(h, -1).T])
            out[L + "attn.q_norm.weight"] = shift(a.q_norm.weight)
            out[L + "attn.k_norm.weight"] = shift(a.k_norm.weight)
            out[L + "attn.o.weight"] = a.o_proj.weight
            ix = a.indexer
            out[L + "attn.indexer.qk.weight"] = _rows(ix.index_qk_proj, h)
            out[L + "attn.indexer.q_norm.weight"] = shift(ix.q_layernorm.weight)
            out[L + "attn.indexer.k_norm.weight"] = shift(ix.k_layernorm.weight)
        else:
            g = lyr.linear_attn
            out[L + "linear.in_proj.weight"] = torch.cat([_rows(getattr(g, f"in_proj_{p}"), h)
                                                          for p in ("qkv", "z", "b", "a")])
            out[L + "linear.conv.weight"] = g.conv1d.weight[:, 0, :]
            out[L + "linear.dt_bias"] = g.dt_bias
            out[L + "linear.A_log"] = g.A_log
            out[L + "linear.norm.weight"] = g.norm.weight  # the gated norm is not zero-centred
            out[L + "linear.out.weight"] = g.out_proj.weight
        m = lyr.mlp
        out[L + "moe.router.weight"] = m.gate.weight
        out[L + "moe.gate_up.weight"] = m.experts.gate_up_proj
        out[L + "moe.down.weight"] = m.experts.down_proj
        s = m.shared_expert
        out[L + "moe.shared.gate_up.weight"] = torch.cat([s.gate_proj.weight, s.up_proj.weight])
        out[L + "moe.shared.down.weight"] = s.down_proj.weight
        out[L + "moe.shared_gate.weight"] = m.shared_expert_gate.weight
        if lyr.ple is not None:
            p = lyr.ple
            out[L + "ple.embed.weight"] = p.ple_embedding.ngram_embedding.weight  # in memory: the shards joined
            out[L + "ple.key.weight"] = p.key_proj.weight
            out[L + "ple.value.weight"] = p.value_proj.weight
            for name in ("key", "query", "conv"):
                out[L + f"ple.{name}_norm.weight"] = shift(getattr(p, f"norm_{name}").weight)
            out[L + "ple.conv.weight"] = p.conv1d.weight[:, 0, :]
    return {k: v.detach() for k, v in out.items()}


# ---- every checkpoint -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_runtime_tensors_equal_hf_modules(tiny, kind):
    path, model = tiny(kind)
    _, got = convert_all(path)
    with torch.no_grad():
        want = _expected(model)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and got[name].is_contiguous(), name
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("kind", KINDS)
def test_architecture_matches_config(tiny, kind):
    path, model = tiny(kind)
    cfg = _text_model(model).config
    arch, got = convert_all(path)
    assert arch.family == "qwen4_exp" and (arch.vocab_size, arch.hidden_size, arch.num_layers) == (VOCAB_SIZE, 64, 4)
    assert arch.layer_types == [{LIN: "linear", IDX: "full"}[t] for t in cfg.layer_types]
    r, ix, hc = arch.recurrent, arch.indexer, arch.hyper_connections
    assert (r.kind, r.num_heads, r.num_key_heads, r.key_head_dim, r.value_head_dim) == ("gated_delta", 4, 2, 16, 16)
    assert r.output_gate == (cfg.output_gate_type or cfg.hidden_act)
    assert (ix.num_heads, ix.head_dim, ix.block_size, ix.num_blocks) == (2, 16, 4, 2)
    assert (hc.num_streams, hc.rank) == (cfg.hc_count, 8)
    assert arch.qk_norm and arch.attn_output_gate and arch.moe.shared_expert_intermediate_size == 32
    assert arch.rotary_dim == (8 if kind == "plain" else None)
    assert arch.tie_word_embeddings == (kind == "wrapper") and ("lm_head.weight" in got) == (kind != "wrapper")
    hf = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual."))
    assert num_params(arch) == hf == sum(t.numel() for t in got.values())


@pytest.mark.parametrize("kind", ("ple", "wrapper"))
def test_ple_constants_equal_hf_buffers(tiny, kind):
    path, model = tiny(kind)
    arch, _ = convert_all(path)
    ple = arch.ple
    assert ple.layers == [0, 2] and ple.ngram_size == 3 and ple.heads_per_ngram == 4 and ple.embed_dim == 64
    assert ple.conv_kernel == 4 and ple.state_width == 9 and ple.reset_token_id == EOS_ID
    for p, i in enumerate(ple.layers):
        e = _text_model(model).layers[i].ple.ple_embedding
        assert ple.multipliers[p] == e.layer_multipliers.tolist()
        assert ple.head_vocab_sizes[p] == e.ngram_heads_vocab_sizes.tolist()
        assert [sum(ple.head_vocab_sizes[p][:h]) for h in range(8)] == e.ngram_heads_offsets.tolist()
        assert ple.table_rows[p] == e.ngram_embedding.weight.shape[0]


def test_ple_constants_derived_without_buffers(tiny, tmp_path):
    """A checkpoint without the hash buffers (transformers then derives them): the same constants."""
    src, _ = tiny("ple")
    want, want_tensors = convert_all(src)
    path = shutil.copytree(src, tmp_path / "x")
    buffers = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    rewrite_tensors(path, lambda raw: {k: v for k, v in raw.items() if not k.endswith(buffers)})
    arch, got = convert_all(path)
    assert arch == want and all(torch.equal(got[n], want_tensors[n]) for n in want_tensors)
    assert ple_multipliers(VOCAB_SIZE, 3, 1, 1234) == arch.ple.multipliers[1]
    assert ple_head_vocab_sizes(1000, 8, 1) == arch.ple.head_vocab_sizes[1]


def test_one_tensor_table(tiny, tmp_path):
    """The n-gram table as one ngram_embedding.weight instead of shards: the same core tensors."""
    src, _ = tiny("ple")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "x")

    def join(raw):
        for i in (0, 2):
            p = f"model.layers.{i}.ple.ple_embedding.ngram_embedding."
            raw[p + "weight"] = torch.cat([raw.pop(p + "shard_0.weight"), raw.pop(p + "shard_1.weight")])
        return raw

    rewrite_tensors(path, join)
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_text_type_reads_the_multimodal_prefix(tiny, tmp_path):
    src, _ = tiny("plain")
    _, want = convert_all(src)
    path = shutil.copytree(src, tmp_path / "x")
    rewrite_tensors(path, lambda raw: {("model.language_model." + k[6:] if k.startswith("model.") else k): v
                                for k, v in raw.items()})
    _, got = convert_all(path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_only_linear_layers_need_no_indexer(tmp_path):
    """transformers builds no indexer without attention layers, so a config without the QSA fields is valid then."""
    import transformers as T

    text = {**{k: v for k, v in _COMMON.items() if not k.startswith("indexer_")}, "layer_types": [LIN] * 4}
    model = T.Qwen4ExpForCausalLM(T.Qwen4ExpTextConfig(**text))
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    arch, got = convert_all(tmp_path)
    assert arch.indexer is None and arch.attention_layers == [] and num_params(arch) == model.num_parameters()


def test_legacy_rope_keys(tiny, tmp_path):
    path = shutil.copytree(tiny("plain")[0], tmp_path / "x")
    edit_config(path, lambda c: {**{k: v for k, v in c.items() if k != "rope_parameters"}, "rope_theta": 1e6,
                                  "partial_rotary_factor": 0.25})
    arch, _ = convert_all(path)
    assert arch.rope_theta == 1e6 and arch.rotary_dim == 4 and arch.rope_scaling is None


@pytest.mark.parametrize("kind", KINDS)
def test_export_is_reproducible(tiny, kind, tmp_path):
    path, _ = tiny(kind)
    core = assert_reproducible_export(path, tmp_path)
    assert not any(n.startswith(("mtp", "visual")) for n in core.tensors)


def test_decode_weight_bytes(tiny):
    arch, _ = convert_all(tiny("ple")[0])  # lin+PLE, lin, lin+PLE, indexed; 3 streams
    h, v, w, r = 64, VOCAB_SIZE, 3 * 64, 8
    mix = w + 2 * r * w
    hc = 2 * (mix + 3 * w)
    gdn = (128 + 64 + 8) * h + 128 * 4 + 8 + 16 + h * 64
    attn = (2 * 4 + 2 * 2) * 16 * h + h * 64 + 32 + 3 * 16 * h + 32  # qkv + gate rows, o, q/k norms, indexer
    moe = 8 * h + 2 * 3 * h * 32 + 3 * h * 32 + h  # router, 2 of 8 experts, the shared expert and its gate
    ple = 64 + (w + h) * 64 + 3 * w + w * 4  # the 8 rows of 8 a token reads, key, value, norms, conv
    n = h + v * h + mix + 4 * (hc + moe) + 3 * gdn + attn + 2 * ple
    assert decode_weight_bytes(arch, "float32") == 4 * n


# ---- configs transformers accepts that the runtime does not serve ---------------------------------------------


@pytest.mark.parametrize(
    ("kind", "edit", "message"),
    [
        ("plain", lambda c: {**c, "indexer_n_heads": None}, "QSA indexer fields are required"),
        ("plain", lambda c: {k: v for k, v in c.items() if not k.startswith("indexer_")}, "missing indexer_n_heads"),
        ("plain", lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        ("plain", lambda c: {**c, "hidden_act": "gelu_pytorch_tanh", "output_gate_type": "silu"},
         "hidden_act 'gelu_pytorch_tanh'"),
        ("plain", lambda c: {**c, "layer_types": [LIN, "sliding_attention", LIN, IDX]},
         "layer type 'sliding_attention'"),
        ("plain", lambda c: {**c, "layer_types": [LIN, IDX]}, "layer_types has 2 entries for 4 layers"),
        ("plain", lambda c: {**c, "rope_parameters": {"rope_theta": 1e4, "rope_type": "longrope", "factor": 2.0}},
         "rope scaling 'longrope'"),
        ("plain", lambda c: {**c, "linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple"),
        ("plain", lambda c: {**c, "num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ("ple", lambda c: {**c, "ple_conv_kernel_size": 1}, "ple_conv_kernel_size=1"),
        ("ple", lambda c: {**c, "ple_embed_dim": 60}, "ple_embed_dim=60 is not a multiple of the 8"),
        ("ple", lambda c: {**c, "ple_layer_ids": [4]}, r"ple_layer_ids \[4\] are not one-indexed linear"),
        ("ple", lambda c: {**c, "eos_token_id": None}, "PLE layers need an eos_token_id"),
        ("plain", lambda c: {**c, "linear_value_head_dim": 8},
         r"in_proj_qkv.weight' has shape \[128, 64\], the config implies \[96, 64\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, kind, edit, message):
    assert_config_refused(tiny(kind)[0], tmp_path, edit, message)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "indexer_kv_heads": 2}, "indexer_kv_heads=2"),
        (lambda c: {**c, "indexer_budget": 6}, "indexer_budget=6 is not a multiple"),
        (lambda c: {**c, "indexer_head_dim": 4}, "8 rotary dims do not fit indexer_head_dim=4"),
        (lambda c: {**c, "output_gate_type": "relu"}, "output_gate_type 'relu'"),
        (lambda c: {**c, "hc_count": 1}, "hc_count=1"),
    ],
)
def test_invalid_config(tiny, tmp_path, edit, message):
    """Configs transformers' own validation refuses are refused here too, with one clear line."""
    path = shutil.copytree(tiny("plain")[0], tmp_path / "x")
    edit_config(path, edit)
    with pytest.raises(ExportError, match=message):
        convert(open_hf_dir(path), torch.float32)


def test_ple_table_shards_must_be_numbered(tiny, tmp_path):
    path = shutil.copytree(tiny("ple")[0], tmp_path / "x")
    p = "model.layers.0.ple.ple_embedding.ngram_embedding."
    rewrite_tensors(path, lambda raw: {**{k: v for k, v in raw.items() if k != p + "shard_1.weight"},
                                p + "shard_2.weight": raw[p + "shard_1.weight"]})
    with pytest.raises(ExportError, match="are not numbered 0..1"):
        convert(open_hf_dir(path), torch.float32)


def test_ple_table_rows_must_match(tiny, tmp_path):
    path = shutil.copytree(tiny("ple")[0], tmp_path / "x")
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight"
    rewrite_tensors(path, lambda raw: {**raw, name: raw[name][:-128]})
    with pytest.raises(ExportError, match="hold 8192 rows, the config implies 8320"):
        convert(open_hf_dir(path), torch.float32)


def test_ple_offsets_must_be_running_sums(tiny, tmp_path):
    path = shutil.copytree(tiny("ple")[0], tmp_path / "x")
    name = "model.layers.2.ple.ple_embedding.ngram_heads_offsets"
    rewrite_tensors(path, lambda raw: {**raw, name: raw[name].flip(0)})
    with pytest.raises(ExportError, match="not the running sums"):
        convert(open_hf_dir(path), torch.float32)


@pytest.mark.parametrize(
    ("kind", "name", "shape"),
    [
        ("plain", "model.layers.1.self_attn.indexer.index_qk_proj.bias", (48,)),
        ("ple", "model.layers.0.ple.conv1d.bias", (192,)),
        ("ple", "model.layers.1.ple.key_proj.weight", (192, 64)),  # PLE weights on a layer without PLE
    ],
)
def test_unexpected_tensor(tiny, tmp_path, kind, name, shape):
    assert_tensor_refused(tiny(kind)[0], tmp_path, name, shape)
