"""deepseek_v4 (DeepSeek-V4-Flash, text): sliding-window shared-KV MQA with compressed entries (HCA, or CSA with its
lightning indexer; helios.layers.compressed_attention) between manifold-constrained hyper-connections (mHC: the
residual stream is num_streams streams, [T, S, H]; after the last layer a learned collapse, hc_head, then the final
norm), and in every layer routed clamped-SwiGLU experts (sqrtsoftplus scores, or hash routing by token id in
arch.moe.hash_layers) beside one shared expert.

Block: post, comb, h = attn_hc(x); x = post * attn(attn_norm(h)) + comb^T x; the same with mlp_hc, mlp_norm and the
MoE. Forward-only, no weights of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import Architecture, MoeConfig
from helios.layers.attention import AttentionBackend, AttentionMetadata
from helios.layers.compressed_attention import CompressedAttention, InterleavedRope
from helios.layers.linear import Embedding, Linear, linear, meta_parameter
from helios.layers.mhc import HyperHead, ManifoldHyperConnection
from helios.layers.moe import SigmoidMoe, router_scores
from helios.layers.norm import RMSNorm
from helios.switches import DEFAULT_SWITCHES, Switches


class DeepseekV4Moe(SigmoidMoe):
    """SigmoidMoe with deepseek_v4's router; in a hash layer the experts are tid2eid's row of the token (tensor
    moe.tid2eid [vocab, k], integer-valued) and the router has no score bias. fused: SigmoidMoe's; a hash layer's
    routing then takes the table's row as moe_route's given ids."""

    def __init__(self, hidden_size: int, moe: MoeConfig, vocab_size: int, is_hash: bool, act, switches: Switches,
                 limit: float | None, fused: bool = False) -> None:
        super().__init__(hidden_size, moe, act, switches, limit, fused=fused)
        self.is_hash = is_hash
        if is_hash:
            self.router.bias = None  # hash layers choose no experts by score: no score bias
            self.tid2eid = meta_parameter(vocab_size, moe.num_experts_per_tok)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:  # [T, H], [T] -> [T, H]
        if not self.is_hash:
            return super().forward(x)
        m = self.moe
        logits = self.router_logits(x)  # float32: one launch for decode rows on the fused path
        if self.fused:  # the same weights in one launch, no host sync; the shared add rides in the combine
            weights, experts = self._route_given_fused(logits, self.tid2eid[token_ids], m.scoring,
                                                       m.routed_scaling_factor)
            return self._experts_fused(x, weights, experts, self.shared)
        scores = router_scores(logits, m.scoring)
        experts = self.tid2eid[token_ids].long()  # NOTE: exact in 16-bit floats too (ids below 256)
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * m.routed_scaling_factor
        return self._experts(x, weights, experts) + self.shared(x)


class DeepseekV4Layer(nn.Module):
    """attn_hc, attn_norm, attn (CompressedAttention of the layer's kind); mlp_hc, mlp_norm, moe."""

    def __init__(self, arch: Architecture, layer_idx: int, switches: Switches = DEFAULT_SWITCHES,
                 fused: bool = False, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        h, eps, c = arch.hidden_size, arch.rms_norm_eps, arch.compressed
        self.kind = c.layer_kinds[layer_idx]
        self.attn_hc = ManifoldHyperConnection(h, arch.mhc, eps, fused)
        self.attn_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.attn = CompressedAttention(h, arch.num_heads, arch.head_dim, self.kind, c, eps, switches, backend)
        self.mlp_hc = ManifoldHyperConnection(h, arch.mhc, eps, fused)
        self.mlp_norm = RMSNorm(h, eps, multiply_in_float32=True)
        self.moe = DeepseekV4Moe(h, arch.moe, arch.vocab_size, layer_idx in arch.moe.hash_layers, arch.hidden_act,
                                 switches, arch.swiglu_limit, fused)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ropes: dict[str, InterleavedRope]) -> torch.Tensor:  # [T, S, H] -> same
        post, comb, h = self.attn_hc(x)
        rope = ropes["main" if self.kind == "sliding" else "compress"]
        x = self.attn_hc.expand(x, self.attn(self.attn_norm(h), cache, meta, rope, ropes["compress"]), post, comb)
        post, comb, h = self.mlp_hc(x)
        return self.mlp_hc.expand(x, self.moe(self.mlp_norm(h), token_ids), post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    """forward's `caches` holds one (raw rows, entry shares) pair of paged tensors per layer (helios.runner.kv_cache;
    helios.layers.compressed_attention says what they hold)."""

    def __init__(self, arch: Architecture, backend: AttentionBackend, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype | None = None, switches: Switches = DEFAULT_SWITCHES, norms_folded: bool = False):
        super().__init__()
        c = arch.compressed
        if c is None or arch.mhc is None or arch.moe is None or arch.num_kv_heads != 1:
            raise ValueError("a deepseek_v4 architecture has compressed attention with one K=V head (arch.compressed),"
                             " mHC streams (arch.mhc) and experts in every layer (arch.moe)")
        if arch.moe.dense_layers or arch.moe.scoring not in ("sigmoid", "sqrtsoftplus"):
            raise ValueError("deepseek_v4's MoE has no dense layers and a sigmoid or sqrtsoftplus router")
        self.arch = arch
        self.switches = switches
        self.path = "eager"
        self.num_streams = arch.mhc.num_streams
        self.ropes = {
            "main": InterleavedRope(c.rope_dim, arch.rope_theta, None, arch.max_position_embeddings, device),
            "compress": InterleavedRope(c.rope_dim, c.compress_rope_theta, c.compress_rope_scaling,
                                        arch.max_position_embeddings, device),
        }
        # the ropes' frequencies where helios.layers.rotary.tabulate_rope finds them: the runner tabulates them once,
        # and a decode step's rope launches read the table (no cos/sin launches)
        self.main_rotary, self.compress_rotary = self.ropes["main"].rotary, self.ropes["compress"].rotary
        self.embed = Embedding(arch.vocab_size, arch.hidden_size)
        fused = getattr(backend, "fuses_layers", False)  # the Triton backend: the MoE's, attention's and mHC's kernels
        self.layers = nn.ModuleList(DeepseekV4Layer(arch, i, switches, fused, backend)
                                    for i in range(arch.num_layers))
        self.hc_head = HyperHead(arch.hidden_size, self.num_streams, arch.rms_norm_eps, arch.mhc.eps, fused)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, multiply_in_float32=True)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size,
                                                                    switches=switches)

    @staticmethod
    def folds_norm_weights(arch: Architecture) -> bool:
        return False

    def forward(self, token_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:  # [T, H]
        x = self.embed(token_ids)[:, None, :].repeat(1, self.num_streams, 1)  # [T, S, H]
        for layer, cache in zip(self.layers, caches):
            x = layer(x, token_ids, cache, meta, self.ropes)
        return self.norm(self.hc_head(x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, None, self.switches)
