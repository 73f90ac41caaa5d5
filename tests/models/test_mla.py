"""Multi-head latent attention (helios.layers.mla) alone: the layer over a paged latent cache against HF's own MLA
modules (kimi_linear's NoPE KimiLinearAttention; deepseek_v3's DeepseekV3Attention with a q latent and rope) through
chunked prefill and decode steps; the absorbed decode form against the expanded one; the latent pool's memory per
token and the host/disk tiers' page copies of latent layers."""

from __future__ import annotations

import warnings

import pytest
import torch

from helios.core.manifest import Architecture, MlaConfig
from helios.layers.attention import AttentionMetadata
from helios.layers.mla import MlaAttention, mla_absorbed, mla_expanded
from helios.layers.rotary import RotaryEmbedding
from helios.runner.disk_cache import DiskKVStore
from helios.runner.host_cache import HostKVStore
from helios.runner.kv_cache import KVCache

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla, when installed, warns that Triton has no CPU driver
    from transformers import DeepseekV3Config, KimiLinearConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

PAGE, NUM_PAGES, HIDDEN, HEADS = 4, 40, 64, 4
MLA_DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def kimi_mla() -> KimiLinearAttention:
    config = KimiLinearConfig(vocab_size=512, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              num_hidden_layers=4, q_lora_rank=None, intermediate_size=128, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_token=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              **MLA_DIMS)
    config._attn_implementation = "eager"
    return _randomised(KimiLinearAttention(config, layer_idx=3))


def deepseek_mla() -> DeepseekV3Attention:
    config = DeepseekV3Config(vocab_size=512, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              num_hidden_layers=2, q_lora_rank=32, rope_interleave=False, **MLA_DIMS)
    config._attn_implementation = "eager"
    return _randomised(DeepseekV3Attention(config, layer_idx=0))


def _randomised(module):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return module.eval()


def mla_config(hf, scale: float) -> MlaConfig:
    return MlaConfig(q_lora_rank=hf.q_lora_rank, softmax_scale=scale, **MLA_DIMS)


def helios_mla(hf) -> MlaAttention:
    """Our layer bound to the HF module's weights as ignition lays them out (helios/core/layout.py)."""
    config = mla_config(hf, hf.scaling)
    layer = MlaAttention(HIDDEN, HEADS, config)
    q = hf.q_proj.weight if hf.q_lora_rank is None else hf.q_a_proj.weight
    tensors = {"in_proj.weight": torch.cat([q, hf.kv_a_proj_with_mqa.weight]),
               "kv_a_norm.weight": hf.kv_a_layernorm.weight, "kv_b.weight": hf.kv_b_proj.weight,
               "o.weight": hf.o_proj.weight}
    if hf.q_lora_rank is not None:
        tensors |= {"q_a_norm.weight": hf.q_a_layernorm.weight, "q_b.weight": hf.q_b_proj.weight}
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        layer.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(t.detach().clone(), requires_grad=False)
    return layer


def step_meta(tables: list[list[int]], chunks: list[tuple[int, int, int]]) -> AttentionMetadata:
    """One step's metadata: chunks (sequence, first position, end position) in batch order."""
    positions, slots, qsl, lens = [], [], [0], []
    for seq, start, end in chunks:
        positions += range(start, end)
        slots += [tables[seq][p // PAGE] * PAGE + p % PAGE for p in range(start, end)]
        qsl.append(qsl[-1] + end - start)
        lens.append(end)
    block_tables = torch.zeros(len(chunks), max(len(t) for t in tables), dtype=torch.int32)
    for row, (seq, _, _) in enumerate(chunks):
        block_tables[row, : len(tables[seq])] = torch.tensor(tables[seq])
    return AttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=block_tables,
                             query_start_loc_cpu=qsl, seq_lens_cpu=lens)


def causal_mask(n: int) -> torch.Tensor:  # [1, 1, n, n] additive
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


# two sequences through three steps: prefill chunks side by side, a continuation chunk beside a decode, two decodes
LENGTHS = (23, 11)
STEPS = [[(0, 0, 13), (1, 0, 9)], [(0, 13, 21), (1, 9, 10)], [(1, 10, 11), (0, 21, 22)], [(0, 22, 23)]]


@pytest.mark.parametrize("family", ["kimi_linear", "deepseek_v3"])
def test_layer_matches_hf_through_prefill_chunks_and_decodes(family):
    hf = kimi_mla() if family == "kimi_linear" else deepseek_mla()
    layer = helios_mla(hf)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in LENGTHS]
    pages = torch.randperm(NUM_PAGES, generator=gen).tolist()
    tables = [[pages.pop() for _ in range(-(-n // PAGE))] for n in LENGTHS]
    with torch.no_grad():
        refs = []
        for x in xs:
            n = x.shape[0]
            if family == "kimi_linear":
                refs.append(hf(x[None], causal_mask(n))[0][0])
            else:
                cos_sin = DeepseekV3RotaryEmbedding(hf.config)(x[None], torch.arange(n)[None])
                refs.append(hf(x[None], cos_sin, causal_mask(n))[0][0])
        rope = family == "deepseek_v3"
        rotary = RotaryEmbedding(MLA_DIMS["qk_rope_head_dim"], hf.config.rope_parameters["rope_theta"] if rope else 1.0)
        cache = torch.zeros(1, NUM_PAGES, PAGE, MLA_DIMS["kv_lora_rank"] + MLA_DIMS["qk_rope_head_dim"])
        for chunks in STEPS:
            meta = step_meta(tables, chunks)
            x = torch.cat([xs[seq][a:b] for seq, a, b in chunks])
            cos_sin = rotary.cos_sin(meta.positions, x.dtype) if rope else None
            out = layer(x, cache, meta, cos_sin)
            ref = torch.cat([refs[seq][a:b] for seq, a, b in chunks])
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_absorbed_form_equals_expanded(dtype):
    """The decode form (kv_b folded into q and applied after attention over the latent pages) against the prefill
    form (every latent up-projected to per-head K/V) for one query token of ragged sequences."""
    config = MlaConfig(softmax_scale=(16 + 8) ** -0.5, **MLA_DIMS)
    gen = torch.Generator().manual_seed(2)
    seq_lens = [1, 4, 7, 19, 12]
    pages = torch.randperm(NUM_PAGES, generator=gen).tolist()
    tables = [[pages.pop() for _ in range(-(-n // PAGE))] for n in seq_lens]
    cache = torch.randn(1, NUM_PAGES, PAGE, 24, generator=gen, dtype=dtype)
    kv_b = torch.randn(HEADS * 32, 16, generator=gen, dtype=dtype) / 4
    q = torch.randn(len(seq_lens), HEADS, 24, generator=gen, dtype=dtype)
    width = max(len(t) for t in tables)
    blocks = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables])
    allowed = torch.arange(width * PAGE)[None, :] < torch.tensor(seq_lens)[:, None]
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[:, None, :]
    absorbed = mla_absorbed(q, cache, blocks, bias, kv_b, config)
    for i, (t, n) in enumerate(zip(tables, seq_lens)):
        cached = cache[0, t].flatten(0, 1)[:n]
        expanded = mla_expanded(q[i : i + 1], cached, kv_b, config)[0]
        tolerance = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(absorbed[i], expanded, atol=tolerance, rtol=0)


def mla_arch(mla: MlaConfig | None, layer_types: list[str]) -> Architecture:
    return Architecture(family="kimi_linear", vocab_size=512, hidden_size=HIDDEN, intermediate_size=128,
                        num_layers=len(layer_types), num_heads=HEADS, num_kv_heads=HEADS, head_dim=24,
                        rms_norm_eps=1e-5, rope_theta=0.0, max_position_embeddings=512, tie_word_embeddings=False,
                        layer_types=layer_types, mla=mla, position_embedding="none")


def test_latent_pool_keeps_the_latent_and_rope_key_per_token():
    config = MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                       softmax_scale=192**-0.5)
    arch = mla_arch(config, ["linear", "full", "linear", "linear", "full"])  # two MLA layers among state layers
    kv = KVCache.from_arch(arch, num_pages=5, page_size=16, dtype=torch.bfloat16, device="cpu")
    assert len(kv.layers) == 2 and all(t.shape == (1, 5, 16, 512 + 64) for t in kv.layers)
    tokens = 5 * 16
    per_token = [t.numel() // tokens for t in kv.layers]
    assert per_token == [512 + 64] * 2 == [KVCache.values_per_token(arch)] * 2
    assert KVCache.bytes_per_page(arch, 16, torch.bfloat16) * 5 == sum(t.numel() * t.element_size() for t in kv.layers)
    # the expanded K/V this replaces: 2 * Nq * (dn + dr) values per token and layer
    plain = mla_arch(None, arch.layer_types)
    assert KVCache.values_per_token(plain) == 2 * HEADS * 24
    assert KVCache.bytes_per_page(plain, 16, torch.float32) == 2 * 16 * 2 * HEADS * 24 * 4


def test_host_and_disk_tiers_copy_latent_pages(tmp_path):
    """The tiers index pages on dim 1 of every layer, whatever its shape: latent layers, and a k/v layer beside."""
    kv = KVCache(num_layers=2, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8, latent_dim=24)
    kv.layers.append(torch.zeros(2, 6, 4, 2, 8))
    for layer in kv.layers:
        layer.copy_(torch.randn_like(layer))
    before = [layer.clone() for layer in kv.layers]
    store = HostKVStore(kv, num_slots=4)
    assert [t.shape for t in store.layers] == [(1, 4, 4, 24), (1, 4, 4, 24), (2, 4, 4, 2, 8)]
    store.copy_out(kv, [(1, 3), (2, 0), (4, 1)])
    disk = DiskKVStore(tmp_path, store)
    assert disk.record_bytes == (2 * 4 * 24 + 2 * 4 * 2 * 8) * 4
    disk.spill([(3, b"a" * 32)])
    for layer in store.layers:  # slot 3 comes back from its disk record
        layer[:, 3] = 0
    disk.load([(b"a" * 32, 3)])
    for layer in kv.layers:
        layer[:, [1, 2, 4]] = 0
    store.copy_in(kv, [(0, 5), (3, 0), (1, 2)])
    for old, new in zip(before, kv.layers):
        assert torch.equal(new[:, 5], old[:, 2]) and torch.equal(new[:, 0], old[:, 1])
        assert torch.equal(new[:, 2], old[:, 4]) and torch.equal(new[:, 3], old[:, 3])
        assert not new[:, [1, 4]].any()
