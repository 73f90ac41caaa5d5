"""Whole recurrent layers composed from helios.layers.recurrent's ops and plain matmuls of the HF layer's weights,
against the HF layer's own forward (no cache): qwen3_5's Qwen3_5GatedDeltaNet, nemotron_h's NemotronHMamba2Mixer,
kimi_linear's KimiLinearDeltaAttention, from the tiny configs of docs/families.md. Two prompts run whole in one step,
then in steps through slot states: a prefill split on the chunk grid beside the other prompt, then decodes. The
compositions are what a helios model's layer must compute (the model files are not tested here)."""

from __future__ import annotations

import warnings

import pytest
import torch

from helios.layers.recurrent import (
    causal_conv,
    gated_delta_gates,
    gated_delta_rule,
    kimi_delta_gates,
    kimi_delta_rule,
    mamba2_scan,
    rms_norm_gated,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla, when installed, warns that Triton has no CPU driver
    from transformers import KimiLinearConfig, NemotronHConfig, Qwen3_5TextConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

NUM_SLOTS = 12


def tiny_gdn() -> Qwen3_5GatedDeltaNet:
    config = Qwen3_5TextConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                               intermediate_size=128, num_hidden_layers=4)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    layer.dt_bias.normal_(0, 1)
    layer.norm.weight.normal_(1, 0.2)
    return layer


def gdn_layer(layer, x, conv_state, state, *batch):
    """Qwen3_5GatedDeltaNet: x [T, hidden] -> [T, hidden]."""
    num_tokens, dk, dv = x.shape[0], layer.head_k_dim, layer.head_v_dim
    qkv = causal_conv(x @ layer.in_proj_qkv.weight.t(), layer.conv1d.weight.squeeze(1), conv_state, *batch,
                      bias=layer.conv1d.bias, activation=layer.activation)
    q, k, v = qkv.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    g, beta = gated_delta_gates(x @ layer.in_proj_a.weight.t(), x @ layer.in_proj_b.weight.t(), layer.A_log,
                                layer.dt_bias)
    o = gated_delta_rule(q.view(num_tokens, -1, dk), k.view(num_tokens, -1, dk), v.view(num_tokens, -1, dv), g, beta,
                         state, *batch)
    z = x @ layer.in_proj_z.weight.t()
    o = rms_norm_gated(o.reshape(-1, dv), z.reshape(-1, dv), layer.norm.weight, layer.norm.variance_epsilon)
    return o.reshape(num_tokens, -1) @ layer.out_proj.weight.t()


def tiny_mamba2() -> NemotronHMamba2Mixer:
    config = NemotronHConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                             intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                             n_groups=2, conv_kernel=4, expand=2, chunk_size=8, n_routed_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)
    layer = NemotronHMamba2Mixer(config, layer_idx=0)
    layer.dt_bias.normal_(0, 1)
    layer.D.normal_(1, 0.5)
    layer.norm.weight.normal_(1, 0.2)
    return layer


def mamba2_layer(layer, x, conv_state, state, *batch):
    """NemotronHMamba2Mixer: x [T, hidden] -> [T, hidden]."""
    num_tokens, heads, groups, n = x.shape[0], layer.num_heads, layer.n_groups, layer.ssm_state_size
    inner = layer.intermediate_size
    z, xbc, dt = (x @ layer.in_proj.weight.t()).split([inner, layer.conv_dim, heads], dim=-1)
    xbc = causal_conv(xbc, layer.conv1d.weight.squeeze(1), conv_state, *batch, bias=layer.conv1d.bias,
                      activation=layer.activation)
    xs, b, c = xbc.split([inner, groups * n, groups * n], dim=-1)
    y = mamba2_scan(xs.view(num_tokens, heads, -1), dt, layer.A_log, b.view(num_tokens, groups, n),
                    c.view(num_tokens, groups, n), layer.D, layer.dt_bias, state, *batch, layer.chunk_size,
                    dt_limit=layer.time_step_limit)
    y = rms_norm_gated(y.reshape(num_tokens, inner), z, layer.norm.weight, layer.norm.variance_epsilon,
                       norm_before_gate=False, group_size=inner // groups)
    return y @ layer.out_proj.weight.t()


def tiny_kda() -> KimiLinearDeltaAttention:
    config = KimiLinearConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                              num_hidden_layers=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_token=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                                  "kda_layers": [1, 2, 3], "full_attn_layers": [4]})
    layer = KimiLinearDeltaAttention(config, layer_idx=0)
    gate = layer.forget_gate  # created with torch.empty: uninitialised memory
    gate.A_log.copy_(torch.rand(gate.A_log.shape) * 2 - 1)
    gate.dt_bias.normal_(0, 1)
    layer.o_norm.weight.normal_(1, 0.2)
    return layer


def kda_layer(layer, x, conv_state, state, *batch):
    """KimiLinearDeltaAttention: x [T, hidden] -> [T, hidden]."""
    num_tokens, heads, dk = x.shape[0], layer.num_heads, layer.head_dim
    qkv = torch.cat([x @ layer.q_proj.weight.t(), x @ layer.k_proj.weight.t(), x @ layer.v_proj.weight.t()], dim=-1)
    qkv = causal_conv(qkv, layer.conv1d.weight.squeeze(1), conv_state, *batch, bias=layer.conv1d.bias,
                      activation=layer.activation)
    q, k, v = (t.reshape(num_tokens, heads, dk) for t in qkv.split([layer.qkv_dim] * 3, dim=-1))
    gate = layer.forget_gate
    f = (x @ gate.f_a_proj.weight.t()) @ gate.f_b_proj.weight.t()
    g, beta = kimi_delta_gates(f, x @ layer.b_proj.weight.t(), gate.A_log, gate.dt_bias)
    o = kimi_delta_rule(q, k, v, g, beta, state, *batch)
    z = (x @ layer.g_a_proj.weight.t()) @ layer.g_b_proj.weight.t()
    o = rms_norm_gated(o.reshape(-1, dk), z.reshape(-1, dk), layer.o_norm.weight, layer.o_norm.variance_epsilon,
                       activation="sigmoid", multiply_in_float32=True)
    return o.reshape(num_tokens, -1) @ layer.o_proj.weight.t()


# family: (the HF layer, the composition, conv channels, state shape, a chunk-grid cut of the first prompt)
FAMILIES = {
    "qwen3_5": (tiny_gdn, gdn_layer, lambda m: m.conv_dim, (4, 16, 16), 64),
    "nemotron_h": (tiny_mamba2, mamba2_layer, lambda m: m.conv_dim, (8, 16, 16), 24),
    "kimi_linear": (tiny_kda, kda_layer, lambda m: m.conv_dim, (4, 16, 16), 64),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])  # bf16: ~2 ulps of the max
@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_layer_from_the_ops_matches_hf(family, dtype, tol):
    """Prompts of 101 and 32 tokens through HF's forward against the composition: whole in one step, then in
    steps A[0:cut] + B[0:30], A[cut:100] + B's decode, A's decode + B's decode, states in slots (NaN before)."""
    make, compose, conv_channels, state_shape, cut = FAMILIES[family]
    torch.manual_seed(0)
    layer = make().to(dtype).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randn(101, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g).to(dtype)]
    expected = [layer(p[None])[0] for p in prompts]
    scale = max(e.abs().max().item() for e in expected)
    kernel = layer.conv1d.kernel_size[0]
    conv_state = torch.full((NUM_SLOTS, kernel - 1, conv_channels(layer)), float("nan"), dtype=dtype)
    state = torch.full((NUM_SLOTS, *state_shape), float("nan"))
    slots = [7, 2]

    whole = compose(layer, torch.cat(prompts), conv_state, state, slots, [0, 101, 133], [0, 0])
    torch.testing.assert_close(whole, torch.cat(expected), atol=tol * scale, rtol=tol)

    got = [[], []]
    for step in [((0, cut), (0, 30)), ((cut, 100), (30, 31)), ((100, 101), (31, 32))]:
        x = torch.cat([p[a:b] for p, (a, b) in zip(prompts, step)])
        n = [b - a for a, b in step]
        out = compose(layer, x, conv_state, state, slots, [0, n[0], n[0] + n[1]], [a for a, _ in step])
        got[0].append(out[: n[0]])
        got[1].append(out[n[0] :])
    for rows, exp in zip(got, expected):
        torch.testing.assert_close(torch.cat(rows), exp, atol=tol * scale, rtol=tol)


def test_fla_cu_seqlens_are_derived_once_a_step_on_both_sides():
    """The recurrent layers' fla calls of one step share one (device, host) int64 query_start_loc pair (fla
    memoizes its chunk layout by their identity; the host side spares it a device sync); the next step's metadata
    makes its own (never a buffer rewritten in place)."""
    from helios.layers.attention import AttentionMetadata
    from helios.layers.linear_attention import fla_cu_seqlens

    def meta(qsl):
        t = torch.tensor(qsl, dtype=torch.int32)
        return AttentionMetadata(positions=torch.arange(qsl[-1]), slot_mapping=torch.arange(qsl[-1]),
                                 query_start_loc=t, seq_lens=t[1:] - t[:-1], block_tables=torch.zeros(2, 1),
                                 query_start_loc_cpu=list(qsl), seq_lens_cpu=[3, 5])

    step = meta([0, 3, 8])
    device_cu, host_cu = fla_cu_seqlens(step)
    assert fla_cu_seqlens(step)[0] is device_cu and fla_cu_seqlens(step)[1] is host_cu
    assert device_cu.dtype == host_cu.dtype == torch.int64 and host_cu.device.type == "cpu"
    assert device_cu.tolist() == host_cu.tolist() == [0, 3, 8]
    assert device_cu.data_ptr() != step.query_start_loc.data_ptr()
    assert fla_cu_seqlens(meta([0, 3, 8]))[0] is not device_cu
