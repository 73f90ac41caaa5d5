"""Tiny random-weight minimax_m3 checkpoints (GQA + q/k norms + partial rotary, lightning-indexer sparse layers,
SwiGLU-OAI dense MLPs / sigmoid-routed experts with a shared expert), saved with HF transformers beside the tiny
tokenizer of tests/ignition/tiny_models: the parity oracle's input."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, redraw_score_biases, save_checkpoint

FULL, SPARSE = "full_attention", "minimax_m3_sparse"
# What each variant exercises (blocks of 4 or 8 tokens, so 150-token prompts drop most of them):
#   wrapper  MiniMaxM3SparseForConditionalGeneration with a 1-layer vision tower, used text only (the released tensor
#            naming transformers saves: language_model.model.*, block_sparse_moe.*, index_*); layers sparse, full,
#            sparse; a dense MLP first; 2 index heads (one per KV head); 4 of 4-token blocks kept, 1 local;
#            half the head rotary; swiglu_limit 1.5 (clamps some gate and up values)
#   text     MiniMaxM3VLForCausalLM (the in-memory naming: model.*, mlp.experts.gate_up_proj, indexer.*); every layer
#            sparse with experts; 1 index head selecting for all 4 query heads; 3 of 8-token blocks kept, 2 local;
#            the whole head rotary; tied embeddings
VARIANTS = {
    "wrapper": dict(layer_types=[SPARSE, FULL, SPARSE], mlp_layer_types=["dense", "sparse", "sparse"],
                    index_n_heads=2, index_block_size=4, index_topk_blocks=4, index_local_blocks=1, swiglu_limit=1.5,
                    rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5}),
    "text": dict(layer_types=[SPARSE] * 3, mlp_layer_types=["sparse"] * 3, index_n_heads=1, index_block_size=8,
                 index_topk_blocks=3, index_local_blocks=2, rotary_dim=16, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}),
}

TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=3, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=48,
    num_local_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0, index_head_dim=16,
    max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
              patch_size=14)


def config(variant: str = "wrapper", **overrides):
    import transformers as T

    text = {**TEXT, **VARIANTS[variant], **overrides}
    if variant == "text":
        return T.MiniMaxM3VLTextConfig(**text)
    return T.MiniMaxM3VLConfig(text_config=text, vision_config=VISION, projector_hidden_size=64,
                               tie_word_embeddings=False)


def minimax_m3_model(variant: str = "wrapper", seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (zero-centred norms small, the router's score bias
    small, projections scaled to keep activations O(1))."""
    import transformers as T

    torch.manual_seed(seed)
    cls = T.MiniMaxM3VLForCausalLM if variant == "text" else T.MiniMaxM3SparseForConditionalGeneration
    model = cls(config(variant, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name or name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        redraw_score_biases(model, gen)
    return model


def build_minimax_m3(out_dir: Path, variant: str = "wrapper", seed: int = 0, dtype: torch.dtype = torch.float32,
                     **overrides) -> Path:
    return save_checkpoint(minimax_m3_model(variant, seed, **overrides), out_dir, dtype)
