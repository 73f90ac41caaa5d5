"""16-bit CPU projections packed for oneDNN at load (helios.layers.linear.pack_cpu_linears): the same bits as the
plain weights through F.linear, every Linear of a llama-family runner packed (a tied head through a packed copy of
the embedding), float32 runners untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helios.layers.linear import has_onednn_packing, linear, pack_cpu_weight
from helios.models.llama import LlamaForCausalLM
from helios.runner.model_runner import ModelRunner
from tests.models.test_parity import export_tiny, prompt

pytestmark = pytest.mark.skipif(not has_onednn_packing(torch.bfloat16), reason="oneDNN cannot pack bf16 here")


def test_packed_linear_gives_f_linear_bits():
    g = torch.Generator().manual_seed(0)
    for n, k in ((96, 64), (64, 160), (300, 64)):
        w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
        packed = pack_cpu_weight(w)
        assert packed.is_mkldnn and tuple(packed.shape) == (n, k)
        for rows in (1, 3, 8, 37):
            x = torch.randn(rows, k, generator=g).bfloat16()
            for bias in (None, b):
                assert torch.equal(linear(x, packed, bias), F.linear(x, w, bias)), (n, k, rows, bias is None)
    plain = torch.randn(8, 16)
    assert pack_cpu_weight(plain) is plain  # float32 stays plain (its oneDNN path takes the [out, in] weight)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied head, untied head with qkv biases
def test_bf16_runner_packs_and_keeps_its_logits(family, tmp_path, monkeypatch):
    _, core = export_tiny(family, tmp_path)
    ids = prompt()

    def runner(dtype: torch.dtype) -> ModelRunner:
        return ModelRunner(core.manifest.arch, core.tensors, num_pages=16, page_size=16, dtype=dtype)

    packed = runner(torch.bfloat16)
    linears = [m for m in packed.model.modules() if type(m).__name__ == "Linear"]
    assert linears and all(m.weight.is_mkldnn for m in linears)
    assert packed.model.lm_head is not None and packed.model.lm_head.weight.is_mkldnn
    got = packed.forward_logits(ids, chunk_size=7)
    monkeypatch.setattr(LlamaForCausalLM, "packs_cpu_linears", False)
    plain = runner(torch.bfloat16)
    assert not plain.model.layers[0].attn.qkv.weight.is_mkldnn
    assert torch.equal(got, plain.forward_logits(ids, chunk_size=7))
    monkeypatch.undo()
    full = runner(torch.float32)
    assert not any(p.is_mkldnn for p in full.model.parameters())
    assert (full.model.lm_head is None) == core.manifest.arch.tie_word_embeddings
