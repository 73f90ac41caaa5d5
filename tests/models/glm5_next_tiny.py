"""Tiny random-weight glm5_next checkpoints (Glm5NextForConditionalGeneration with a 1-block vision tower, used text
only: safe-gate KDA + NoPE MLA with the DSA indexer + mHC streams + clamped SwiGLU / sigmoid-routed MoE), saved with
HF transformers beside the tiny tokenizer of tests/ignition/tiny_models: the parity oracle's input."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, redraw_score_biases, save_checkpoint

LIN, IDX = "linear_attention", "indexed_attention"
# What each variant exercises (docs/families.md's tiny config, as its base; prompts past 16 tokens drop pools):
#   base    layers kda, kda, kda, mla+dsa (the default types); 4 pools of 4 tokens kept; 2 streams; the first three
#           MLPs dense (the default), 8 experts top-2; swiglu_limit 10 (the default: inactive at these activations)
#   shared  layers kda, mla+dsa, mla+dsa (shared: the layer before's selection), kda; 3 pools of 8 tokens; 4 streams,
#           5 Sinkhorn iterations; one dense MLP, 8 experts top-3 within 2 of 4 groups, two shared experts, no
#           renormalisation; swiglu_limit 0.5 (clamps many gate and up values)
# NOTE: 8 index heads, not the docs' 2: a pool scores exactly 0 when relu zeroes every head, and HF's torch.topk
# breaks such ties by its own rule where helios takes the earlier pool (helios.layers.dsa); with 8 heads a tie at
# the cut is rare enough that the parity inputs have none.
VARIANTS = {
    "base": dict(),
    "shared": dict(layer_types=[LIN, IDX, IDX, LIN], indexer_types=["full", "full", "shared", "full"],
                   index_kpool=8, index_topk=24, hc_mult=4, hc_sinkhorn_iters=5,
                   mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_group=4, topk_group=2,
                   num_experts_per_tok=3, n_shared_experts=2, norm_topk_prob=False, swiglu_limit=0.5),
}

TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=128,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, index_topk=16, index_head_dim=16,
    index_n_heads=8, index_kpool=4, linear_head_dim=16, linear_num_heads=4, hc_mult=2, max_position_embeddings=512,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              projection_intermediate_size=64)


def config(variant: str = "base", **overrides):
    import transformers as T

    return T.Glm5NextConfig(text_config={**TEXT, **VARIANTS[variant], **overrides}, vision_config=VISION,
                            tie_word_embeddings=False)


def glm5_next_model(variant: str = "base", seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (norms around 1, biases, A_log and dt_bias small, the
    router's score bias small), as tests/models/kimi_linear_tiny draws them."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.Glm5NextForConditionalGeneration(config(variant, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("A_log", "dt_bias", "bias", "hc.base")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "norm" in name or name.endswith("hc.scale"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in] (the conv's [C, 1, K], the pool offsets [P, Di] too): activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        redraw_score_biases(model, gen)
    return model


def build_glm5_next(out_dir: Path, variant: str = "base", seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides) -> Path:
    return save_checkpoint(glm5_next_model(variant, seed, **overrides), out_dir, dtype)
