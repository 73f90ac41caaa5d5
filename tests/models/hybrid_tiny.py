"""Tiny random-weight HF checkpoints of the hybrid families (qwen3_5, qwen3_5_moe, qwen3_next), saved with HF
transformers beside the tiny tokenizer of tests/ignition/tiny_models: the parity oracle's input."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_checkpoint

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=4, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID, tie_word_embeddings=False,
    # GDN: 2 q/k heads serving 4 value heads; layers 0-2 linear, 3 full (full_attention_interval 4)
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def hybrid_model(family: str, seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (zero-centred norms around 0, the GDN's gated
    norm around 1, A_log and dt_bias small)."""
    import transformers as T

    if family == "qwen3_5":
        config = T.Qwen3_5TextConfig(**{**_COMMON, "intermediate_size": 128, **overrides})
        cls = T.Qwen3_5ForCausalLM
    elif family == "qwen3_5_moe":
        config = T.Qwen3_5MoeTextConfig(**{**_COMMON, **_MOE, **overrides})
        cls = T.Qwen3_5MoeForCausalLM
    elif family == "qwen3_next":
        config = T.Qwen3NextConfig(**{**_COMMON, **_MOE, "intermediate_size": 128, "norm_topk_prob": True,
                                      **overrides})
        cls = T.Qwen3NextForCausalLM
    else:
        raise ValueError(f"unknown hybrid family {family!r} (have {HYBRID_FAMILIES})")
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))  # multiplies by 1 + w
            elif p.ndim == 1:  # A_log, dt_bias
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in] (the conv's [C, 1, K] too): activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def build_hybrid(family: str, out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                 **overrides) -> Path:
    return save_checkpoint(hybrid_model(family, seed, **overrides), out_dir, dtype)
