"""Tiny random-weight kimi_linear checkpoints (KDA + NoPE MLA + sigmoid-routed MoE with shared experts), saved with HF
transformers beside the tiny tokenizer of tests/ignition/tiny_models: the parity oracle's input."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, redraw_score_biases, save_checkpoint

# What each variant exercises (docs/families.md's tiny config, as its base):
#   base     layers kda, kda, kda, mla from linear_attn_config's 1-indexed lists; MLA without a q latent; layer 0 a
#            dense MLP; 8 experts top-2, one group, one shared expert
#   grouped  layers kda, mla, kda, mla from layer_types; MLA with a q latent (q_lora_rank 24); 8 experts top-3 within
#            2 of 4 groups, two shared experts, no renormalisation, the first two layers dense
VARIANTS = {
    "base": dict(linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                     "kda_layers": [1, 2, 3], "full_attn_layers": [4]}),
    "grouped": dict(linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    q_lora_rank=24, num_expert_group=4, topk_group=2, num_experts_per_token=3,
                    num_shared_experts=2, moe_renormalize=False, first_k_dense_replace=2),
}

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
    kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=128,
    moe_intermediate_size=32, num_experts=8, num_experts_per_token=2, routed_scaling_factor=2.446,
    model_max_length=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
)


def config(variant: str = "base", **overrides):
    import transformers as T

    return T.KimiLinearConfig(**{**_COMMON, **VARIANTS[variant], **overrides})


def kimi_linear_model(variant: str = "base", seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (norms around 1, A_log and dt_bias small, the router's
    score bias small), as tests/models/hybrid_tiny draws them."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.KimiLinearForCausalLM(config(variant, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in] (the conv's [C, 1, K] too): activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        redraw_score_biases(model, gen)
    return model


def build_kimi_linear(out_dir: Path, variant: str = "base", seed: int = 0, dtype: torch.dtype = torch.float32,
                      **overrides) -> Path:
    return save_checkpoint(kimi_linear_model(variant, seed, **overrides), out_dir, dtype)
