"""Tiny random-weight step3p7 checkpoints (Step3p7ForConditionalGeneration with a 1-layer vision tower, used text only),
saved with HF transformers beside the tiny tokenizer of tests/ignition/tiny_models: the parity oracle's input.

The text config is written in the release's own spellings (num_attention_groups, attention_other_setting,
moe_num_experts / moe_top_k, moe_layers_enum, per-layer rope_theta / partial_rotary_factors, lists padded with the
MTP layer's entry); transformers parses them and saves its own (per_layer_config, rope_parameters per layer type).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, redraw_score_biases, save_checkpoint

FULL, SLIDE = "full_attention", "sliding_attention"
WINDOW = 8  # prompts run far past it, and past a 4- or 16-token page
# The "base" variant, in the release's spellings: layers full, sliding, sliding, full, sliding (+ one MTP entry in
# every per-layer list, as the release pads them); layers 0-1 dense, 2-4 MoE (8 experts top-2, scaled by 2.5, a
# shared expert); sliding layers 6 query heads, full ones 4, both over 2 KV heads of 16; the full layers rotate half
# of each head (base 10^4), the sliding ones all of it (base 500); query_pre_attn_scalar 24 (not head_dim); SwiGLU
# clamps of 0.3 / 0.4 on some layers (active: the activations are O(1)), 0 / None elsewhere (none); llama3 rope
# scaling on the full layers (the release's rope_scaling with yarn_only_types), past position 32; the release's flags
# at the values it ships (use_head_wise_attn_gate, use_moe_router_bias, norm_expert_weight, att_impl_type, ...).
TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, share_expert_dim=48,
    num_hidden_layers=5, num_attention_heads=4, num_attention_groups=2, head_dim=16,
    attention_other_setting={"attention_type": SLIDE, "num_attention_heads": 6, "num_attention_groups": 2,
                             "head_dim": 16},
    layer_types=[FULL, SLIDE, SLIDE, FULL, SLIDE, FULL], sliding_window=WINDOW,
    rope_theta=[10000.0, 500.0, 500.0, 10000.0, 500.0, 10000.0],
    partial_rotary_factors=[0.5, 1.0, 1.0, 0.5, 1.0, 0.5],
    moe_num_experts=8, moe_top_k=2, moe_router_scaling_factor=2.5, moe_layers_enum="2,3,4,5",
    swiglu_limits=[0, 0, 0.4, None, 0.3, 0], swiglu_limits_shared=[0.3, 0, 0, 0.4, 0, 0],
    num_nextn_predict_layers=1, query_pre_attn_scalar=24, max_position_embeddings=512, rms_norm_eps=1e-5,
    rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 32,
                  "low_freq_factor": 1.0, "high_freq_factor": 32.0},
    yarn_only_types=[FULL], use_head_wise_attn_gate=True, use_moe_router_bias=True, need_fp32_gate=True,
    norm_expert_weight=True, moe_router_activation="sigmoid", att_impl_type="GQA", use_moe=True,
    bos_token_id=BOS_ID, eos_token_id=[EOS_ID], pad_token_id=PAD_ID,
)
# The "native" variant: transformers' own spellings (num_key_value_heads, n_routed_experts, mlp_layer_types,
# num_sliding_attention_heads, rope_parameters per layer type), llama3 rope scaling on the full layer (a quarter of
# each head rotating), sliding layers first and last with 8 query heads, no MTP entries, every layer but the first
# MoE (6 experts top-3, unscaled), no clamps, tied embeddings (the wrapper's own field ties them).
NATIVE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, share_expert_dim=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_sliding_attention_heads=8,
    layer_types=[SLIDE, FULL, SLIDE, SLIDE], sliding_window=WINDOW, mlp_layer_types=["dense"] + ["sparse"] * 3,
    n_routed_experts=6, num_experts_per_tok=3,
    rope_parameters={"full_attention": {"rope_type": "llama3", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                        "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
    max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)
VARIANTS = {"base": (TEXT, False), "native": (NATIVE, True)}  # text config, tie_word_embeddings
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
              mlp_ratio=2.0, max_position_embeddings=4)


def config(variant: str = "base", **overrides):
    import transformers as T

    text, tie = VARIANTS[variant]
    return T.Step3p7Config(text_config={**text, **overrides}, vision_config=VISION, tie_word_embeddings=tie)


def step3p7_model(variant: str = "base", seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (the zero-centred norms small around 0, projections
    scaled to keep activations O(1), the router's score bias small)."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.Step3p7ForConditionalGeneration(config(variant, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and name.startswith("model.language_model."):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))  # HF multiplies by 1 + w
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in]: activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        redraw_score_biases(model, gen)
    return model


def build_step3p7(out_dir: Path, variant: str = "base", seed: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides) -> Path:
    return save_checkpoint(step3p7_model(variant, seed, **overrides), out_dir, dtype)
