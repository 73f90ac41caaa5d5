"""Tiny random-weight deepseek_v4 checkpoints (DeepseekV4ForCausalLM: sliding, CSA and HCA layers, hash-routed and
score-routed experts, mHC streams), saved with HF transformers beside the tiny tokenizer of tests/ignition/
tiny_models: the parity oracle's input."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_checkpoint

SLIDE, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Every layer kind, a window of 8, CSA entries every 4 tokens of which each query keeps 3 (prompts past 16 tokens drop
# some), HCA entries every 8 tokens, the compress rope under yarn; two hash-routed layers; 2 streams.
# NOTE: 8 index heads: an entry scores exactly 0 when relu zeroes every head, and HF's torch.topk breaks such ties
# by its own rule where helios takes the earlier entry; with 8 heads a tie at the cut is rare enough that the parity
# inputs have none (tests/models/glm5_next_tiny says the same of DSA).
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2,
    n_routed_experts=8, layer_types=[SLIDE, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=8,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2, hc_sinkhorn_iters=20,
    swiglu_limit=10.0, max_position_embeddings=512, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
)


def config(**overrides):
    import transformers as T

    return T.DeepseekV4Config(**{**CONFIG, **overrides})


def deepseek_v4_model(seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (norms around 1, biases, sinks and position biases
    O(0.3..1), the router's score bias small, tid2eid distinct experts per token)."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.DeepseekV4ForCausalLM(config(**overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("base", "hc_base", "sinks")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in]: activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):
                e = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(e, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model


def build_deepseek_v4(out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    return save_checkpoint(deepseek_v4_model(seed, **overrides), out_dir, dtype)
