"""Parity of helios' models against HF transformers on tiny random checkpoints of every family.

The oracle path is the real one: tests/ignition/tiny_models.build_tiny saves an HF dir, ignition
exports it to a float32 core, helios.core.load maps it, and the ModelRunner runs it over the paged
KV cache (page_size 4, so every sequence spans pages). Greedy decoding here is argmax over the
runner's decode path, so it does not depend on the sampler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from helios.engine.messages import ScheduledRequest
from helios.runner.input_batch import prepare_batch
from helios.runner.model_runner import ModelRunner
from tests.ignition.tiny_models import build_tiny

PAGE_SIZE = 4
NUM_PAGES = 64
# gemma3 with a window of 4 (smaller than a prefill chunk) and a final soft-cap, so both matter
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {},
    "gemma3": {"sliding_window": 4, "final_logit_softcapping": 30.0},
}


def export_tiny(family: str, root: Path, **overrides):
    """(HF model, LoadedCore) of the family's tiny checkpoint, exported in float32."""
    from transformers import AutoModelForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_tiny(family, root / "hf", **overrides)
    core = load_core(export_core(src, root / "core", ExportOptions(dtype="float32", prompt_logprobs=True)))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return hf, core


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    family = request.param
    hf, core = export_tiny(family, tmp_path_factory.mktemp(family), **FAMILIES[family])
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=NUM_PAGES, page_size=PAGE_SIZE)
    return family, hf, runner


def prompt(n: int = 20, seed: int = 1) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:  # [T, V]
    return hf(torch.tensor([token_ids])).logits[0].float()


def run_step(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> torch.Tensor:
    """Logits [N, V] of the rows the step computes (sampling rows), via the runner's own path."""
    batch = prepare_batch(scheduled, {}, runner.page_size)
    with torch.inference_mode():
        hidden = runner.model.forward(batch.token_ids, batch.meta, runner.kv_cache.layers)
        return runner.model.compute_logits(hidden[batch.logits_indices]).float()


def test_last_position_logits(tiny):
    _, hf, runner = tiny
    ids = prompt()
    ours = runner.forward_logits(ids)
    assert ours.shape == (len(ids), runner.arch.vocab_size)
    torch.testing.assert_close(ours[-1], hf_logits(hf, ids)[-1], atol=1e-4, rtol=0)


def test_chunked_prefill_matches(tiny):
    _, hf, runner = tiny
    ids = prompt(22)
    whole = runner.forward_logits(ids)
    chunked = runner.forward_logits(ids, chunk_size=5)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_prompt_logprobs_match(tiny):
    _, hf, runner = tiny
    ids = prompt()
    ours = torch.log_softmax(runner.forward_logits(ids, chunk_size=5), dim=-1)
    torch.testing.assert_close(ours, torch.log_softmax(hf_logits(hf, ids), dim=-1), atol=1e-4, rtol=0)


def test_greedy_matches_generate(tiny):
    _, hf, runner = tiny
    ids, num_new = prompt(), 32
    blocks = list(range(NUM_PAGES))[::-3][: (len(ids) + num_new + PAGE_SIZE - 1) // PAGE_SIZE]
    # prefill in two chunks, then one decode step per token: the runner's whole paged path
    def scheduled(token_ids, num_computed, sample=True):
        return [ScheduledRequest(req_id="a", token_ids=token_ids, num_computed_tokens=num_computed,
                                 block_ids=blocks, sample=sample)]

    seq = list(ids)
    run_step(runner, scheduled(ids[:12], 0, sample=False))
    logits = run_step(runner, scheduled(ids[12:], 12))
    for _ in range(num_new):
        seq.append(int(logits[0].argmax()))
        logits = run_step(runner, scheduled(seq[-1:], len(seq) - 1))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0].tolist()
    assert seq[len(ids):] == ref[len(ids):]


def test_batched_equals_alone(tiny):
    _, _, runner = tiny
    a, b = prompt(17, seed=2), prompt(6, seed=3)
    alone_a, alone_b = runner.forward_logits(a), runner.forward_logits(b)
    # both prefills in one step, every position sampled-or-not; block tables interleaved across the pool
    blocks_a, blocks_b = [9, 2, 11, 4, 13], [0, 7]
    batch = [
        ScheduledRequest(req_id="a", token_ids=a, num_computed_tokens=0, block_ids=blocks_a, sample=False),
        ScheduledRequest(req_id="b", token_ids=b, num_computed_tokens=0, block_ids=blocks_b, sample=False),
    ]
    pb = prepare_batch(batch, {}, runner.page_size)
    with torch.inference_mode():
        hidden = runner.model.forward(pb.token_ids, pb.meta, runner.kv_cache.layers)
        logits = runner.model.compute_logits(hidden).float()
    torch.testing.assert_close(logits[: len(a)], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[len(a) :], alone_b, atol=1e-5, rtol=0)
    # then a decode of a beside a chunk of a fresh c: decode rows see only their own pages
    c = prompt(9, seed=4)
    nxt = int(alone_a[-1].argmax())
    mixed = [
        ScheduledRequest(req_id="a", token_ids=[nxt], num_computed_tokens=len(a), block_ids=blocks_a, sample=True),
        ScheduledRequest(req_id="c", token_ids=c, num_computed_tokens=0, block_ids=[20, 21, 22], sample=True),
    ]
    got = run_step(runner, mixed)
    torch.testing.assert_close(got[0], runner.forward_logits(a + [nxt])[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], runner.forward_logits(c)[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda p: p["rope_type"],
)
def test_rope_frequencies_match_hf(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from helios.core.manifest import RopeScaling
    from helios.layers.rotary import RotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                         rope_parameters={"rope_theta": 10000.0, **params})
    ref_inv_freq, ref_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    scaling = RopeScaling(type=params["rope_type"], **{k: v for k, v in params.items() if k != "rope_type"})
    ours = RotaryEmbedding(16, 10000.0, scaling, 256)
    torch.testing.assert_close(ours.inv_freq, ref_inv_freq.float(), atol=0, rtol=1e-6)
    assert ours.attention_scaling == pytest.approx(ref_scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_are_the_computed_rows(dtype):
    """The tabulated (cos, sin) rows a step gathers are the rows cos_sin computes for those positions (the
    torch CPU kernels may round a vectorized lane apart from a scalar one: within one ulp), and the table
    serves only its own dtype."""
    from helios.core.manifest import RopeScaling
    from helios.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 500000.0, RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=8192),
                           131072)
    positions = torch.tensor([0, 1, 7, 4095, 65535, 65536, 131071, 33])  # tabulated in chunks of 65536
    want = rope.cos_sin(positions, dtype)
    rope.tabulate(131072, dtype)
    got = rope.cos_sin(positions, dtype)
    assert got[0].shape == got[1].shape == (8, 64) and got[0].dtype == dtype
    ulp = torch.finfo(dtype).eps
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ulp, rtol=ulp)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    assert rope.cos_sin(positions, other)[0].dtype == other  # computed, not gathered from the other dtype


def test_softcap_path_matches_sdpa_path():
    """The eager soft-capped path (used when a cap is set) agrees with SDPA for a cap too large to bite,
    including the chunked-prefill offset and the sliding window."""
    from helios.layers.attention import AttentionMetadata, TorchAttentionBackend

    gen = torch.Generator().manual_seed(0)
    num_tokens, nq, nkv, d, page = 7, 4, 2, 8, 4
    cache = torch.randn(2, 6, page, nkv, d, generator=gen)
    q, k, v = (torch.randn(num_tokens, n, d, generator=gen) for n in (nq, nkv, nkv))
    blocks = torch.tensor([[5, 1, 3, 0]], dtype=torch.int32)
    positions = torch.arange(6, 13)  # 6 tokens already cached, 7 new ones: an offset causal mask
    slots = blocks[0, positions // page].long() * page + positions % page
    meta = AttentionMetadata(positions, slots, torch.tensor([0, 7]), torch.tensor([13]), blocks, [0, 7], [13])
    backend = TorchAttentionBackend()
    for window in (None, 5):
        plain = backend.forward(q, k, v, cache.clone(), meta, 0.3, window, None)
        capped = backend.forward(q, k, v, cache.clone(), meta, 0.3, window, 1e6)
        torch.testing.assert_close(capped, plain, atol=1e-5, rtol=0)


def test_bfloat16_error_is_hf_sized(tmp_path):
    """bf16 is not bit-compared (GEMM blocking differs); our bf16 error against float32 must stay the
    size of HF's own bf16 error."""
    hf, core = export_tiny("qwen3", tmp_path)
    ids = prompt()
    ref32 = hf_logits(hf, ids)
    hf_err = (hf_logits(hf.to(torch.bfloat16), ids) - ref32).abs().max()
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=16, page_size=PAGE_SIZE, dtype=torch.bfloat16)
    assert runner.kv_cache.layers[0].dtype == torch.bfloat16
    ours = runner.forward_logits(ids, chunk_size=5)
    assert ours.dtype == torch.float32
    assert (ours - ref32).abs().max() <= 1.5 * hf_err + 0.02
