"""The core manifest (format v1): msgspec Structs, the format's single source of truth.

Owns the schema of `core.toml` and its deterministic TOML encoding. Imports no torch, no ignition.
Every field is written explicitly, so a core keeps its meaning if a default changes later; optional
fields default to None and only those are omitted from TOML (TOML has no null).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

FORMAT_VERSION = 1
MANIFEST_FILE = "core.toml"
MAX_TOP_LOGPROBS_LIMIT = 20

Family = Literal[
    "llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h",
    "kimi_linear",
    "qwen4_exp", "glm5_next",
    "gemma4", "mimo_v2_flash", "minimax_m3", "muse_spark", "step3p7", "deepseek_v4",
]
DType = Literal["float32", "bfloat16", "float16"]
# silu / gelu_tanh: gated MLPs (act(gate) * up); relu2: relu(x)^2 in a non-gated up/down MLP (nemotron_h)
Activation = Literal["silu", "gelu_tanh", "relu2"]
# linear: a recurrent layer (arch.recurrent says which kind) that keeps per-request state instead of KV pages;
# ffn: a block with a feed-forward and no token mixer (nemotron_h's MLP and MoE layers), no KV, no state
LayerType = Literal["full", "sliding", "linear", "ffn"]
RecurrentKind = Literal["gated_delta", "mamba2", "kimi_delta"]

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]


class _S(Struct, forbid_unknown_fields=True, frozen=True):
    """Base: frozen, strict."""


class ModelIdentity(_S):
    """Who the model is; `id` is the checkpoint identifier served in /v1/models."""

    id: str
    name: str
    aliases: list[str] = []
    source_sha256: str = ""  # digest over the source files (content only, no paths)


class RopeScaling(_S):
    """Rotary scaling as HF configs declare it (llama3 / linear / yarn subsets)."""

    type: Literal["linear", "llama3", "yarn", "dynamic"]
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


class MoeConfig(_S):
    num_experts: PosInt
    num_experts_per_tok: PosInt
    moe_intermediate_size: PosInt
    norm_topk_prob: bool = True
    # layer indices that keep a dense MLP instead of experts
    dense_layers: list[int] = []
    # a shared expert every token takes beside its routed ones, scaled by sigmoid(shared_gate x) (qwen3_5_moe)
    shared_expert_intermediate_size: NonNegInt = 0
    shared_expert_gate: bool = True  # False: the shared expert's output is added as is (nemotron_h, deepseek_v3)
    # The router. softmax (qwen3_moe): softmax over all experts, top-k, renormalised with norm_topk_prob.
    # sigmoid (deepseek_v3, kimi, nemotron_h): scores = sigmoid(router x) in float32; experts are chosen by
    # scores + router.bias (with score_bias; HF's e_score_correction_bias) among the num_topk_groups best of
    # num_groups equal groups (a group ranks by the sum of its two best biased scores); the weights are the chosen
    # unbiased scores, renormalised with norm_topk_prob (sum + 1e-20), times routed_scaling_factor.
    # sqrtsoftplus (deepseek_v4): sigmoid's rule with scores = sqrt(softplus(router x)), one group, always renormalised
    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    score_bias: bool = False
    num_groups: PosInt = 1  # n_group
    num_topk_groups: PosInt = 1  # topk_group
    routed_scaling_factor: float = 1.0
    # the routed experts read and write a latent of this width: moe.latent_in [L, H] before them and
    # moe.latent_out [H, L] after (nemotron_h's LatentMoE, moe_latent_size); 0: the hidden size, no projections
    latent_size: NonNegInt = 0
    # muse_spark's latent MoE: the latent is RMS-normed after latent_in (moe.latent_norm.weight [L], multiplied in
    # float32; eps arch.rms_norm_eps) and each expert's output before its routing weight, the weight multiplied first
    # (moe.expert_norm.weight [L]: norm(y * w); eps arch.post_norm_eps)
    latent_norms: bool = False
    # deepseek_v4's hash-routed layers: their experts are moe.tid2eid [vocab, k] rows of the token ids (no score
    # bias); their weights are the router's scores of those experts, as in the other layers
    hash_layers: list[NonNegInt] = []


class RecurrentConfig(_S):
    """The recurrent layers of a hybrid model (the `linear` entries of arch.layer_types).

    Per request and layer they keep a conv state [conv_kernel - 1, conv_dim] in the model dtype (the last inputs
    of the depthwise causal conv) and a recurrent state [num_heads, key_head_dim, value_head_dim] in float32.
    gated_delta (qwen3_5 / qwen3_next GDN): q/k have num_key_heads heads of key_head_dim, v and the state
    num_heads heads (a multiple of num_key_heads) of value_head_dim.
    mamba2 (nemotron_h): x has num_heads heads of value_head_dim (mamba_head_dim), B and C num_key_heads groups
    (n_groups) of key_head_dim (ssm_state_size); the state [num_heads, value_head_dim, key_head_dim] (HF's
    [H, P, N]; the same element count as above, which the runtime's state row holds).
    kimi_delta (kimi_linear KDA): q, k, v and the state have num_heads (= num_key_heads) heads of key_head_dim
    (= value_head_dim); the conv's channels are q, k, v side by side (kimi's three short convs), the decay is per
    key channel."""

    kind: RecurrentKind
    num_heads: PosInt  # value / state heads
    num_key_heads: PosInt  # q/k heads
    key_head_dim: PosInt
    value_head_dim: PosInt
    conv_kernel: PosInt
    chunk_size: PosInt = 64  # the chunked prefill form's chunk: state checkpoints and prefill chunks align to it
    conv_bias: bool = False  # the conv adds conv.bias [conv_dim] before its activation (mamba2)
    # mamba2: dt clamped to [min, max] after its softplus in the chunked form, as HF (time_step_limit); None:
    # (0, inf), no clamp
    time_step_limit: tuple[float, float] | None = None
    # channels per group of the gated output RMSNorm; None: one head (value_head_dim). mamba2: num_heads *
    # value_head_dim / num_key_heads (HF's NemotronHRMSNormGated group_size)
    norm_group_size: PosInt | None = None
    # the gated output RMSNorm's gate: silu (qwen3_5, nemotron_h) or sigmoid (qwen4_exp's output_gate_type)
    output_gate: Literal["silu", "sigmoid"] = "silu"
    # kimi_delta: glm5_next's safe forget gate, g = gate_lower_bound * sigmoid(exp(A_log) * (f_b f_a x + dt_bias))
    # (linear_lower_bound, < 0); None: kimi_linear's g = -exp(A_log) * softplus(f_b f_a x + dt_bias)
    gate_lower_bound: float | None = None

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of every head."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_heads * self.value_head_dim


class MlaConfig(_S):
    """Multi-head latent attention (deepseek_v3, kimi_linear, glm5_next): every attention layer is MLA.

    Per head, q is [qk_nope_head_dim, qk_rope_head_dim] wide; k is the head's up-projected latent (qk_nope_head_dim)
    and one rope key shared by every head (qk_rope_head_dim); v is the head's up-projected latent (v_head_dim).
    The KV pages hold, per token and layer, kv_lora_rank + qk_rope_head_dim values: the latent after its RMSNorm
    and the shared rope key, never per-head K/V. The rope dims rotate under arch.position_embedding "rope" (with
    arch.rope_theta / rope_scaling over qk_rope_head_dim; ignition de-interleaves deepseek's interleaved pairs) and
    pass as they are under "none" (kimi_linear: NoPE, its "rope" key is a plain shared key)."""

    kv_lora_rank: PosInt
    qk_nope_head_dim: PosInt
    qk_rope_head_dim: NonNegInt  # 0: no shared key part (glm5_next)
    v_head_dim: PosInt
    # the softmax scale as the model computes it: (qk_nope + qk_rope) ** -0.5, times yarn's mscale(factor,
    # mscale_all_dim) ** 2 where the rope scaling asks for it (deepseek_v3's yarn_apply_mscale); ignition computes it
    softmax_scale: float
    q_lora_rank: PosInt | None = None  # q through a low-rank latent (q_a, its RMSNorm, q_b); None: straight from x
    norm_eps: float = 1e-6  # the latent norms' epsilon (HF builds them with their class default, not rms_norm_eps)

    @property
    def cache_dim(self) -> int:
        """Values one token keeps per layer: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class IndexerConfig(_S):
    """QSA, qwen4_exp's query-selected sparse attention, in every full-attention layer: each query attends only to
    the tokens of its num_blocks best blocks (block_size consecutive tokens, from position 0) and to every token
    past the last complete block it sees (itself among them); a query that sees num_blocks blocks or fewer attends
    as full attention.

    A block's score for a query: sum over the num_heads index heads h of relu(q_h . k_b) / sqrt(head_dim) in
    float32, q_h the token's index query (the indexer's q_norm, then rotary at its position), k_b the block key:
    the mean of its tokens' raw index keys (the key rows of attn.indexer.qk, before any norm), then the indexer's
    k_norm and rotary at the block's first position; the rotary turns the leading arch.rotary_dim dims. The raw key
    of every token lives in a paged tensor beside the layer's KV (helios.runner.kv_cache), so it is kept and freed
    with the pages."""

    num_heads: PosInt  # index query heads (indexer_n_heads); one index key head
    head_dim: PosInt  # indexer_head_dim, >= arch.rotary_dim
    block_size: PosInt  # tokens averaged into one block key (indexer_compress_ratio)
    num_blocks: PosInt  # blocks a query selects (indexer_budget // indexer_compress_ratio)


class HyperConnectionConfig(_S):
    """qwen4_exp's gated-residual hyper-connections: the residual stream is num_streams streams of the hidden size
    side by side ([T, num_streams * hidden], the embedding repeated). Before each sublayer the streams are
    RMS-normed one by one (n), its input is the mean over streams of sigmoid(up(silu(down(n) / num_streams))) * n,
    and its output y is added to stream s times 2 * sigmoid(inject(n)_s / num_streams). After the last layer the
    same mix without injection (hc_head.*) gives the final hidden state; there is no final norm."""

    num_streams: Annotated[int, Meta(ge=2)]  # hc_count
    rank: PosInt  # hc_lowrank: down [rank, S*H], up [S*H, rank]


class PleConfig(_S):
    """qwen4_exp's per-layer n-gram embeddings (PLE), added to the residual streams of `layers` before their block.

    For each token and n = 2 .. ngram_size, with t_j the token j places back (t_0 the token itself; the reset token
    stands for every t_j before the sequence's start or at or before a reset token among t_1 .. t_j): heads_per_ngram
    hashed ids XOR_{j<n}(t_j * multipliers[p][j]) mod head_vocab_sizes[p][head] + the head's offset (the sizes
    before it), p the layer's place in `layers`, heads n-major. Their rows of layers.L.ple.embed [rows, embed_dim /
    ((ngram_size - 1) * heads_per_ngram)], concatenated (e, embed_dim wide), give a value v = ple.value e [H] and
    per stream a key k_s (ple.key e, normed per stream); with q_s = query_norm(stream_s) and g_s = k_s . q_s /
    sqrt(H), g = sigmoid(sign(g_s) sqrt(max(|g_s|, 1e-6))) * v per stream (u, [S*H]); the layer adds u + silu(a
    depthwise causal conv, conv_kernel taps ngram_size apart, over conv_norm(u)). Per request the layer keeps the
    conv's last state_width inputs (a state tensor beside the GDN's, helios.runner.state_cache); the n-gram context
    is the request's own tokens, passed with the batch (AttentionMetadata.context_token_ids)."""

    layers: list[NonNegInt]  # zero-based indices of the PLE layers (linear layers)
    ngram_size: Annotated[int, Meta(ge=2)]
    heads_per_ngram: PosInt
    embed_dim: PosInt  # ple_embed_dim: every head's embedding, concatenated
    conv_kernel: PosInt  # taps of the dilated conv (ple_conv_kernel_size); its dilation is ngram_size
    reset_token_id: NonNegInt  # the n-gram context restarts after it (HF: the first eos_token_id)
    multipliers: list[list[int]]  # per PLE layer: ngram_size odd int64 hash multipliers
    head_vocab_sizes: list[list[PosInt]]  # per PLE layer: (ngram_size - 1) * heads_per_ngram moduli (primes)
    table_rows: list[PosInt]  # per PLE layer: rows of its table (the moduli summed, padded as the checkpoint's)

    @property
    def state_width(self) -> int:
        """Conv inputs a request keeps per PLE layer: (conv_kernel - 1) * ngram_size."""
        return (self.conv_kernel - 1) * self.ngram_size


class DsaConfig(_S):
    """glm5_next's DSA indexer beside MLA in every attention layer: each query attends only to the tokens of its
    num_pools best pools (pool_size consecutive tokens from position 0, complete ones only) and to the incomplete
    tail past the last complete pool it sees (itself among it); a query that sees num_pools pools or fewer attends
    to every earlier token. A pool's score for a query: sum over the num_heads index heads h of w_h * relu(q_h .
    k_pool) / sqrt(head_dim), in float32, with q_h = mla.indexer.q (the MLA's normed q latent), w = the indexer
    in_proj's head-weight rows / sqrt(num_heads) and k_pool = sum_j softmax_j(gate_j + pool_bias_j) * k_j over the
    pool's tokens j (softmax per channel; k_j = LayerNorm(key row), gate_j = the gate rows, both from the layer's
    normed input). Ties go to the earlier pool. Per token the layer keeps [k_j, gate_j] (cache_dim values) in a
    paged tensor beside its latent pages (helios.runner.kv_cache), kept and freed with them. A shared layer
    (indexer_types "shared") has no indexer: it reuses the selection of the attention layer just before it."""

    num_heads: PosInt  # index_n_heads
    head_dim: PosInt  # index_head_dim
    pool_size: PosInt  # index_kpool
    num_pools: PosInt  # pools a query selects: index_topk // index_kpool
    shared_layers: list[NonNegInt] = []  # attention layers whose selection is the previous layer's
    key_norm_eps: float = 1e-6  # the index key's LayerNorm

    @property
    def cache_dim(self) -> int:
        """Values one token keeps per layer: its normed index key and its pool-gate logits."""
        return 2 * self.head_dim


class MsaConfig(_S):
    """minimax_m3's block-sparse attention (MiniMax sparse attention, HF's lightning indexer) in `layers`: GQA
    attention whose query heads attend, per index head, only to the keys of num_blocks blocks (block_size consecutive
    tokens from position 0; the query's own block and the local_blocks - 1 before it always among them), causally.
    A block's score for a query: the max over its keys j <= the query's position of q_h . k_j in float32, q_h the
    index query of head h (the indexer's q_norm, then rotary at its position), k_j the index key of token j (k_norm,
    then rotary at j); the rotary turns the leading arch.rotary_dim dims. Index head h selects for the query heads
    h * G .. (h + 1) * G - 1, G = arch.num_heads / num_heads. Ties go to the earlier block. Per token the layer keeps
    k_j (head_dim values) in a paged tensor beside its K/V (helios.runner.kv_cache), kept and freed with them."""

    num_heads: PosInt  # index_n_heads
    head_dim: PosInt  # index_head_dim, >= arch.rotary_dim
    block_size: PosInt  # index_block_size
    num_blocks: PosInt  # index_topk_blocks: blocks a query keeps, its local ones among them
    local_blocks: NonNegInt  # index_local_blocks (<= num_blocks)
    layers: list[NonNegInt]  # the sparse attention layers (layer_types "minimax_m3_sparse")


class MhcConfig(_S):
    """glm5_next's manifold-constrained hyper-connections (mHC): the residual stream is num_streams streams of the
    hidden size ([T, S, H], the embedding repeated). Before each sublayer, from the streams flattened to [T, S*H]
    and RMS-normed without a weight (arch.rms_norm_eps) in float32, one projection gives per token pre [S], post [S]
    and comb [S, S] logits: pre = sigmoid(scale_0 pre + bias) + eps, post = 2 sigmoid(scale_1 post + bias),
    comb = softmax_rows(scale_2 comb + bias) + eps, then made doubly stochastic by sinkhorn_iterations of
    normalisation (columns first, then rows and columns, each sum + eps). The sublayer reads sum_s pre_s x_s; its
    output y gives the new streams x'_n = post_n y + sum_m comb_mn x_m. After the last layer the streams' mean,
    then the final norm."""

    num_streams: PosInt  # hc_mult
    sinkhorn_iterations: PosInt  # hc_sinkhorn_iters
    eps: float  # hc_eps


class Gemma4Config(_S):
    """gemma4's text decoder beyond what gemma3 has (helios.models.gemma4 computes each piece as HF does).

    Full-attention layers have their own head_dim and kv heads (arch.full_head_dim / full_num_kv_heads) and
    proportional rope: of a full head's full_head_dim / 2 rotary pairs (dim j with j + full_head_dim / 2) the first
    rotated_pairs turn at theta ** (-2 j / full_head_dim) / rope_factor (arch.rope_theta), the rest pass; sliding
    layers turn every pair at arch.rope_local_theta. q/k RMSNorms, a weightless RMSNorm on v, attention scale 1.
    k_eq_v: a full layer's v is its k projection (before k_norm; its qkv has no v rows). A KV-shared layer
    (arch.kv_sources) has only q rows and no k_norm. Per-layer embeddings (ple_dim > 0): per token and layer a
    ple_dim vector (ple.* tensors) gates a residual branch after the feed-forward. Every layer ends by multiplying
    the residual stream by its layer_scalar. With arch.moe the MoE block runs beside the MLP on the same input."""

    rotated_pairs: NonNegInt  # int(partial_rotary_factor * full_head_dim / 2)
    rope_factor: float = 1.0  # the proportional rope's factor (divides the full layers' frequencies)
    k_eq_v: bool = False  # attention_k_eq_v
    double_wide_mlp: bool = False  # KV-shared layers' MLPs are 2 * intermediate_size wide (use_double_wide_mlp)
    ple_dim: NonNegInt = 0  # hidden_size_per_layer_input; 0: no per-layer embeddings
    ple_vocab_size: NonNegInt = 0  # vocab_size_per_layer_input: rows of ple.embed


class CompressedAttentionConfig(_S):
    """deepseek_v4's attention: shared-KV MQA (one K=V head of arch.head_dim d after its RMSNorm, per-head sinks
    arch.num_heads in the softmax's denominator) over a sliding window of `window` tokens (itself among them) in
    every layer, plus, per layer_kinds entry, compressed entries: "hca" one per hca_rate tokens (a softmax-gated mix
    of the window's kv rows with position_bias on the gate logits, RMSNormed, rotated at the window's first
    position); "csa" one per csa_rate tokens from 2 * csa_rate rows (the previous window's first half and this
    one's second half of 2d-wide rows), of which each query keeps the index_topk best by its lightning indexer
    (index_num_heads heads of index_head_dim over entries the indexer compresses alike); "sliding" none. A query at
    p sees the entries of windows that end at or before p. q through a low-rank latent (q_lora_rank, RMSNorm, then
    an unweighted per-head RMSNorm); rope on each head's trailing rope_dim dims, interleaved pairs, rope_theta
    (sliding) or compress_rope_theta + compress_rope_scaling (others); the output turns back by the query's
    rotation; o_groups groups of heads each to o_lora_rank values, then one projection. Per token and layer the KV
    pages keep the normed rotated kv row and the raw compressor rows (raw_dim; in the window page group when the
    compressors' reach fits the window) and a share of its window's entries (entry_row_dim, in entry_rows rows;
    helios.layers.compressed_attention)."""

    layer_kinds: list[Literal["sliding", "csa", "hca"]]
    window: PosInt  # sliding_window
    q_lora_rank: PosInt
    rope_dim: PosInt  # qk_rope_head_dim: the trailing rotated dims of a head (even)
    o_groups: PosInt
    o_lora_rank: PosInt
    csa_rate: PosInt  # compress_rates["compressed_sparse_attention"]
    hca_rate: PosInt  # compress_rates["heavily_compressed_attention"]
    index_num_heads: PosInt
    index_head_dim: PosInt
    index_topk: PosInt
    compress_rope_theta: float
    compress_rope_scaling: RopeScaling | None = None  # yarn without its attention factor (deepseek_v4 forces 1)

    def raw_dim(self, kind: str, head_dim: int) -> int:
        """Values each token writes in a layer of this kind, read while it is in the window: its kv row, then the raw
        compressor kv and gate rows (2d wide each in csa, overlapping windows; d in hca) and csa's indexer kv and gate
        rows (2 index_head_dim each)."""
        return {"sliding": head_dim, "hca": 3 * head_dim, "csa": 5 * head_dim + 4 * self.index_head_dim}[kind]

    def entry_rows(self, kind: str, page_size: int) -> int:
        """The rows of a window that hold its entry: its last min(rate, page_size) when one divides the other (all in
        the page of the window's last token, which the step completing the window owns: a page shared through the
        prefix cache is never written), else its last row alone."""
        rate = self.csa_rate if kind == "csa" else self.hca_rate
        return min(rate, page_size) if rate % page_size == 0 or page_size % rate == 0 else 1

    def entry_row_dim(self, kind: str, head_dim: int, page_size: int) -> int:
        """Values each of those rows keeps of its window's compressed entry (d; csa: and the indexer's key, Di)."""
        entry = {"sliding": 0, "hca": head_dim, "csa": head_dim + self.index_head_dim}[kind]
        return -(-entry // self.entry_rows(kind, page_size))

    def row_dim(self, kind: str, head_dim: int, page_size: int) -> int:
        """Values one token keeps in a layer of this kind: raw_dim + entry_row_dim."""
        return self.raw_dim(kind, head_dim) + self.entry_row_dim(kind, head_dim, page_size)

    def fits_window(self) -> bool:
        """Whether every row the compressors read lies in the window a query reads (2 csa_rate and hca_rate at most
        `window`): then the raw rows can live in the engine's window page group."""
        return 2 * self.csa_rate <= self.window and self.hca_rate <= self.window


class MtpConfig(_S):
    """The checkpoint's multi-token-prediction (MTP) draft modules, exported for the speculative-decoding issue:
    helios maps their tensors (mtp.{k}.*, docs/core-format.md) and binds none of them yet. Module k takes the hidden
    state h the main model (or module k - 1) gave at position t and the embedding e of token t + k + 1, forms
    x = eh_proj([enorm(e), hnorm(h)]) (layout "deepseek_v4": e_proj(enorm(e)) + h_proj(hnorm(h)) on its mHC
    streams, collapsed by its own hc_head), runs one decoder layer in the family's runtime layout (mtp.{k}.layer.*
    named as layers.L.*) of kind layer_kinds[k], then its own final norm and the main model's lm_head, predicting
    token t + k + 2. The embedding and lm_head are the main model's (no copies are stored)."""

    num_modules: PosInt
    # the family whose MTP math the tensors follow ("step3p7" as "mimo_v2_flash"; "glm5_next": x repeated onto the
    # mHC streams before the layer and their plain mean taken after it, as its main model does: transformers builds
    # no GLM MTP to say otherwise)
    layout: Literal["deepseek_v4", "mimo_v2_flash", "qwen3_next", "step3p7", "glm5_next"]
    # each module's decoder layer: its attention kind (deepseek_v4: sliding / csa / hca as in arch.compressed) and
    # whether its feed-forward is an MoE (arch.moe's, never hash-routed) or a dense MLP (arch.intermediate_size)
    layer_kinds: list[Literal["full", "sliding", "csa", "hca"]]
    moe_modules: list[NonNegInt] = []
    # per module, the SwiGLU clamps of its routed / dense-or-shared MLP (as arch.swiglu_limits*; [] none; step3p7)
    swiglu_limits: list[Annotated[float, Meta(ge=0)]] = []
    swiglu_limits_shared: list[Annotated[float, Meta(ge=0)]] = []


class Architecture(_S):
    """The family helios executes and its dimensions. Weight transforms are already applied."""

    family: Family
    vocab_size: PosInt
    hidden_size: PosInt
    intermediate_size: PosInt
    num_layers: PosInt
    num_heads: PosInt
    num_kv_heads: PosInt
    head_dim: PosInt
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: PosInt
    tie_word_embeddings: bool
    hidden_act: Activation = "silu"
    attention_bias: bool = False  # qkv bias (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3, gemma3)
    rope_scaling: RopeScaling | None = None
    # gemma3: sandwich norms, embedding scale, local rope base, query scale, sliding layers
    sandwich_norms: bool = False
    embedding_scale: float | None = None
    query_scale: float | None = None  # attention scale; None means head_dim ** -0.5
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    layer_types: list[LayerType] = []  # empty means all "full"
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    moe: MoeConfig | None = None
    # hybrid models (qwen3_5): recurrent layers beside the attention layers, and their attention's extras
    recurrent: RecurrentConfig | None = None
    attn_output_gate: bool = False  # o *= sigmoid(gate) per head before the o projection (qkv emits the gate)
    rotary_dim: int | None = None  # rotated leading dims of a head (partial rotary); None: the whole head
    # none: attention without position embeddings (nemotron_h; rope_theta and rope_scaling are then unused)
    position_embedding: Literal["rope", "none"] = "rope"
    # False: a block holds one pre-norm sublayer, its mixer (full / sliding / linear) or, in an "ffn" layer, its
    # feed-forward (nemotron_h); True: a mixer block also runs the MLP / MoE after it (mlp_norm, then mlp or moe)
    ffn_after_mixer: bool = True
    # multi-head latent attention in every attention layer (kimi_linear); head_dim is then qk_nope + qk_rope (the
    # expanded form's q/k width) and num_kv_heads equals num_heads, while the KV pages hold latents (MlaConfig)
    mla: MlaConfig | None = None

    # qwen4_exp: QSA in every full-attention layer, hyper-connections, per-layer n-gram embeddings (each struct says)
    indexer: IndexerConfig | None = None
    hyper_connections: HyperConnectionConfig | None = None
    ple: PleConfig | None = None
    # glm5_next: DSA beside MLA in every attention layer, mHC residual streams, and its gated MLPs' clamp: every
    # SwiGLU (dense, routed and shared experts) clamps gate to <= swiglu_limit and up to [-limit, limit] first
    dsa: DsaConfig | None = None
    mhc: MhcConfig | None = None
    swiglu_limit: float | None = None
    # qwen3_5: the multipliers (1 + w) of the RMSNorms applied in float32 are stored and bound in float32 whatever the
    # core dtype (HF computes 1 + w in float32; rounding it to bf16 moves a norm's output by up to 2^-8)
    float32_norms: bool = False
    # attention shapes per layer type (gemma4): the full layers' head_dim and kv heads where they differ from
    # head_dim / num_kv_heads (then the sliding layers'); None: the same
    full_head_dim: PosInt | None = None
    full_num_kv_heads: PosInt | None = None
    # KV sharing (gemma4's num_kv_shared_layers): per layer, the attention layer whose KV pages it reads (itself: its
    # own). A layer that reads another's writes no KV and keeps no pages. Empty: every layer keeps its own
    kv_sources: list[NonNegInt] = []
    gemma4: Gemma4Config | None = None
    # minimax_m3: block-sparse attention layers (MsaConfig), and SwiGLU-OAI gated MLPs: with swiglu_alpha every
    # gated MLP computes (up + 1) * gate * sigmoid(swiglu_alpha * gate), after the swiglu_limit clamp
    msa: MsaConfig | None = None
    swiglu_alpha: float | None = None
    # step3p7: the sliding layers' own query heads and rotary dims (None: num_heads, rotary_dim; their KV heads and
    # head_dim are the full layers'); an output gate of one sigmoid per head (attn_output_gate with
    # attn_gate_per_head: qkv's last num_heads rows) instead of one per channel; per-layer SwiGLU clamps applied
    # after the activation, min(act(gate), l) * clamp(up, -l, l), of the routed experts (swiglu_limits) and of the
    # dense MLPs and shared experts (swiglu_limits_shared); an entry 0 clamps nothing, an empty list nowhere
    sliding_num_heads: PosInt | None = None
    sliding_rotary_dim: PosInt | None = None
    attn_gate_per_head: bool = False
    swiglu_limits: list[Annotated[float, Meta(ge=0)]] = []
    swiglu_limits_shared: list[Annotated[float, Meta(ge=0)]] = []
    # muse_spark: attention layers without rotary (layer_rope_theta 0) beside rotary ones, whatever their type; the
    # epsilon of its norms after a sublayer and after an expert (post_norm_eps; None: rms_norm_eps)
    nope_layers: list[NonNegInt] = []
    post_norm_eps: float | None = None
    # deepseek_v4: sliding-window MQA with compressed entries in every layer (CompressedAttentionConfig)
    compressed: CompressedAttentionConfig | None = None
    # mimo_v2_flash: V heads narrower than q/k heads (the KV pages keep V zero-padded to head_dim), sliding layers
    # with their own KV head count, and learned per-head sink logits (attn.sinks [Nq]) in the softmax denominator
    # of the layers whose type is listed
    v_head_dim: PosInt | None = None  # None: head_dim
    sliding_num_kv_heads: PosInt | None = None  # None: num_kv_heads
    attention_sinks: list[LayerType] = []
    # the checkpoint's multi-token-prediction draft modules (MtpConfig; None: it has none), mapped, not bound
    mtp: MtpConfig | None = None

    @property
    def attention_layers(self) -> list[int]:
        """Layers that keep paged KV (every layer of a model without recurrent ones)."""
        return [i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] in ("full", "sliding")]

    def layer_kv_heads(self, i: int) -> int:
        """KV heads of attention layer i: sliding_num_kv_heads on a sliding layer when set, else num_kv_heads."""
        sliding = self.layer_types and self.layer_types[i] == "sliding"
        return self.sliding_num_kv_heads if sliding and self.sliding_num_kv_heads else self.num_kv_heads

    @property
    def kv_layers(self) -> list[int]:
        """Attention layers that keep KV pages of their own (all of them without KV sharing)."""
        return [i for i in self.attention_layers if not self.kv_sources or self.kv_sources[i] == i]

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head_dim) of an attention layer's K and V."""
        if self.layer_types and self.layer_types[layer] == "full" and (self.full_head_dim or self.full_num_kv_heads):
            return self.full_num_kv_heads or self.num_kv_heads, self.full_head_dim or self.head_dim
        return self.layer_kv_heads(layer), self.head_dim

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.layer_types and self.layer_types[i] == "linear"]

    @property
    def index_dim(self) -> int:
        """Values one token keeps per attention layer for an indexer, in a paged tensor beside its KV: QSA's raw
        index key (head_dim), MSA's index key (head_dim), DSA's index key and pool-gate logits (cache_dim); 0 without
        an indexer."""
        if self.indexer is not None:
            return self.indexer.head_dim
        if self.msa is not None:
            return self.msa.head_dim
        return self.dsa.cache_dim if self.dsa is not None else 0


class TokenizerInfo(_S):
    file: str = "tokenizer.json"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []  # tokens that end generation (EOS plus generation_config extras)
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False


class ReasoningSyntax(_S):
    open: str
    close: str
    open_token_id: int | None = None  # set when the delimiter is one token
    close_token_id: int | None = None
    starts_in_reasoning: bool = False  # the generation prompt already opened reasoning


# "jinja": the prepared template.jinja; deepseek_v4 / deepseek_v41: helios' native encoder of DeepSeek's published
# encoding script (helios/core/deepseek_encoding.py), no template file; kimi_k3: Kimi K3's XTML (kimi_encoding.py)
TemplateKind = Literal["jinja", "deepseek_v4", "deepseek_v41", "kimi_k3"]


class TemplateCaps(_S):
    """Probe results of the prepared chat template."""

    present: bool
    file: str | None = None  # "template.jinja" when present
    inline_system: bool = False  # a system message after the first renders inline
    system_role: bool = False  # a leading system message is rendered
    default_system: bool = False  # the template inserts a system message when none is given
    tools: bool = False
    continuation: bool = False  # continue_final_message renders an open assistant turn
    generation_prompt: str = ""  # text add_generation_prompt appends
    reasoning: ReasoningSyntax | None = None
    kwargs: list[str] = []  # chat_template_kwargs the template reads (enable_thinking, ...)
    kind: TemplateKind = "jinja"  # what renders prompts: the template file, or a native encoder


class SamplingDefaults(_S):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0


class Range(_S):
    min: float
    max: float


class SamplingRanges(_S):
    """Inclusive bounds; an absent parameter is fixed at its default."""

    temperature: Range | None = None
    top_p: Range | None = None
    top_k: Range | None = None
    min_p: Range | None = None
    repetition_penalty: Range | None = None
    presence_penalty: Range | None = None
    frequency_penalty: Range | None = None


class Recipe(_S):
    name: str
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    effort_levels: list[str] = []  # named reasoning-effort levels the template accepts
    default_effort: str | None = None  # the level used when a request names none
    effort_score_min: int | None = None  # numeric reasoning_effort bounds (DeepSeek V4.1: 1..100)
    effort_score_max: int | None = None
    effort_scores: dict[str, int] = {}  # named level -> numeric score


class Sampling(_S):
    defaults: SamplingDefaults = SamplingDefaults()
    ranges: SamplingRanges = SamplingRanges()


class LogprobCaps(_S):
    max_top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS_LIMIT)] = MAX_TOP_LOGPROBS_LIMIT
    explicit_token_ids: bool = True  # logprob_token_ids inputs
    max_explicit_token_ids: NonNegInt = 128
    prompt_logprobs: bool = False  # scored prefill graphs (--prompt-logprobs)


class Vision(_S):
    enabled: bool = False
    max_images_per_prompt: NonNegInt = 0
    max_image_tokens_per_prompt: NonNegInt = 0
    image_feature_window_tokens: NonNegInt = 0
    max_image_tokens_per_image: NonNegInt = 0
    max_image_pixels: NonNegInt = 0
    max_image_bytes: NonNegInt = 0


class Limits(_S):
    context_length: PosInt
    default_max_tokens: PosInt


class GraphPlan(_S):
    """Shapes the runtime prepares: decode batch buckets, prefill chunks, KV page size."""

    decode_buckets: list[int]
    prefill_chunk_size: PosInt
    max_concurrency: PosInt
    page_size: PosInt
    logprob_outputs: NonNegInt  # top-N columns the sampling tail produces


class KernelTarget(_S):
    target: str  # e.g. "cuda-sm90"
    triton_version: str
    dir: str  # kernels/<target>


class FileDigest(_S):
    path: str  # relative to the core directory, '/'-separated
    size: NonNegInt
    sha256: str


class Manifest(_S):
    format_version: int
    ignition_version: str
    model: ModelIdentity
    arch: Architecture
    recipe: Recipe
    dtype: DType
    tokenizer: TokenizerInfo
    template: TemplateCaps
    sampling: Sampling
    logprobs: LogprobCaps
    vision: Vision
    limits: Limits
    graph_plan: GraphPlan
    decode_weight_bytes: NonNegInt = 0
    kernels: list[KernelTarget] = []
    files: list[FileDigest] = []


def _sorted(obj):
    # NOTE: dict keys are sorted so equal manifests encode to equal bytes; list order is data.
    if isinstance(obj, dict):
        return {k: _sorted(obj[k]) for k in sorted(obj) if obj[k] is not None}
    if isinstance(obj, list):
        return [_sorted(v) for v in obj]
    return obj


def encode_manifest(manifest: Manifest) -> bytes:
    import tomli_w

    return tomli_w.dumps(_sorted(msgspec.to_builtins(manifest))).encode()


def decode_manifest(data: bytes) -> Manifest:
    """Decode and validate; raises msgspec.ValidationError / DecodeError with a field path."""
    return msgspec.toml.decode(data, type=Manifest)


def json_schema() -> dict:
    return msgspec.json.schema(Manifest)
