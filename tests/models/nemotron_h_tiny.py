"""Tiny random-weight nemotron_h checkpoints (Mamba-2 + positionless attention + relu2 MLP + sigmoid-routed MoE),
saved with HF transformers beside the tiny tokenizer of tests/ignition/tiny_models: the parity oracle's input."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, redraw_score_biases, save_checkpoint

# What each variant exercises:
#   grouped  two Mamba-2 layers (8 heads of 16 in 2 groups, state 16, conv bias, SSD chunk 8), GQA attention, a
#            dense relu2 MLP, MoE with 8 experts top-2 chosen within 1 of 2 groups, score bias, scaling 2.5
#   latent   one Mamba-2 layer with 4 groups and chunk 16, MoE in a 32-wide latent (LatentMoE), no grouping,
#            no renormalisation
VARIANTS = {
    "grouped": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        n_routed_experts=8, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    ),
    "latent": dict(
        layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
        n_groups=4, chunk_size=16, moe_latent_size=32, norm_topk_prob=False, n_routed_experts=4,
    ),
}

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID, tie_word_embeddings=False,
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=8,
    num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
)


def config(variant: str = "grouped", **overrides):
    import transformers as T

    return T.NemotronHConfig(**{**_COMMON, **VARIANTS[variant], **overrides})


def nemotron_h_model(variant: str = "grouped", seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (norms around 1, A_log / dt_bias / D / the conv
    bias small, the router's score bias small) as tests/models/hybrid_tiny draws them."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.NemotronHForCausalLM(config(variant, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # A_log, dt_bias, D, conv1d.bias
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in] (the conv's [C, 1, K] too): activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        redraw_score_biases(model, gen)
    return model


def build_nemotron_h(out_dir: Path, variant: str = "grouped", seed: int = 0, dtype: torch.dtype = torch.float32,
                     **overrides) -> Path:
    return save_checkpoint(nemotron_h_model(variant, seed, **overrides), out_dir, dtype)
