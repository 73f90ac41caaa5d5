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
  layers.L.moe.shared.gate_up.weight [2*Fs, H]         a shared expert beside the routed ones (qwen3_5_moe)
  layers.L.moe.shared.down.weight   [H, Fs]
  layers.L.moe.shared_gate.weight   [1, H]             its sigmoid gate
  norm.weight                       [H]
  lm_head.weight                    [vocab, H]         absent with tie_word_embeddings

Hybrid models (arch.recurrent; R = arch.recurrent, K = conv_kernel, C = R.conv_dim, Hv = R.num_heads):
  layers.L.attn.qkv.weight          [(2*Nq + 2*Nkv)*D, H] with arch.attn_output_gate: rows q, k, v, then the gate
  layers.L.linear.in_proj.weight    [C + Hv*dv + 2*Hv, H]  gated_delta rows: q, k, v (the conv's channels, in
                                                        that order, head-major), z (the output gate), b, a
  layers.L.linear.conv.weight       [C, K]             depthwise causal conv, taps oldest first
  layers.L.linear.dt_bias           [Hv]
  layers.L.linear.A_log             [Hv]
  layers.L.linear.norm.weight       [dv]               the gated RMSNorm over each head's output (not shifted)
  layers.L.linear.out.weight        [H, Hv*dv]

Mamba-2 layers (R.kind "mamba2", nemotron_h; Hm = R.num_heads, P = R.value_head_dim, G = R.num_key_heads,
N = R.key_head_dim, I = Hm*P, C = R.conv_dim = I + 2*G*N):
  layers.L.mamba.in_proj.weight     [I + C + Hm, H]    rows: z (the gate, I), then the conv's channels x (I, head-
                                                        major), B (G*N), C (G*N), then dt (Hm)
  layers.L.mamba.conv.weight        [C, K]             depthwise causal conv over x, B, C; taps oldest first
  layers.L.mamba.conv.bias          [C]                only with R.conv_bias
  layers.L.mamba.dt_bias            [Hm]
  layers.L.mamba.A_log              [Hm]               A = -exp(A_log)
  layers.L.mamba.D                  [Hm]               the skip: y += D * x per head
  layers.L.mamba.norm.weight        [I]                the gated RMSNorm of y * silu(z), groups of R.norm_group_size
  layers.L.mamba.out.weight         [H, I]

Blocks of one sublayer (arch.ffn_after_mixer false, nemotron_h): a mixer layer has attn_norm and its mixer
(mamba.* or attn.*, the attention without rotary under arch.position_embedding "none"), an "ffn" layer has
mlp_norm and mlp.* or moe.*. Non-gated MLPs (arch.hidden_act "relu2"; Fm, Fs and L = latent_size of arch.moe):
  layers.L.mlp.up.weight            [F, H]             the dense MLP: down(act(up x))
  layers.L.mlp.down.weight          [H, F]
  layers.L.moe.router.weight        [E, H]
  layers.L.moe.router.bias          [E]                with moe.score_bias: added to the sigmoid scores for the
                                                        choice only (HF's e_score_correction_bias)
  layers.L.moe.latent_in.weight     [L, H]             with moe.latent_size: the experts' input projection
  layers.L.moe.latent_out.weight    [H, L]             and their output's, back to H
  layers.L.moe.up.weight            [E, Fm, L or H]    non-gated experts (gated ones keep moe.gate_up)
  layers.L.moe.down.weight          [E, L or H, Fm]
  layers.L.moe.shared.up.weight     [Fs, H]            a non-gated shared expert (moe.shared_expert_gate false:
  layers.L.moe.shared.down.weight   [H, Fs]            no shared_gate, added as is)

Multi-head latent attention (arch.mla, M: Nq = arch.num_heads, dn/dr/dv = qk_nope/qk_rope/v_head_dim,
R = kv_lora_rank, Rq = q_lora_rank, Q = Rq with a q latent, else Nq*(dn + dr)):
  layers.L.mla.in_proj.weight       [Q + R + dr, H]    rows: q (per head [dn nope, dr rope]) or the q latent (Rq),
                                                        then the kv latent (R), then the shared rope key (dr)
  layers.L.mla.q_a_norm.weight      [Rq]               only with q_lora_rank: the q latent's RMSNorm
  layers.L.mla.q_b.weight           [Nq*(dn + dr), Rq] only with q_lora_rank: the q latent up (per head nope, rope)
  layers.L.mla.kv_a_norm.weight     [R]                the kv latent's RMSNorm (what the KV pages keep, with the
                                                        rope key)
  layers.L.mla.kv_b.weight          [Nq*(dn + dv), R]  the latent up: per head dn k_nope rows, then dv v rows
  layers.L.mla.o.weight             [H, Nq*dv]

Kimi delta attention layers (R.kind "kimi_delta", kimi_linear; Hk = R.num_heads, d = R.key_head_dim =
R.value_head_dim, C = R.conv_dim = 3*Hk*d):
  layers.L.kda.in_proj.weight       [C + 2*d + Hk, H]  rows: q, k, v (the conv's channels, head-major), f_a (the
                                                        forget gate's low rank, d), g_a (the output gate's, d), b
  layers.L.kda.conv.weight          [C, K]             the q, k and v short convs side by side; taps oldest first
  layers.L.kda.f_b.weight           [Hk*d, d]          the forget gate up: g = -exp(A_log) softplus(f_b f_a x + dt_bias)
  layers.L.kda.dt_bias              [Hk*d]
  layers.L.kda.A_log                [Hk]
  layers.L.kda.g_b.weight           [Hk*d, d]          the output gate up: o = norm(o) * sigmoid(g_b g_a x)
  layers.L.kda.norm.weight          [d]                the gated RMSNorm over each head's output (float32 multiply)
  layers.L.kda.out.weight           [H, Hk*d]

qwen4_exp (GDN layers linear.*, gated attention attn.qkv / q_norm / k_norm / o and MoE with a shared expert moe.*,
as above; W = S*H with S = arch.hyper_connections.num_streams and R its rank; Ni, Di = arch.indexer's heads and head
dim; E, K = arch.ple.embed_dim and conv_kernel, Dh = E / ((ngram_size - 1) * heads_per_ngram)). No attn_norm,
mlp_norm or norm.weight: the hyper-connections norm the streams, per stream (1+w stored), and hc_head ends the model.
  hc_head.norm.weight               [W]                the final mix of the streams (no inject)
  hc_head.down.weight               [R, W]
  hc_head.up.weight                 [W, R]
  layers.L.attn_hc.norm.weight      [W]                the mix before the mixer (layers.L.mlp_hc.*: before the MoE)
  layers.L.attn_hc.down.weight      [R, W]
  layers.L.attn_hc.up.weight        [W, R]
  layers.L.attn_hc.inject.weight    [S, W]             the mixer output's weight per stream
  layers.L.attn.indexer.qk.weight   [(Ni + 1)*Di, H]   QSA: rows the index query heads, then the index key
  layers.L.attn.indexer.q_norm.weight [Di]             (k_norm alike; 1+w stored)
  layers.L.ple.embed.weight         [rows, Dh]         PLE layers (arch.ple.layers): the n-gram table, table_rows
  layers.L.ple.key.weight           [W, E]             rows: a key per stream
  layers.L.ple.value.weight         [H, E]
  layers.L.ple.key_norm.weight      [W]                per-stream RMSNorms (query_norm, conv_norm alike; 1+w stored)
  layers.L.ple.conv.weight          [W, K]             the depthwise conv, taps ngram_size apart, oldest first

glm5_next (KDA layers kda.* with RecurrentConfig.gate_lower_bound, MLA layers mla.* with a q latent and no rope key,
attn_norm / mlp_norm, mlp.* / moe.* as above with arch.swiglu_limit; S = arch.mhc.num_streams; Ni, Di, P =
arch.dsa's num_heads, head_dim, pool_size; Rq = q_lora_rank). The indexer is absent in arch.dsa.shared_layers:
  layers.L.attn_hc.proj.weight      [(2 + S)*S, S*H]   mHC before the mixer (layers.L.mlp_hc.*: before the feed-
                                                        forward): rows pre (S), post (S), comb (S*S, row-major)
  layers.L.attn_hc.bias             [(2 + S)*S]        added to the scaled logits, rows as proj
  layers.L.attn_hc.scale            [3]                the logits' scales: pre, post, comb
  layers.L.mla.indexer.q.weight     [Ni*Di, Rq]        DSA: the index queries, from the normed q latent
  layers.L.mla.indexer.in_proj.weight [2*Di + Ni, H]   rows: the index key, the pool-gate logits, the head weights
  layers.L.mla.indexer.k_norm.weight [Di]              the index key's LayerNorm (k_norm.bias [Di] beside it)
  layers.L.mla.indexer.pool_bias    [P, Di]            the pool-gate logits' offset per position within a pool

muse_spark (attn.qkv with arch.attn_output_gate: rows q, k, v, then the elementwise gate; attn_norm, mlp_norm,
mlp_post_norm 1+w stored, mlp_post_norm applied as norm(x * w); no q/k/o or post-attention norm weights; L =
arch.moe.latent_size):
  layers.L.attn_residual.weight     [2, H]             the residual gate after attention: rows alpha, beta
                                                        (x = alpha * x + beta * sublayer, in float32)
  layers.L.mlp_residual.weight      [2, H]             the one after the feed-forward
  layers.L.moe.latent_norm.weight   [L]                with moe.latent_norms: the latent's norm (1+w stored)
  layers.L.moe.expert_norm.weight   [L]                each expert's output norm, norm(y * w) (1+w stored)
  lm_head.weight, layers.L.moe.router.weight           times output_multiplier

step3p7 (attn_norm / mlp_norm / q_norm / k_norm 1+w stored; Nq = arch.sliding_num_heads on a sliding layer when
set, else arch.num_heads; mlp.* / moe.* as above, the shared expert ungated):
  layers.L.attn.qkv.weight          [(Nq + 2*Nkv)*D + Nq, H] with arch.attn_gate_per_head: rows q, k, v, then one gate
                                                        row per head (sigmoid, scales the head's output)
  layers.L.attn.o.weight            [H, Nq*D]

gemma4 (attn_norm / attn_post_norm / mlp_norm / mlp_post_norm as gemma3's, but stored as the multiplier: gemma4 has
no 1+w; a full layer's D and Nkv are arch.full_head_dim / full_num_kv_heads; Vp, P = arch.gemma4's ple_vocab_size and
ple_dim; N = num_layers):
  layers.L.attn.qkv.weight          [(Nq + 2*Nkv)*D, H] rows q, k, v; a full layer with gemma4.k_eq_v has no v rows
                                                        ([(Nq + Nkv)*D, H]: v is k's projection), a KV-shared layer
                                                        (arch.kv_sources[L] != L) only q rows and no k_norm
  layers.L.layer_scalar             [1]                the layer's output times it
  layers.L.mlp_post_norm_1.weight   [H]                with arch.moe: the MLP branch's own post norm, then
  layers.L.moe_norm.weight          [H]                the MoE branch's pre norm (its router reads the weightless-
  layers.L.moe_post_norm.weight     [H]                normed stream) and post norm; mlp_post_norm norms their sum
  layers.L.moe.router.weight        [E, H]             router.scale / sqrt(H) folded into its columns
  layers.L.moe.down.weight          [E, H, Fm]         each expert's per_expert_scale folded in
  ple.embed.weight                  [Vp, N*P]          the per-layer embeddings, packed by layer (times sqrt(P))
  ple.proj.weight                   [N*P, H]           from the scaled embedding (times 1/sqrt(H)), then
  ple.norm.weight                   [P]                per layer normed
  layers.L.ple_gate.weight          [P, H]             with ple_dim: x += post_norm(proj(gelu(gate x) * ple_L))
  layers.L.ple_proj.weight          [H, P]
  layers.L.ple_post_norm.weight     [H]

mimo_v2_flash (Dv = arch.v_head_dim, Nkv = arch.layer_kv_heads(L): sliding layers have their own count):
  layers.L.attn.qkv.weight          [(Nq + Nkv)*D + Nkv*Dv, H] rows q, k, then v (times attention_value_scale)
  layers.L.attn.o.weight            [H, Nq*Dv]
  layers.L.attn.sinks               [Nq]               the layer types in arch.attention_sinks: a logit per head in
                                                        the softmax denominator

minimax_m3 (attn.* with q/k norms and arch.rotary_dim; every norm 1+w stored; mlp.* / moe.* as above with
arch.swiglu_alpha and swiglu_limit, moe.router.bias, the shared expert ungated; Ni, Di = arch.msa's num_heads and
head_dim). The sparse layers (arch.msa.layers) add the lightning indexer:
  layers.L.attn.indexer.qk.weight   [(Ni + 1)*Di, H]   rows: the index query heads, then the index key
  layers.L.attn.indexer.q_norm.weight [Di]             (k_norm alike; 1+w stored)

Norm weights are stored as the multiplier itself: y = x / rms(x) * w (gemma's 1+w already added).
"""

from __future__ import annotations

WEIGHTS_DIR = "weights"
# the namespace of the multi-token-prediction draft modules' tensors (Architecture.mtp, docs/core-format.md): exported
# by ignition for the speculative-decoding issue, bound by no model yet (helios.models.split_draft_tensors)
MTP_PREFIX = "mtp."
TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "template.jinja"


def layer(i: int, name: str) -> str:
    return f"layers.{i}.{name}"
