"""TritonAttentionBackend against helios.layers.attention.TorchAttentionBackend (the CPU path's semantics).

First the backend alone on mixed batches (prefill chunks, decode rows, pure decode), then whole tiny models
(llama with GQA 3, qwen3 with q/k norms, gemma3 with sliding layers and soft-capping; the Triton side
takes the fused layer kernels: residual + norm, norms + rotary + cache write, gated activation) stepped through prefill, chunked prefill
and decode with each backend over its own paged cache.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from helios.core.manifest import Architecture  # noqa: E402
from helios.engine.messages import ScheduledRequest  # noqa: E402
from helios.kernels.backend import TritonAttentionBackend  # noqa: E402
from helios.layers.attention import TorchAttentionBackend  # noqa: E402
from tests.kernels import checks  # noqa: E402


@pytest.mark.parametrize(
    "query_lens, seq_lens, window, softcap",
    [
        ([1, 1, 1], [37, 5, 70], None, None),  # pure decode: the split-K kernel
        ([1, 1, 1], [37, 5, 70], 16, 30.0),
        ([9, 1, 4], [9, 40, 23], None, None),  # prefill + decode + chunk: the varlen kernel
        ([9, 1, 4], [30, 40, 23], 6, 20.0),
    ],
)
def test_backend_matches_torch_backend(query_lens, seq_lens, window, softcap):
    checks.check_backend("cpu", torch.float32, query_lens, seq_lens, window, softcap)


def test_backend_pinned_decode_splits():
    checks.check_backend("cpu", torch.float32, [1, 1], [70, 3], decode_num_splits=4)


_SMALL = dict(vocab_size=97, intermediate_size=80, num_layers=2, num_kv_heads=2, max_position_embeddings=128)
ARCHS = {
    "llama_gqa3": Architecture(
        family="llama", hidden_size=96, num_heads=6, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
        tie_word_embeddings=True, **_SMALL,
    ),
    "qwen3_qk_norm": Architecture(
        family="qwen3", hidden_size=64, num_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, qk_norm=True, **_SMALL,
    ),
    "gemma3_sliding": Architecture(
        family="gemma3", hidden_size=64, num_heads=4, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, hidden_act="gelu_tanh", qk_norm=True, sandwich_norms=True, query_scale=0.2,
        sliding_window=4, rope_local_theta=1e4, layer_types=["sliding", "full"], attn_logit_softcapping=20.0,
        **_SMALL,
    ),
}


def _model(arch: Architecture, backend):
    """The family's module over `backend`, bound to random weights (norm weights near 1)."""
    from helios.models import bind_tensors
    from helios.models.gemma3 import Gemma3ForCausalLM
    from helios.models.llama import LlamaForCausalLM

    cls = {"llama": LlamaForCausalLM, "qwen3": LlamaForCausalLM, "gemma3": Gemma3ForCausalLM}[arch.family]
    model = cls(arch, backend, "cpu")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in model.named_parameters():
        t = torch.randn(tuple(p.shape), generator=g)
        tensors[name] = 1.0 + 0.1 * t if "norm" in name else 0.2 * t
    bind_tensors(model, tensors)
    return model.eval()


@pytest.mark.parametrize("name", list(ARCHS))
def test_model_steps_match_torch_backend(name):
    from helios.runner.input_batch import prepare_batch

    arch, page_size = ARCHS[name], 4
    models = {"torch": _model(arch, TorchAttentionBackend()), "triton": _model(arch, TritonAttentionBackend())}
    shape = (2, 16, page_size, arch.num_kv_heads, arch.head_dim)
    caches = {k: [torch.zeros(shape) for _ in range(arch.num_layers)] for k in models}
    a, b = list(range(3, 12)), list(range(20, 31))
    blocks_a, blocks_b = [7, 2, 9], [4, 11, 0, 13]

    def req(req_id, token_ids, num_computed, blocks, sample=True):
        return ScheduledRequest(
            req_id=req_id, token_ids=token_ids, num_computed_tokens=num_computed, block_ids=blocks, sample=sample
        )

    steps = [
        [req("a", a, 0, blocks_a), req("b", b[:5], 0, blocks_b, sample=False)],  # prefills (b chunked)
        [req("a", [40], 9, blocks_a), req("b", b[5:], 5, blocks_b)],  # decode mixed with a chunk at 5
        [req("a", [41], 10, blocks_a), req("b", [42], 11, blocks_b)],  # pure decode
    ]
    with torch.inference_mode():
        for scheduled in steps:
            batch = prepare_batch(scheduled, {}, page_size)
            hidden = {k: m.forward(batch.token_ids, batch.meta, caches[k]) for k, m in models.items()}
            torch.testing.assert_close(hidden["triton"], hidden["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_window_group_tables_are_read_only_inside_the_window(backend):
    """gemma3's sliding layer over a window group (helios/engine/kv_groups.py): its own smaller cache and tables
    whose entries before each sequence's window are -1 (page 0 in the metadata), as the engine leaves them. Page 0
    of that cache holds NaN for the Triton kernels (a masked lane loads nothing; any unmasked read shows) and huge
    values for the torch backend (whose decode gather pads with masked page-0 columns); the hidden states equal a
    one-group torch model's, step by step: prefill, decode beside a chunk, pure decode (decode_qkv on Triton)."""
    from helios.runner.input_batch import prepare_batch

    arch, page_size = ARCHS["gemma3_sliding"], 4
    window = arch.sliding_window
    ref_model = _model(arch, TorchAttentionBackend())
    model = _model(arch, TritonAttentionBackend() if backend == "triton" else TorchAttentionBackend())
    shape = (2, 16, page_size, arch.num_kv_heads, arch.head_dim)
    ref_caches = [torch.zeros(shape) for _ in range(arch.num_layers)]
    window_cache = torch.zeros(2, 8, page_size, arch.num_kv_heads, arch.head_dim)
    window_cache[:, 0] = float("nan") if backend == "triton" else 1e4
    caches = [window_cache, torch.zeros(shape)]  # layer 0 slides, layer 1 is full
    a, b = list(range(3, 12)), list(range(20, 31))
    blocks_a, blocks_b = [7, 2, 9], [4, 11, 0, 13]

    def req(req_id, token_ids, num_computed, blocks, window_blocks=None, sample=True):
        groups = [window_blocks] if window_blocks is not None else []
        return ScheduledRequest(req_id=req_id, token_ids=token_ids, num_computed_tokens=num_computed, block_ids=blocks,
                                group_block_ids=groups, sample=sample)

    steps = [  # (one group, window group): the window tables as the engine leaves them before each step
        ([req("a", a, 0, blocks_a), req("b", b[:5], 0, blocks_b, sample=False)],
         [req("a", a, 0, blocks_a, [3, 5, 1]), req("b", b[:5], 0, blocks_b, [6, 2, 4, 7], sample=False)]),
        ([req("a", [40], 9, blocks_a), req("b", b[5:], 5, blocks_b)],  # a's query at 9 sees 6..9: page 0 is out
         [req("a", [40], 9, blocks_a, [-1, 5, 1]), req("b", b[5:], 5, blocks_b, [6, 2, 4, 7])]),
        ([req("a", [41], 10, blocks_a), req("b", [42], 11, blocks_b)],  # b's query at 11 sees 8..11
         [req("a", [41], 10, blocks_a, [-1, 5, 1]), req("b", [42], 11, blocks_b, [-1, -1, 4, 7])]),
    ]
    with torch.inference_mode():
        for single, grouped in steps:
            ref_batch = prepare_batch(single, {}, page_size)
            batch = prepare_batch(grouped, {}, page_size, window=window)
            assert batch.meta.window_groups[window][0][0, 0] == (0 if grouped[0].num_computed_tokens else 3)
            want = ref_model.forward(ref_batch.token_ids, ref_batch.meta, ref_caches)
            got = model.forward(batch.token_ids, batch.meta, caches)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
