"""ignition.archs.gemma4: Gemma4ForConditionalGeneration (text only) and Gemma4ForCausalLM checkpoints -> gemma4 cores.

Every runtime tensor is checked against the HF model that wrote the checkpoint (its modules, not its file names), the
folded router and expert scales included; the text-only class converts as the wrapper does; released configs (the
global_head_dim / num_global_key_value_heads spelling, no per_layer_config) read as transformers reads them; the
parameter counts are the core's; the configs transformers accepts that we reject, and unexpected tensors.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from ignition.archs import convert, decode_weight_bytes, num_params
from ignition.errors import ExportError
from ignition.sources.hf import open_hf_dir
from tests.ignition.checkpoint_tools import (
    assert_config_refused,
    assert_tensor_refused,
    convert_all,
    edit_config,
    raw_tensors,
    write_tensors,
)
from tests.ignition.tiny_models import VOCAB_SIZE, write_tokenizer
from tests.models.gemma4_tiny import TEXT, build_gemma4, gemma4_model

PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint path, HF model) of the MoE variant, which has every tensor kind."""
    root = tmp_path_factory.mktemp("gemma4")
    return build_gemma4(root / "moe", "moe"), gemma4_model("moe")


def _expected(model) -> dict[str, torch.Tensor]:
    """The runtime layout computed from the HF modules."""
    tm = model.model.language_model
    h = tm.config.hidden_size
    out = {"embed.weight": tm.embed_tokens.weight, "norm.weight": tm.norm.weight,
           "ple.embed.weight": tm.embed_tokens_per_layer.weight, "ple.norm.weight": tm.per_layer_projection_norm.weight,
           "ple.proj.weight": tm.per_layer_model_projection.weight}
    norms = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
             "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm",
             "mlp_post_norm_1": "post_feedforward_layernorm_1", "moe_norm": "pre_feedforward_layernorm_2",
             "moe_post_norm": "post_feedforward_layernorm_2", "ple_post_norm": "post_per_layer_input_norm"}
    for i, block in enumerate(tm.layers):
        L, a = f"layers.{i}.", block.self_attn
        for ours, theirs in norms.items():
            out[L + ours + ".weight"] = getattr(block, theirs).weight
        rows = [a.q_proj.weight]
        if not a.is_kv_shared_layer:
            rows += [a.k_proj.weight] + ([a.v_proj.weight] if a.v_proj is not None else [])
            out[L + "attn.k_norm.weight"] = a.k_norm.weight
        out[L + "attn.qkv.weight"] = torch.cat(rows)
        out[L + "attn.q_norm.weight"] = a.q_norm.weight
        out[L + "attn.o.weight"] = a.o_proj.weight
        out[L + "mlp.gate_up.weight"] = torch.cat([block.mlp.gate_proj.weight, block.mlp.up_proj.weight])
        out[L + "mlp.down.weight"] = block.mlp.down_proj.weight
        r = block.router
        out[L + "moe.router.weight"] = r.proj.weight * (r.scale * h**-0.5)[None, :]
        out[L + "moe.gate_up.weight"] = block.experts.gate_up_proj
        out[L + "moe.down.weight"] = block.experts.down_proj * r.per_expert_scale[:, None, None]
        out[L + "ple_gate.weight"] = block.per_layer_input_gate.weight
        out[L + "ple_proj.weight"] = block.per_layer_projection.weight
        out[L + "layer_scalar"] = block.layer_scalar
    return out


def test_runtime_tensors_equal_hf_modules(tiny):
    path, model = tiny
    _, got = convert_all(path)
    want = {k: v.detach().float() for k, v in _expected(model).items()}
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=1e-7, rtol=1e-6, msg=name)


def test_the_text_only_class_converts_as_the_wrapper(tiny, tmp_path):
    """Gemma4ForCausalLM (model_type gemma4_text, tensors under model.) = the wrapper's text part."""
    import transformers as T

    path, model = tiny
    text = T.Gemma4ForCausalLM(model.config.text_config).eval()
    text.model.load_state_dict(model.model.language_model.state_dict())
    text.save_pretrained(tmp_path / "text")
    write_tokenizer(tmp_path / "text")
    arch_w, got_w = convert_all(path)
    arch_t, got_t = convert_all(tmp_path / "text")
    assert arch_t == arch_w and sorted(got_t) == sorted(got_w)
    assert all(torch.equal(got_t[k], got_w[k]) for k in got_w)


def test_param_counts_are_the_cores(tiny):
    path, _ = tiny
    arch, got = convert_all(path)
    assert num_params(arch) == sum(t.numel() for t in got.values())
    h, n, p, fm = 64, 6, 8, 32
    # decode reads one PLE row per layer, the top-2 experts of each layer, every other weight once
    unread = 6 * (8 - 2) * 3 * h * fm + (VOCAB_SIZE - 1) * n * p
    assert decode_weight_bytes(arch, torch.bfloat16) == 2 * (num_params(arch) - unread + h)  # + the embedding row


def test_released_config_spellings(tiny, tmp_path):
    """Released configs spell the full layers' shape global_head_dim / num_global_key_value_heads (the latter only
    with attention_k_eq_v) instead of per_layer_config, and omit defaulted rope_parameters."""
    path = shutil.copytree(tiny[0], tmp_path / "x")
    arch, _ = convert_all(path)

    def released(c: dict) -> dict:
        c = {k: v for k, v in c.items() if k not in ("per_layer_config", "rope_parameters")}
        return {**c, "global_head_dim": 32, "num_global_key_value_heads": 1}

    edit_config(path, released)
    assert convert_all(path)[0] == arch
    edit_config(path, lambda c: {**c, "attention_k_eq_v": False})  # the global kv heads then do not apply
    with pytest.raises(ExportError, match=r"k_proj.weight' has shape \[32, 64\], the config implies \[64, 64\]"):
        convert(open_hf_dir(path), torch.float32)


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: {**c, "attention_bias": True}, "attention_bias=true"),
        (lambda c: {**c, "use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        (lambda c: {**c, "hidden_activation": "silu"}, "hidden_activation 'silu'"),
        (lambda c: {**c, "per_layer_config": {"2": {"head_dim": 32, "intermediate_size": 64}}},
         r"overrides \['intermediate_size'\]"),
        (lambda c: {**c, "per_layer_config": {"0": {"head_dim": 32}}}, "one per layer type"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "full_attention": {"rope_type": "yarn",
                                                                                          "factor": 2.0}}},
         "rope_type 'yarn' on full layers"),
        (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "sliding_attention": {
            "rope_type": "proportional", "partial_rotary_factor": 0.5}}}, "'proportional' on sliding layers"),
        (lambda c: {**c, "num_experts": None}, "enable_moe_block needs num_experts"),
        (lambda c: {**c, "num_kv_shared_layers": 6}, "num_kv_shared_layers=6 leaves no layer"),
        (lambda c: {**c, "num_kv_shared_layers": 4}, r"KV-shared \['full_attention'\] layers have no earlier"),
        (lambda c: {**c, "hidden_size_per_layer_input": 4}, r"embed_tokens_per_layer.weight' has shape \[300, 48\]"),
    ],
)
def test_unsupported_config(tiny, tmp_path, edit, message):
    assert_config_refused(tiny[0], tmp_path, edit, message)


@pytest.mark.parametrize(
    ("name", "shape"),
    [(f"{PREFIX}layers.0.self_attn.o_proj.bias", (64,)), (f"{PREFIX}layers.2.self_attn.v_proj.weight", (32, 64))],
)
def test_unexpected_tensor(tiny, tmp_path, name, shape):
    assert_tensor_refused(tiny[0], tmp_path, name, shape)


def test_a_shared_layers_stored_kv_projections_are_ignored(tiny, tmp_path):
    """HF drops a KV-shared layer's k/v projections and norms on load (_keys_to_ignore_on_load_unexpected); so do we."""
    path = shutil.copytree(tiny[0], tmp_path / "x")
    arch, want = convert_all(path)
    extra = {f"{PREFIX}layers.4.self_attn.k_proj.weight": torch.zeros(32, 64),
             f"{PREFIX}layers.4.self_attn.v_proj.weight": torch.zeros(32, 64),
             f"{PREFIX}layers.4.self_attn.k_norm.weight": torch.zeros(16)}
    write_tensors(path, {**raw_tensors(path), **extra})
    assert convert_all(path)[1].keys() == want.keys()
    assert TEXT["num_kv_shared_layers"] == 2 and arch.kv_sources[4] == 3
