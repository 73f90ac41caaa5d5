"""Tiny random-weight muse_spark checkpoints (MuseSparkForConditionalGeneration with a 1-layer vision tower and a
1-stage audio tower, used text only), saved with HF transformers beside the tiny tokenizer of
tests/ignition/tiny_models: the parity oracle's input.

What the text decoder exercises: five layers of the default pattern (full, sliding x3, full: every 4th counted back
from the last) with an 8-token window, so prompts past 8 tokens lose keys in the sliding layers; NoPE on layer 0
(full) and layer 2 (sliding), rotary on the rest (layer_rope_theta is per layer, independent of the type); GQA 4/2
with the weightless q/k/o norms and the elementwise sigmoid gate; dense SwiGLU on layers 0 and 3, latent MoE (8
experts top-2, a 32-wide latent, score bias, routed_scaling_factor 1.5) elsewhere; output_multiplier 0.5 (router
and logits) and a soft-cap of 2, which both move the logits; qk_scale_factor 1.5.

NOTE: every sublayer's output is renormalised to unit RMS before its residual gate, so with random weights the stream
can forget itself: gates drawn around 0 (beta ~ 0.5) make a 1e-6 relative nudge of the embeddings move the logits by
~5e-5 (bf16 then agrees with float32 on under half the argmaxes); the released qk_scale_factor 5.47 (a logit std of
~5 at head_dim 16) and a large output_multiplier (2) raise it further. The gates are drawn around -0.5 (beta ~ 0.16,
alpha ~ 1, per channel), which keeps that gain near 5 and every sublayer's contribution visible.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, redraw_score_biases, save_checkpoint

THETA = 10_000.0
WINDOW = 8
TEXT = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=WINDOW,
    rope_parameters={"rope_type": "default", "rope_theta": THETA}, layer_rope_theta=[0, THETA, 0, THETA, THETA],
    mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"], moe_intermediate_size=32, num_local_experts=8,
    num_experts_per_tok=2, moe_hidden_size=32, routed_scaling_factor=1.5, output_multiplier=0.5,
    final_logit_softcapping=2.0, qk_scale_factor=1.5, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    tie_word_embeddings=False,
)
VISION = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, pos_emb_height=4,
              pos_emb_width=4)
AUDIO = dict(patch_sizes=[2], hidden_sizes=[16], depths=[1], num_hidden_layers=1, out_hidden_size=64)


def config(**overrides):
    import transformers as T

    return T.MuseSparkConfig(text_config={**TEXT, **overrides}, vision_config=VISION, audio_config=AUDIO,
                             out_hidden_size=128, projector_hidden_size=64)


def muse_spark_model(seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed`: the centred norms' w small (multipliers 1 + w), the
    residual gates around -0.5 (see the NOTE above), the router's score bias small, projections with activations O(1)."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.MuseSparkForConditionalGeneration(config(**overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("residual_gate.gate"):
                p.copy_(-0.5 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # norm weights (1 + w or the multiplier), biases
                p.copy_((1.0 if name.endswith("language_model.norm.weight") else 0.0)
                        + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in]: activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        redraw_score_biases(model, gen)
    return model


def build_muse_spark(out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    return save_checkpoint(muse_spark_model(seed, **overrides), out_dir, dtype)
