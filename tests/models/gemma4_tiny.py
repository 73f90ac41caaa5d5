"""Tiny random-weight gemma4 checkpoints (Gemma4ForConditionalGeneration without vision or audio towers, used text
only), saved with HF transformers beside the tiny tokenizer of tests/ignition/tiny_models: the parity oracle's input.

What each variant exercises:
  base  6 layers sliding, sliding, full, sliding, sliding, full (window 8); full layers with their own head dim (32
        against 16) and kv heads (1 against 2), k = v (attention_k_eq_v), proportional rope turning 4 of 16 pairs;
        the last 2 layers KV-shared (layer 4 reads layer 3's sliding KV, layer 5 reads layer 2's full KV) with
        double-wide MLPs; per-layer embeddings (8 per layer); random layer scalars; final soft-cap 30
  moe   base with the MoE block beside every MLP (8 experts, top 2, random router scale and per-expert scales)
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_checkpoint

S, F = "sliding_attention", "full_attention"
WINDOW = 8
TEXT = dict(
    vocab_size=VOCAB_SIZE, vocab_size_per_layer_input=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=[S, S, F, S, S, F], sliding_window=WINDOW,
    num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8, final_logit_softcapping=30.0,
    max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)
VARIANTS = {
    "base": dict(),
    "moe": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32),
}


def config(variant: str = "base", **overrides):
    import transformers as T

    return T.Gemma4Config(text_config={**TEXT, **VARIANTS[variant], **overrides}, vision_config=None,
                          audio_config=None)


def gemma4_model(variant: str = "base", seed: int = 0, **overrides):
    """The HF model with every parameter and layer scalar re-drawn from `seed` (norms around 1, activations O(1))."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.Gemma4ForConditionalGeneration(config(variant, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # NOTE: attention scale 1 over unit-RMS q and k: weights near 0.5 keep the scores' spread near 1
                # (near 1 they reach sqrt(head_dim) and the peaked softmax amplifies float32 rounding ~10x a layer)
                p.copy_(0.5 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("layer_scalar"):
                b.copy_(0.8 + 0.4 * torch.rand(b.shape, generator=gen))
    return model


def build_gemma4(out_dir: Path, variant: str = "base", seed: int = 0, dtype: torch.dtype = torch.float32,
                 **overrides) -> Path:
    return save_checkpoint(gemma4_model(variant, seed, **overrides), out_dir, dtype)


# Released configs' keys at tiny sizes (their text_config spells the full layers' shape global_head_dim /
# num_global_key_value_heads, not per_layer_config):
#   e2b  google/gemma-4-E2B-it: per-layer embeddings, the last layers KV-shared with double-wide MLPs, no k = v
#   31b  google/gemma-4-31B-it: k = v with fewer global kv heads, no PLE, no sharing, vision-bidirectional attention
RELEASED = {
    "e2b": dict(num_hidden_layers=7, layer_types=[S, S, S, F, S, S, F], num_key_value_heads=1, global_head_dim=32,
                num_global_key_value_heads=None, attention_k_eq_v=False, hidden_size_per_layer_input=8,
                num_kv_shared_layers=3, use_double_wide_mlp=True),
    "31b": dict(num_hidden_layers=6, layer_types=[S, S, S, S, S, F], num_key_value_heads=2, global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                num_kv_shared_layers=0, use_double_wide_mlp=False, use_bidirectional_attention="vision"),
}


def build_released(out_dir: Path, name: str, seed: int = 0) -> Path:
    """A tiny checkpoint whose config.json has the released model's keys (no per_layer_config; rope_parameters as
    published), weights drawn as gemma4_model draws them."""
    import json

    overrides = {k: v for k, v in RELEASED[name].items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    text = {**TEXT, **overrides}
    per_layer = {"head_dim": RELEASED[name]["global_head_dim"]}
    if text["attention_k_eq_v"] and RELEASED[name]["num_global_key_value_heads"]:
        per_layer["num_key_value_heads"] = RELEASED[name]["num_global_key_value_heads"]
    full = {str(i): per_layer for i, t in enumerate(text["layer_types"]) if t == F}
    out_dir = build_gemma4(out_dir, "base", seed, per_layer_config=full, **overrides)
    cfg = json.loads((out_dir / "config.json").read_text())
    released = {k: v for k, v in cfg["text_config"].items() if k != "per_layer_config"}
    released |= {k: RELEASED[name][k] for k in ("global_head_dim", "num_global_key_value_heads")}
    (out_dir / "config.json").write_text(json.dumps({**cfg, "text_config": released}, indent=2))
    return out_dir
