"""Sparse mixture of experts, forward-only: softmax top-k routing (qwen3-moe style, SparseMoe) and DeepSeek-V3's
sigmoid group-limited routing with an ungated shared expert (SigmoidMoe; nemotron_h's relu2 experts too).

Experts are stacked tensors as the core stores them: gate_up [E, 2*Fm, H] (gate rows first) and
down [E, H, Fm]. The CPU path loops over the experts that received tokens, in HF's order, so the
result matches transformers' own loop to float32 rounding (the expert products go through
`helios.layers.linear`, whose CPU bits do not depend on the thread count). The fused (GPU) path runs
helios.kernels.fused_moe instead: routing, the sort by expert, grouped GEMMs and the combine on the device, with no
host sync (a decode step can be captured in a CUDA graph); a decode step's router logits (and a shared expert gate's)
come from one launch of helios.kernels.router (router_logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import Activation, MoeConfig
from helios.layers.activation import GatedMLP, gated
from helios.layers.linear import Linear, Stacked, linear
from helios.layers.norm import RMSNorm
from helios.switches import DEFAULT_SWITCHES, Switches

FUSED_ACTS = ("silu", "gelu_tanh", "relu2")  # the expert activations helios.kernels.fused_moe computes


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] (logits dtype), expert ids [T, k] int64
    """Softmax in float32 over all experts, keep the top k, optionally renormalize them to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class RoutedMoe(nn.Module):
    """A routed MoE block: `fused` picks the Triton path (helios.kernels.fused_moe) over the torch expert loop."""

    fused: bool = False
    # the decode rows' router logits through helios.kernels.router (on the fused path); HELIOS_GEMV=off: cuBLAS for
    # one-row products, the router's too
    hand_gemv: bool = True
    # the moe_prefill switch: prompt-sized batches' expert GEMMs through torch's grouped GEMM (helios.kernels.moe_grouped)
    grouped_prefill: bool = False
    one_token: str = "dot"  # the moe_decode switch: a single token's expert GEMMs (fused_moe.expert_outputs)

    def expert_outputs(self, x: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor, w_down: torch.Tensor,
                       limit: float | None = None, clamp_after_act: bool = False, alpha: float | None = None,
                       shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> torch.Tensor:  # [T, W], [T, k] -> [T*k (+ T with shared), W]
        """The fused path's routed products (fused_moe.expert_outputs' layout): through torch's grouped GEMM where
        the switch asks for it and moe_grouped serves the batch, else fused_moe's Triton GEMMs. shared: a shared
        expert's weights that shared_slot found fit to ride in those launches (rows T*k + t)."""
        from helios.kernels import fused_moe, moe_grouped

        x = x.contiguous()
        if shared is None and self.grouped_prefill and moe_grouped.grouped_serves(x, w_in, w_down, experts.numel()):
            return moe_grouped.expert_outputs_grouped(x, experts, w_in, w_down, self.act, limit, clamp_after_act,
                                                      alpha)
        return fused_moe.expert_outputs(x, experts, w_in, w_down, self.act, limit, clamp_after_act, alpha,
                                        one_token=self.one_token, shared=shared)

    def shared_slot(self, shared: nn.Module | None, x: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor,
                    w_down: torch.Tensor, limit: float | None = None, clamp_after_act: bool = False,
                    alpha: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared expert's (w_in, w_down) when it may ride in the routed experts' two launches (fused path,
        decode-sized batches: fused_moe.shared_slot_serves): the routed experts' activation and clamps, their
        shapes; else None (the shared MLP runs on its own)."""
        from helios.kernels import fused_moe, moe_grouped

        if isinstance(shared, GatedMLP) and self.act != "relu2":
            if (shared.act, shared.limit, shared.clamp_after_act, shared.alpha) != (self.act, limit, clamp_after_act,
                                                                                   alpha):
                return None
            pair = (shared.gate_up.weight, shared.down.weight)
        elif isinstance(shared, Relu2MLP) and self.act == "relu2":
            pair = (shared.up.weight, shared.down.weight)
        else:
            return None
        if self.grouped_prefill and moe_grouped.grouped_serves(x, w_in, w_down, experts.numel()):
            return None
        if not fused_moe.shared_slot_serves(experts.numel(), self.one_token, experts.shape[0], w_in, w_down, *pair):
            return None
        return pair

    def combine_fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w_in: torch.Tensor,
                      w_down: torch.Tensor, shared: nn.Module | None = None, shared_gate: torch.Tensor | None = None,
                      limit: float | None = None, clamp_after_act: bool = False, alpha: float | None = None,
                      then_norm: tuple[torch.Tensor, RMSNorm] | None = None,
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, W]; with then_norm (norm, stream)
        """The routed experts' products and their weighted sum (fused_moe.moe_combine), plus `shared`'s output of
        x (times sigmoid(shared_gate) when given) in the same combine launch; the shared expert's products ride in
        the experts' launches where shared_slot admits them, else its MLP runs first. then_norm (residual, the next
        norm): the combine launch also adds the output to the stream and norms it (RMSNorm.forward_add's values)."""
        from helios.kernels import fused_moe

        after = None
        if then_norm is not None:
            residual, norm = then_norm
            assert norm.weight is not None and not norm.scale_first, "the combine takes weighted norms only"
            after = fused_moe.ThenNorm(residual, norm.weight, norm.eps, norm.multiply_in_float32)
        pair = self.shared_slot(shared, x, experts, w_in, w_down, limit, clamp_after_act, alpha)
        y = self.expert_outputs(x, experts, w_in, w_down, limit, clamp_after_act, alpha, shared=pair)
        if pair is not None:
            n = experts.numel()
            return fused_moe.moe_combine(y[:n], weights, experts, y[n:], shared_gate, then_norm=after)
        return fused_moe.moe_combine(y, weights, experts, None if shared is None else shared(x), shared_gate,
                                     then_norm=after)

    @property
    def takes_then_norm(self) -> bool:
        """Whether forward(x, then_norm=...) takes the next norm into its combine launch (chain_moe_norms)."""
        return self.fused

    @property
    def decode_graph_safe(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph (helios.runner.cuda_graphs): the fused path keeps
        routing and the sort by expert on the device in fixed-size buffers; the torch loop reads the experts hit
        on the host."""
        return self.fused


class SparseMoe(RoutedMoe):
    """Tensors bound: router.weight [E, H], gate_up.weight [E, 2*Fm, H], down.weight [E, H, Fm].
    fused: the Triton path (the backend's fuses_layers)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        moe_intermediate_size: int,
        top_k: int,
        norm_topk_prob: bool,
        act: Activation = "silu",
        switches: Switches = DEFAULT_SWITCHES,
        fused: bool = False,
    ):
        super().__init__()
        self.fused = fused and act in FUSED_ACTS
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = act
        self.router = Linear(hidden_size, num_experts, switches=switches)
        self.hand_gemv = switches.gemv != "off"
        self.grouped_prefill = switches.moe_prefill == "grouped"
        self.one_token = switches.moe_decode
        self.gate_up = Stacked(num_experts, 2 * moe_intermediate_size, hidden_size)
        self.down = Stacked(num_experts, hidden_size, moe_intermediate_size)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None,
                then_norm: tuple[torch.Tensor, RMSNorm] | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        """router_input [T, H]: what the router reads when it is not x (gemma4 routes the un-normed stream).
        then_norm (residual, the next norm; fused path only): returns (norm(residual + out), residual + out)."""
        if self.fused:
            weights, experts, _ = self.route_fused(x if router_input is None else router_input)
            return self._forward_fused(x, weights, experts, then_norm=then_norm)
        assert then_norm is None, "the torch path takes no next norm"
        logits = self.router(x if router_input is None else router_input)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        out = torch.zeros_like(x)
        # [E, k, T] one-hot of assignments; only experts with at least one token run
        assignment = F.one_hot(experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = (assignment.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            slot, token = torch.where(assignment[e])
            # `linear`: on the CPU its bits do not depend on the thread count (helios.layers.linear)
            h = gated(linear(x[token], self.gate_up.weight[e]), self.act)
            h = linear(h, self.down.weight[e]) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        return out

    def router_logits(self, x: torch.Tensor, shared_gate: Linear | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T, E], [T, 1] (None without shared_gate)
        """The router's logits and a shared expert gate's, in the router's dtype as its projection rounds them: on the
        fused path, decode rows take one launch for both (helios.kernels.router); else the two projections."""
        if self.fused and self.hand_gemv:
            from helios.kernels import router

            gate = None if shared_gate is None else shared_gate.weight
            if (router.router_serves(x, self.router.weight)
                    and (gate is None or (gate.dtype == self.router.weight.dtype and gate.stride(-1) == 1))):
                return router.router_logits(x, self.router.weight, gate, out_dtype=x.dtype)
        return self.router(x), (None if shared_gate is None else shared_gate(x))

    def route_fused(self, x: torch.Tensor, shared_gate: Linear | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # weights [T, k], ids [T, k], gate
        """route's choice and weights (rounded to the logits' dtype, as route returns them) on the fused path, and a
        shared expert gate's logit [T, 1] (None without shared_gate): decode rows in one launch for the router's and
        the gate's products and the routing (helios.kernels.router with a Routing), else the router's launch(es)
        then fused_moe.moe_route's."""
        from helios.kernels import fused_moe, router

        if self.hand_gemv:
            gate = None if shared_gate is None else shared_gate.weight
            if (router.router_serves(x, self.router.weight)
                    and (gate is None or (gate.dtype == self.router.weight.dtype and gate.stride(-1) == 1))):
                routing = router.Routing(self.top_k, renorm=self.norm_topk_prob, weights_dtype=x.dtype)
                _, gate_logit, weights, experts = router.router_logits(x, self.router.weight, gate, out_dtype=x.dtype,
                                                                       routing=routing)
                return weights, experts, gate_logit
        logits, gate_logit = self.router_logits(x, shared_gate)
        weights, experts = fused_moe.moe_route(logits, self.top_k, renorm=self.norm_topk_prob,
                                               weights_dtype=logits.dtype)
        return weights, experts, gate_logit

    def _forward_fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                       shared: nn.Module | None = None, shared_gate: torch.Tensor | None = None,
                       then_norm: tuple[torch.Tensor, RMSNorm] | None = None):  # [T, H] -> [T, H]
        """route_fused's choice: the experts' products and their weighted sum (float32) on the device; a shared
        expert's output (scaled by sigmoid(shared_gate)) added by the same combine launch, and then_norm's add and
        norm (combine_fused)."""
        return self.combine_fused(x, weights, experts, self.gate_up.weight, self.down.weight, shared, shared_gate,
                                  then_norm=then_norm)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2, HF's ReLUSquaredActivation (exact elementwise ops: the same bits at every offset)."""
    return torch.square(F.relu(x))


class Relu2MLP(nn.Module):
    """down(relu(up x)^2), non-gated (nemotron_h's MLP and shared expert): up.weight [F, H], down.weight [H, F]."""

    def __init__(self, hidden_size: int, intermediate_size: int, switches: Switches = DEFAULT_SWITCHES):
        super().__init__()
        self.up = Linear(hidden_size, intermediate_size, switches=switches)
        self.down = Linear(intermediate_size, hidden_size, switches=switches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down(relu2(self.up(x)))


def router_scores(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:  # [T, E] -> [T, E] float32
    """sigmoid, or sqrt(softplus) (deepseek_v4's sqrtsoftplus: softplus returns x past 20, as F.softplus), of the
    float32 logits, written as plain elementwise ops (see route_sigmoid's NOTE)."""
    x = router_logits.float()
    if scoring == "sqrtsoftplus":
        return torch.where(x > 20.0, x, torch.log1p(torch.exp(x))).sqrt()
    return 1.0 / (1.0 + torch.exp(-x))


def route_sigmoid(
    router_logits: torch.Tensor,  # [T, E] float32
    top_k: int,
    score_bias: torch.Tensor | None,  # [E], added to the scores for the choice only
    num_groups: int,
    num_topk_groups: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k] int64
    """DeepSeek-V3's router (noaux_tc; nemotron_h, kimi): sigmoid scores; the choice ranks scores + bias within the
    num_topk_groups best groups (a group ranks by the sum of its two best biased scores); the weights are the chosen
    unbiased scores, renormalised (sum + 1e-20) with norm_topk_prob, times routed_scaling_factor. As
    DeepseekV3TopkRouter / NemotronHTopkRouter compute it, in float32."""
    # NOTE: 1 / (1 + exp(-x)), not torch.sigmoid, whose CPU SIMD body and scalar tail may differ in the last bit:
    # a token's scores would then depend on its row's offset in the batch (helios.layers.recurrent says more)
    scores = router_scores(router_logits, scoring)
    choice = scores if score_bias is None else scores + score_bias.float()
    if num_groups > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best = torch.topk(group_scores, k=num_topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, experts


class _Router(nn.Module):
    """weight [E, H] and, with a score bias, bias [E]: the choice's bias, never added to the logits. Bound in
    float32 whatever the core's dtype (bind_float32): the logits are a float32 product (HF keeps its gate in float32),
    so a 16-bit weight would be converted on every forward (a copy of the whole table, a launch on the GPU)."""

    bind_float32 = True

    def __init__(self, hidden_size: int, num_experts: int, score_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device="meta"), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(num_experts, device="meta"), requires_grad=False) if score_bias
                     else None)


class SigmoidMoe(RoutedMoe):
    """Routed experts behind the sigmoid router (route_sigmoid) plus an ungated shared expert every token takes
    (deepseek_v3 style; nemotron_h with non-gated relu2 experts and optional latent projections; muse_spark with
    normed latents and no shared expert).

    Tensors bound: router.weight [E, H] (+ router.bias [E] with score_bias); latent_in.weight [L, H] and
    latent_out.weight [H, L] with latent_size, latent_norm.weight [L] and expert_norm.weight [L] with latent_norms;
    experts gate_up.weight [E, 2*Fm, W] (gated act) or up.weight [E, Fm, W] (relu2), down.weight [E, W, Fm] (W = L
    or H); the shared expert shared.* (a GatedMLP's or a Relu2MLP's tensors, width Fs; none when Fs is 0).
    fused: the Triton path for routing and the routed experts (the backend's fuses_layers).
    """

    def __init__(self, hidden_size: int, moe: MoeConfig, act: Activation, switches: Switches = DEFAULT_SWITCHES,
                 limit: float | None = None, clamp_after_act: bool = False,
                 norm_eps: tuple[float, float] = (1e-6, 1e-6), alpha: float | None = None, fused: bool = False):
        """limit: the gated experts' (and the shared expert's) SwiGLU clamp (arch.swiglu_limit), None for none;
        alpha: their SwiGLU-OAI gain (arch.swiglu_alpha, minimax_m3; helios.layers.activation.gated), None for none;
        clamp_after_act: the clamp applies to act(gate), not gate (step3p7; helios.layers.activation.gated);
        norm_eps: with moe.latent_norms, the latent norm's and the expert norm's epsilons."""
        super().__init__()
        if moe.scoring not in ("sigmoid", "sqrtsoftplus") or moe.shared_expert_gate:
            raise ValueError("SigmoidMoe takes a sigmoid (or sqrtsoftplus) router and an ungated shared expert")
        self.moe = moe
        self.fused = fused and act in FUSED_ACTS
        self.act = act
        self.limit = limit
        self.clamp_after_act = clamp_after_act
        self.alpha = alpha
        width = moe.latent_size or hidden_size
        self.router = _Router(hidden_size, moe.num_experts, moe.score_bias)
        self.hand_gemv = switches.gemv != "off"
        self.grouped_prefill = switches.moe_prefill == "grouped"
        self.one_token = switches.moe_decode
        if moe.latent_size:
            self.latent_in = Linear(hidden_size, width, switches=switches)
            self.latent_out = Linear(width, hidden_size, switches=switches)
        if act == "relu2":
            self.up = Stacked(moe.num_experts, moe.moe_intermediate_size, width)
        else:
            self.gate_up = Stacked(moe.num_experts, 2 * moe.moe_intermediate_size, width)
        self.down = Stacked(moe.num_experts, width, moe.moe_intermediate_size)
        if moe.latent_norms:  # muse_spark: centred (1 + w stored) before the experts, input-scaled after each
            self.latent_norm = RMSNorm(width, norm_eps[0], multiply_in_float32=True)
            self.expert_norm = RMSNorm(width, norm_eps[1], scale_first=True)
        fs = moe.shared_expert_intermediate_size
        self.shared = None if not fs else (Relu2MLP(hidden_size, fs, switches) if act == "relu2"
                                           else GatedMLP(hidden_size, fs, act, switches=switches, limit=limit,
                                                         clamp_after_act=clamp_after_act, alpha=alpha))

    @property
    def takes_then_norm(self) -> bool:
        """The combine launch ends the block (no latent projection or norm after the experts)."""
        return self.fused and not self.moe.latent_size and not self.moe.latent_norms

    def forward(self, x: torch.Tensor, then_norm: tuple[torch.Tensor, RMSNorm] | None = None):  # [T, H] -> [T, H]
        """then_norm (residual, the next norm; takes_then_norm): (norm(residual + out), residual + out) from the
        combine launch (RoutedMoe.combine_fused)."""
        m = self.moe
        assert then_norm is None or self.takes_then_norm, "this block's output is not its combine's"
        if self.fused:
            weights, experts = self.route_x_fused(x)
        else:
            weights, experts = route_sigmoid(self.router_logits(x), m.num_experts_per_tok, self.router.bias,
                                             m.num_groups, m.num_topk_groups, m.norm_topk_prob,
                                             m.routed_scaling_factor, m.scoring)
        h = self.latent_in(x) if m.latent_size else x
        if m.latent_norms:
            h = self.latent_norm(h)
        if self.fused and (then_norm is not None or (self.shared is not None and not m.latent_size)):
            return self._experts_fused(h, weights, experts, self.shared, x, then_norm)  # the shared add rides too
        routed = self._experts(h, weights, experts)
        if m.latent_size:
            routed = self.latent_out(routed)
        return routed if self.shared is None else routed + self.shared(x)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] float32
        """float32 logits, as HF keeps its gate in float32 (a 16-bit core's router weight is rounded, HF's is not): on
        the fused path, decode rows in one launch (helios.kernels.router: no float32 copy of x, the same products
        summed in float32); else x.float() times the table."""
        if self.fused and self.hand_gemv:
            from helios.kernels import router

            if router.router_serves(x, self.router.weight):
                return router.router_logits(x, self.router.weight)[0]
        return linear(x.float(), self.router.weight.float())

    def route_x_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, ids
        """route_sigmoid of x's router logits on the fused path: decode rows in the router's one launch
        (helios.kernels.router with a Routing: the logits' product and the routing), else router_logits then
        _route_fused."""
        from helios.kernels import router

        m = self.moe
        if self.hand_gemv and router.router_serves(x, self.router.weight):
            routing = router.Routing(m.num_experts_per_tok, m.scoring, self.router.bias, m.num_groups,
                                     m.num_topk_groups, m.norm_topk_prob, m.routed_scaling_factor)
            return router.router_logits(x, self.router.weight, routing=routing)[2:]
        return self._route_fused(self.router_logits(x), m.num_experts_per_tok, self.router.bias, m.num_groups,
                                 m.num_topk_groups, m.norm_topk_prob, m.routed_scaling_factor, m.scoring)

    @staticmethod
    def _route_fused(logits: torch.Tensor, top_k: int, score_bias: torch.Tensor | None, num_groups: int,
                     num_topk_groups: int, norm_topk_prob: bool, routed_scaling_factor: float,
                     scoring: str) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, ids [T, k] int32
        """route_sigmoid in one launch (helios.kernels.fused_moe.moe_route)."""
        from helios.kernels import fused_moe

        return fused_moe.moe_route(logits, top_k, scoring, score_bias, num_groups, num_topk_groups, norm_topk_prob,
                                   routed_scaling_factor)

    @staticmethod
    def _route_given_fused(logits: torch.Tensor, given_ids: torch.Tensor, scoring: str,
                           routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:  # as _route_fused
        """The scores at given expert ids (a hash-routed layer's table row per token), renormalised and scaled, in
        one launch (helios.kernels.fused_moe.moe_route's given_ids)."""
        from helios.kernels import fused_moe

        return fused_moe.moe_route(logits, given_ids.shape[-1], scoring, renorm=True, scaling=routed_scaling_factor,
                                   given_ids=given_ids)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:  # [T, W]
        """Each expert that received tokens, in expert order (HF's loop), its product scaled by the float32
        weight and added in x's dtype; on the fused path the grouped GEMMs and a float32 weighted sum."""
        if self.fused:
            return self._experts_fused(x, weights, experts)
        out = torch.zeros_like(x)
        assignment = F.one_hot(experts, num_classes=self.moe.num_experts).permute(2, 1, 0)  # [E, k, T]
        hit = (assignment.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            slot, token = torch.where(assignment[e])
            out.index_add_(0, token, (self._expert(x[token], e) * weights[token, slot, None]).to(out.dtype))
        return out

    def _expert(self, rows: torch.Tensor, e: int) -> torch.Tensor:  # [n, W] -> [n, W]
        """Expert e's output for the rows routed to it, before their routing weights (e: a row of the bound
        stacks; helios.layers.parallel's expert-parallel layer binds only its rank's)."""
        if self.act == "relu2":
            h = relu2(linear(rows, self.up.weight[e]))
        else:
            h = gated(linear(rows, self.gate_up.weight[e]), self.act, self.limit, self.clamp_after_act,
                      alpha=self.alpha)
        h = linear(h, self.down.weight[e])
        return self.expert_norm(h) if self.moe.latent_norms else h

    def _experts_fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                       shared: nn.Module | None = None, shared_x: torch.Tensor | None = None,
                       then_norm: tuple[torch.Tensor, RMSNorm] | None = None,
                       ):  # [T, W]: the combine adds shared(shared_x) (x when None); then_norm: combine_fused's
        from helios.kernels import fused_moe

        w_in = self.up.weight if self.act == "relu2" else self.gate_up.weight
        if not self.moe.latent_norms and (shared_x is None or shared_x is x):
            return self.combine_fused(x, weights, experts, w_in, self.down.weight, shared, None, self.limit,
                                      self.clamp_after_act, self.alpha, then_norm=then_norm)
        assert then_norm is None, "a next norm needs the combine to end the block"
        y = self.expert_outputs(x, experts, w_in, self.down.weight, self.limit, self.clamp_after_act,
                                self.alpha)  # [T*k, W]
        if self.moe.latent_norms:  # each expert's output is normed before its weight applies
            y = self.expert_norm(y)
        return fused_moe.moe_combine(y, weights, experts,
                                     None if shared is None else shared(x if shared_x is None else shared_x))


def chain_moe_norms(layers, final_norm: RMSNorm, ffn_of) -> None:
    """On the fused path, each pre-norm layer whose feed-forward `ffn_of(layer)` takes a next norm (a fused MoE
    block whose combine ends it: takes_then_norm) hands that launch the next norm (the next layer's attn_norm, the
    last layer the model's final norm), and marks the next layer's input normed: the stream's add and that norm
    leave their own launch (RMSNorm.forward_add's values, helios.kernels.fused_moe.moe_combine's then_norm).
    Each layer reads `norms_output` (the norm its MoE takes, or None) and `input_normed` in its forward_fused;
    helios.layers.norm.pre_norm_stack skips the final norm the last layer took."""
    for i, layer in enumerate(layers):
        ffn = ffn_of(layer)
        if not getattr(ffn, "takes_then_norm", False):
            continue
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        norm = nxt.attn_norm if nxt is not None else final_norm
        if norm.weight is None or norm.scale_first:
            continue
        # a plain reference, not a submodule: the norm's weight stays bound (and named) where it is
        object.__setattr__(layer, "norms_output", norm)
        if nxt is not None:
            nxt.input_normed = True
