"""Tiny random-weight qwen4_exp checkpoints (GDN + QSA-indexed gated attention + hyper-connections + MoE, with and
without PLE n-gram embeddings), saved with HF transformers beside the tiny tokenizer of tests/ignition/tiny_models:
the parity oracle's input."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_checkpoint

LIN, IDX = "linear_attention", "indexed_attention"
# What each variant exercises (both: QSA keeping 2 blocks of 4 tokens, so prompts past 8 tokens drop blocks):
#   plain  two indexed layers (lin idx lin idx), 2 streams, sigmoid GDN output gate, partial rotary 0.5, no PLE
#   ple    PLE on layers 0 and 2 (ple_layer_ids [1, 3]) with 4 heads per n-gram, the table in two shards, 3 streams,
#          the default layer types (lin lin lin idx) and full rotary over the 16-dim heads
VARIANTS = {
    "plain": dict(layer_types=[LIN, IDX, LIN, IDX], hc_count=2, output_gate_type="sigmoid",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "ple": dict(hc_count=3, ple_layer_ids=[1, 3], heads_per_ngram=4, ngram_vocab_size_base=1000,
                split_ngram_parts=2),
}

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=4, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID, tie_word_embeddings=False,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
    hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
    indexer_compress_ratio=4,
)


def qwen4_exp_model(variant: str, seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (zero-centred norms around 0, the GDN's gated norm
    around 1, A_log and dt_bias small, the PLE table and the embedding wider)."""
    import transformers as T

    config = T.Qwen4ExpTextConfig(**{**_COMMON, **VARIANTS[variant], **overrides})
    torch.manual_seed(seed)
    model = T.Qwen4ExpForCausalLM(config).eval()
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
            else:  # [.., out, in] (the convs' [C, 1, K] too): activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def build_qwen4_exp(variant: str, out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides) -> Path:
    return save_checkpoint(qwen4_exp_model(variant, seed, **overrides), out_dir, dtype)
