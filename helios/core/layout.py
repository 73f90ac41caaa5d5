"""The runtime tensor layout of a core: names, shapes and orientation, shared by ignition and helios.

All linear weights keep torch's [out_features, in_features] orientation (F.linear reads them as is).
ignition applies every transform (fusing, permutation undo, gemma's 1+w norm shift, casting) so that
helios binds these tensors straight from the mmap. No torch import here.

Names (L = layer index), shapes with H=hidden, D=head_dim, Nq/Nkv heads, F=intermediate, E=experts:
  embed.weight                      [vocab, H]
  layers.L.attn_norm.weight         [H]                input norm
  layers.L.attn.qkv.weight          [(Nq + 2*Nkv)*D, H] rows: q heads, then k heads, then v heads
  layers.L.attn.qkv.bias            [(Nq + 2*Nkv)*D]   only with arch.attention_bias
  layers.L.attn.q_norm.weight       [D]                only with arch.qk_norm
  layers.L.attn.k_norm.weight       [D]                only with arch.qk_norm
  layers.L.attn.o.weight            [H, Nq*D]
  layers.L.attn_post_norm.weight    [H]                only with arch.sandwich_norms (gemma3)
  layers.L.mlp_norm.weight          [H]                norm before the MLP
  layers.L.mlp_post_norm.weight     [H]                only with arch.sandwich_norms
  layers.L.mlp.gate_up.weight       [2*F, H]           rows: gate, then up
  layers.L.mlp.down.weight          [H, F]
  layers.L.moe.router.weight        [E, H]             MoE layers instead of mlp.*
  layers.L.moe.gate_up.weight       [E, 2*Fm, H]
  layers.L.moe.down.weight          [E, H, Fm]
  norm.weight                       [H]
  lm_head.weight                    [vocab, H]         absent with tie_word_embeddings

Norm weights are stored as the multiplier itself: y = x / rms(x) * w (gemma's 1+w already added).
"""

from __future__ import annotations

WEIGHTS_DIR = "weights"
TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "template.jinja"


def layer(i: int, name: str) -> str:
    return f"layers.{i}.{name}"
