"""ignition.archs.deepseek_v4: DeepseekV4ForCausalLM checkpoints -> deepseek_v4 cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names); the
fused projection by feeding inputs through HF's own modules. The layout transformers saves (under model.) and the
published one (top level: embed.weight, hc_head_fn, head.weight) convert alike; a config with the published
checkpoint's keys (legacy compress_ratios, num_hash_layers, qk_rope_head_dim, a flat yarn rope_scaling) reads as
DeepseekV4Config reads it; the MTP block is ignored; the configs transformers accepts that we reject.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ignition.archs import convert, decode_weight_bytes, num_params
from ignition.errors import ExportError
from ignition.sources.hf import open_hf_dir
from tests.ignition.checkpoint_tools import assert_config_refused, convert_all, raw_tensors, write_tensors
from tests.models.deepseek_v4_tiny import build_deepseek_v4, deepseek_v4_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v4") / "hf"
    return build_deepseek_v4(path), deepseek_v4_model()


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    m = model.model
    out = {"embed.weight": m.embed_tokens.weight, "norm.weight": m.norm.weight, "lm_head.weight": model.lm_head.weight,
           "hc_head.proj.weight": m.hc_head.hc_fn, "hc_head.bias": m.hc_head.hc_base,
           "hc_head.scale": m.hc_head.hc_scale}
    for i, block in enumerate(m.layers):
        L, a, f = f"layers.{i}.", block.self_attn, block.mlp
        out[L + "attn_norm.weight"] = block.input_layernorm.weight
        out[L + "mlp_norm.weight"] = block.post_attention_layernorm.weight
        for hc, name in ((block.attn_hc, "attn_hc"), (block.ffn_hc, "mlp_hc")):
            out.update({L + name + ".proj.weight": hc.fn, L + name + ".bias": hc.base, L + name + ".scale": hc.scale})
        rows = [a.q_a_proj.weight, a.kv_proj.weight]
        if a.compressor is not None:
            c = a.compressor
            rows += [c.kv_proj.weight, c.gate_proj.weight]
            out[L + "attn.compressor.position_bias"] = c.position_bias
            out[L + "attn.compressor.norm.weight"] = c.kv_norm.weight
            ix = getattr(c, "indexer", None)
            if ix is not None:
                rows += [ix.kv_proj.weight, ix.gate_proj.weight, ix.scorer.weights_proj.weight]
                out[L + "attn.indexer.q_b.weight"] = ix.q_b_proj.weight
                out[L + "attn.indexer.compressor.position_bias"] = ix.position_bias
                out[L + "attn.indexer.compressor.norm.weight"] = ix.kv_norm.weight
        out[L + "attn.in_proj.weight"] = torch.cat(rows)
        out.update({L + "attn.q_a_norm.weight": a.q_a_norm.weight, L + "attn.q_b.weight": a.q_b_proj.weight,
                    L + "attn.kv_norm.weight": a.kv_norm.weight, L + "attn.o_a.weight": a.o_a_proj.weight,
                    L + "attn.o_b.weight": a.o_b_proj.weight, L + "attn.sinks": a.sinks})
        out[L + "moe.router.weight"] = f.gate.weight
        if f.is_hash:
            out[L + "moe.tid2eid"] = f.gate.tid2eid.to(torch.int32)
        else:
            out[L + "moe.router.bias"] = f.gate.e_score_correction_bias
        out[L + "moe.gate_up.weight"] = f.experts.gate_up_proj
        out[L + "moe.down.weight"] = f.experts.down_proj
        s = f.shared_experts
        out[L + "moe.shared.gate_up.weight"] = torch.cat([s.gate_proj.weight, s.up_proj.weight])
        out[L + "moe.shared.down.weight"] = s.down_proj.weight
    return out


def test_runtime_tensors_equal_hf_modules(tiny):
    path, model = tiny
    arch, got = convert_all(path)
    want = _expected(model)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].is_contiguous() and torch.equal(got[name], t), name
    # HF's parameters and buffers (the score biases, the hash tables)
    hf = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith(("e_score_correction_bias", "tid2eid")))
    assert num_params(arch) == hf == sum(t.numel() for t in got.values())
    # a decode step reads 2 of the 8 experts and one row of each hash table
    h, fm, v = 64, 32, arch.vocab_size
    unread = 4 * 6 * 3 * h * fm + 2 * (v - 1) * 2 + v * h - h
    assert decode_weight_bytes(arch, torch.float32) == 4 * (num_params(arch) - unread)


def test_the_fused_projection_matches_hf(tiny):
    """x @ in_proj.T split per the layout equals what HF's modules compute (a CSA layer: all seven parts)."""
    path, model = tiny
    _, got = convert_all(path)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    a = model.model.layers[1].self_attn
    c, ix = a.compressor, a.compressor.indexer
    with torch.no_grad():
        hf = [a.q_a_proj(x), a.kv_proj(x), c.kv_proj(x), c.gate_proj(x), ix.kv_proj(x), ix.gate_proj(x),
              ix.scorer.weights_proj(x)]
        ours = (x @ got["layers.1.attn.in_proj.weight"].T).split([32, 32, 64, 64, 32, 32, 8], -1)
    for o, t in zip(ours, hf, strict=True):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)


def test_the_published_layout_and_config_keys(tiny, tmp_path):
    """Top-level names (embed.weight, hc_head_fn, no model. prefix) and the published config keys:
    compress_ratios (with the MTP layer's entry; its 128 overridden by the legacy compress_rate_hca), num_hash_layers,
    qk_rope_head_dim, a flat yarn rope_scaling."""
    path = shutil.copytree(tiny[0], tmp_path / "published")
    renames = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    raw = {renames.get(k, k.removeprefix("model.")): t for k, t in raw_tensors(path).items()}
    write_tensors(path, raw)  # MTP blocks: tests/ignition/test_mtp_export.py
    cfg = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor", "compress_rates"):
        cfg.pop(key)
    cfg.update(compress_ratios=[0, 4, 128, 4, 0], compress_rate_hca=8, num_hash_layers=2, qk_rope_head_dim=8,
               rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                             "beta_fast": 32, "beta_slow": 1}, torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg))
    arch, got = convert_all(path)
    _, want = convert_all(tiny[0])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    c = arch.compressed
    assert c.layer_kinds == ["sliding", "csa", "hca", "csa"] and (c.csa_rate, c.hca_rate) == (4, 8)
    assert c.rope_dim == 8 and arch.moe.hash_layers == [0, 1] and arch.rope_theta == 10000.0
    assert (c.compress_rope_scaling.factor, c.compress_rope_scaling.original_max_position_embeddings) == (4.0, 128)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        (lambda c: {**c, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (lambda c: {**c, "mlp_bias": True}, "mlp_bias=true"),
        (lambda c: {**c, "scoring_func": "softmax"}, "scoring_func 'softmax'"),
        (lambda c: {**c, "swiglu_limit": None}, "swiglu_limit=None"),
        (lambda c: {**c, "o_groups": 3}, "o_groups=3"),
        (lambda c: {**c, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, "layer_types must name"),
        (lambda c: {**c, "mlp_layer_types": ["moe", "dense", "moe", "moe"]}, "mlp_layer_types"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "compress": {
            **c["rope_parameters"]["compress"], "beta_fast": 16}}}, "beta_fast 32"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "compress": {
            **c["rope_parameters"]["compress"], "attention_factor": None}}}, "attention_factor 1"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "main": {
            **c["rope_parameters"]["main"], "partial_rotary_factor": 0.5}}}, "main.partial_rotary_factor"),
        (lambda c: {**c, "hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters=0"),
        (lambda c: {**c, "index_head_dim": 8},
         r"indexer.compressor.wkv.weight' has shape \[32, 64\], the config implies \[16, 64\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny[0], tmp_path, edit, message)


def test_a_fragment_of_an_mtp_block_is_refused(tiny, tmp_path):
    """MTP blocks are exported (tests/ignition/test_mtp_export.py): a block is whole or refused, under model. too."""
    path = shutil.copytree(tiny[0], tmp_path / "mtp")
    write_tensors(path, {**raw_tensors(path), "model.mtp.0.eh_proj.weight": torch.zeros(64, 128)})
    with pytest.raises(ExportError, match="MTP module lacks tensor 'model.mtp.0.enorm.weight'"):
        convert_all(path)


def test_unexpected_tensor_and_bad_hash_table(tiny, tmp_path):
    path = shutil.copytree(tiny[0], tmp_path / "x")
    raw = raw_tensors(path)
    write_tensors(path, {**raw, "model.layers.0.attn.wo_a.bias": torch.zeros(32)})
    with pytest.raises(ExportError, match="no place for: model.layers.0.attn.wo_a.bias"):
        convert(open_hf_dir(path), torch.float32)
    write_tensors(path, {**raw, "model.layers.0.ffn.gate.tid2eid": raw["model.layers.0.ffn.gate.tid2eid"] + 8})
    with pytest.raises(ExportError, match="tid2eid names experts outside 0 .. 7"):
        convert_all(path)


@pytest.mark.parametrize("published", [False, True], ids=["transformers", "published"])
def test_full_size_configs_read_as_transformers_reads_them(published):
    """DeepseekV4Config's defaults (V4-Flash's shapes), or the published spellings of them, read as its __post_init__
    reads them: the layer kinds, the hash layers, the rotated width, the two ropes."""
    from transformers import DeepseekV4Config

    from ignition.archs.deepseek_v4 import _compressed, _config, _moe

    raw = {"model_type": "deepseek_v4"}
    if published:
        raw.update(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], num_hash_layers=3, qk_rope_head_dim=64,
                   compress_rope_theta=160000, rope_scaling={"type": "yarn", "factor": 16,
                                                             "original_max_position_embeddings": 65536})
    hf = DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"})
    cfg = _config(raw, "cfg")
    c, moe = _compressed(cfg, 43, 64, 512, "cfg"), _moe(cfg, 43, "cfg")
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert c.layer_kinds == [kinds[t] for t in hf.layer_types]
    assert moe.hash_layers == [i for i, t in enumerate(hf.mlp_layer_types) if t == "hash_moe"] == [0, 1, 2]
    assert c.rope_dim == hf.qk_rope_head_dim == 64 and (c.csa_rate, c.hca_rate, c.window) == (4, 128, 128)
    compress = hf.rope_parameters["compress"]
    assert c.compress_rope_theta == compress["rope_theta"]
    if published:
        assert (c.compress_rope_scaling.factor, compress["attention_factor"]) == (16, 1.0)
    else:
        assert c.compress_rope_scaling is None and compress["rope_type"] == "default"
