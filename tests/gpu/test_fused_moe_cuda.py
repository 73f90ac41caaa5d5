"""helios.kernels.fused_moe on CUDA: MoE blocks at a real shape (256 experts top-8, hidden 2048, moe_intermediate 512,
bf16) on the fused path = the torch path, a CUDA graph of a block replayed = the block run eagerly, and the tiny
qwen3_moe and qwen3_5_moe checkpoints through the CUDA engine (MoE on its fused path, decode steps through CUDA
graphs): greedy tokens = HF transformers' generate on the device. Every other MoE family: its own block (built by its
model class from its tiny Architecture, tests/kernels/moe_cases) fused = torch path and replayed in a graph = eager,
and the families whose decode steps the fused MoE lets CUDA graphs capture (mimo_v2_flash, muse_spark, step3p7,
nemotron_h) greedy through those graphs = HF's generate in float32."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore
from helios.kernels._triton import HAS_TRITON, interpret_mode
from helios.layers.moe import SigmoidMoe, SparseMoe, route
from helios.runner.model_runner import ModelRunner
from tests.gpu.family_cuda import check_tokens_match_hf, hf_torch_path
from tests.gpu.family_cuda import cuda_engine as window_cuda_engine
from tests.kernels import moe_cases
from tests.kernels.moe_cases import inputs, sigmoid_config, torch_and_fused
from tests.models.hybrid_harness import PAGE_SIZE, generate, greedy_request, prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 256, 8, 512
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sparse_block(fused: bool) -> SparseMoe:
    return SparseMoe(HIDDEN, EXPERTS, INTER, TOP_K, True, "silu", fused=fused)


def sigmoid_block(fused: bool) -> SigmoidMoe:
    moe = sigmoid_config(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER, num_groups=8,
                         num_topk_groups=4, shared_expert_intermediate_size=INTER)
    return SigmoidMoe(HIDDEN, moe, "silu", fused=fused)


@pytest.fixture(scope="module", params=["sparse", "sigmoid"])
def blocks(request):
    make = sparse_block if request.param == "sparse" else sigmoid_block
    return request.param, torch_and_fused(make, dtype=torch.bfloat16, device="cuda")


def tied_choice(layer, x: torch.Tensor) -> torch.Tensor:  # [T] bool
    """Tokens whose k-th and (k+1)-th best routing choice tie (bf16 logits of 256 experts often do): either expert
    is right, and the two paths may take different ones. Only the softmax router reads bf16 logits."""
    if not isinstance(layer, SparseMoe):
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    probs = torch.softmax(layer.router(x), dim=-1, dtype=torch.float32).topk(TOP_K + 1, dim=-1).values
    return probs[:, TOP_K - 1] == probs[:, TOP_K]


@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_grouped_prefill_gives_the_triton_products(act):
    """The moe_prefill switch's grouped path (torch's grouped GEMM, helios.kernels.moe_grouped) on a 512-token
    prompt at the real shape: the Triton GEMMs' products within bf16 rounding (printed: whether the bits agree,
    which decides if the switch can be the default without a token's bits depending on its batch's size)."""
    from helios.kernels import fused_moe, moe_grouped

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(512, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    rows = INTER if act == "relu2" else 2 * INTER
    w_in = (torch.randn(EXPERTS, rows, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") / INTER**0.5).to(torch.bfloat16)
    ids = torch.randn(512, EXPERTS, generator=g, device="cuda").topk(TOP_K, dim=-1).indices.to(torch.int32)
    assert moe_grouped.grouped_serves(x, w_in, w_down, ids.numel())
    got = moe_grouped.expert_outputs_grouped(x, ids, w_in, w_down, act).float()
    want = fused_moe.expert_outputs(x, ids, w_in, w_down, act).float()
    print(f"grouped vs triton ({act}): equal bits {torch.equal(got, want)}, max diff {(got - want).abs().max():.3g}")
    err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)
    assert err.max() < 1e-2, err.max()


@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_the_fused_block_matches_the_torch_path_at_a_real_shape(blocks, num_tokens):
    """Per token, relative L2 error within 2e-2 (bf16: the torch path rounds gate_up, the activation and each
    weighted product; the kernels round once) on every token whose routing has no tie."""
    _, (torch_path, fused) = blocks
    x = inputs(num_tokens, HIDDEN, torch.bfloat16, seed=num_tokens, device="cuda")
    with torch.inference_mode():
        want, got = torch_path(x).float(), fused(x).float()
        keep = ~tied_choice(fused, x)
    assert keep.sum() >= max(1, num_tokens * 3 // 4)
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err[keep].max() < 2e-2, err


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_the_shared_blocks_give_the_bits_of_one_more_expert(num_tokens):
    """expert_outputs' shared blocks compiled for the GPU (their branch picks the shared weight and `a`'s row): a
    shared expert's rows = the same kernel given it as a 257th stacked expert every token routes to; routed rows
    unchanged. At the real shape, bf16, under PDL where the step's size takes it."""
    from helios.kernels import fused_moe

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(num_tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    w_in = (torch.randn(EXPERTS + 1, 2 * INTER, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
    w_down = (torch.randn(EXPERTS + 1, HIDDEN, INTER, generator=g, device="cuda") / INTER**0.5).to(torch.bfloat16)
    ids = torch.randn(num_tokens, EXPERTS, generator=g, device="cuda").topk(TOP_K, dim=-1).indices.to(torch.int32)
    shared = (w_in[EXPERTS].clone(), w_down[EXPERTS].clone())
    got = fused_moe.expert_outputs(x, ids, w_in[:EXPERTS], w_down[:EXPERTS], "silu", shared=shared)
    n = ids.numel()
    assert torch.equal(got[:n], fused_moe.expert_outputs(x, ids, w_in[:EXPERTS], w_down[:EXPERTS], "silu"))
    nine = torch.cat([ids, torch.full((num_tokens, 1), EXPERTS, dtype=torch.int32, device="cuda")], dim=1)
    as_expert = fused_moe.expert_outputs(x, nine, w_in, w_down, "silu").view(num_tokens, TOP_K + 1, HIDDEN)
    assert torch.equal(got[n:], as_expert[:, TOP_K])


def test_softmax_routing_matches_route_in_float32():
    from helios.kernels.fused_moe import moe_route

    logits = inputs(64, EXPERTS, torch.float32, device="cuda")
    weights, ids = moe_route(logits, TOP_K, renorm=True)
    want_weights, want_ids = route(logits, TOP_K, True)
    got, want = ids.long().sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(weights.gather(1, got.indices), want_weights.gather(1, want.indices))


def test_a_captured_block_replays_what_it_computes_eagerly(blocks):
    """A decode bucket of 8 rows: capture once, then new inputs copied into the static buffer replay = eager."""
    _, (_, fused) = blocks
    static = inputs(8, HIDDEN, torch.bfloat16, seed=3, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(stream):  # compile and warm up off the capture
            for _ in range(2):
                fused(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(static)
        for seed in (4, 5):
            x = inputs(8, HIDDEN, torch.bfloat16, seed=seed, device="cuda")
            static.copy_(x)
            graph.replay()
            assert torch.equal(out, fused(x))


def test_one_token_under_pdl_gives_the_same_bits_eagerly_and_in_a_graph(blocks):
    """Batch-1 decode under pdl_scope (HELIOS_PDL=1): route, both expert GEMMs and the combine launch with PDL and
    wait for the kernel before them; eagerly and replayed in a graph they give the bits of the launch without."""
    from helios.kernels._triton import pdl_scope

    _, (_, fused) = blocks
    static = inputs(1, HIDDEN, torch.bfloat16, seed=6, device="cuda")
    with torch.inference_mode():
        want = [fused(inputs(1, HIDDEN, torch.bfloat16, seed=s, device="cuda")) for s in (7, 8)]
        with pdl_scope(True):
            assert torch.equal(fused(inputs(1, HIDDEN, torch.bfloat16, seed=7, device="cuda")), want[0])
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fused(static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fused(static)
        for seed, expected in zip((7, 8), want):
            static.copy_(inputs(1, HIDDEN, torch.bfloat16, seed=seed, device="cuda"))
            graph.replay()
            assert torch.equal(out, expected)


# --- the tiny MoE families through the CUDA engine -----------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def exported(request, tmp_path_factory):
    from ignition.export import ExportOptions, export_core
    from tests.ignition.tiny_models import build_tiny
    from tests.models.hybrid_tiny import build_hybrid

    root = tmp_path_factory.mktemp(request.param)
    build = build_tiny if request.param == "qwen3_moe" else build_hybrid
    src = build(request.param, root / "hf")
    return src, {name: load_core(export_core(src, root / name, ExportOptions(dtype=name))) for name in DTYPES}


def cuda_engine(core, max_concurrency: int = 16, budget: int = 256, chunk: int = 128) -> EngineCore:
    """tests/gpu/test_hybrid_cuda.py's engine; state slots only for a model with recurrent layers."""
    arch = core.manifest.arch
    num_pages = 512
    slots = max_concurrency if arch.recurrent is not None else 0
    state = dict(num_state_slots=slots, state_chunk=arch.recurrent.chunk_size) if slots else {}
    config = SchedulerConfig(max_concurrency=max_concurrency, max_num_batched_tokens=budget,
                             prefill_chunk_size=chunk, page_size=PAGE_SIZE, num_pages=num_pages,
                             max_model_len=num_pages * PAGE_SIZE, **state)
    runner = ModelRunner(arch, core.tensors, num_pages, PAGE_SIZE, device="cuda", num_state_slots=slots)
    return EngineCore(config, runner)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_transformers_through_decode_graphs(exported, dtype):
    """32 greedy tokens of a 150-token prompt through the CUDA engine = HF generate on the device; every token after
    the first decodes through a CUDA graph (the MoE layers on their fused path admit them).
    NOTE: qwen3_5_moe in bf16 is left out: its bf16 tokens are no oracle for this prompt. On the H200 (2026-12-04)
    ours took 198 at the second token and HF 194; HF's float32 logits there (CPU) rank 150 (2.484), 198 (2.439), and
    194 only at 2.027: HF's own bf16 rounding moves a logit by ~0.45 in this tiny random model, so any other
    accumulation order (our Triton GEMMs against cuBLAS) may pick another token. float32 = HF on the H200 for both
    families, and bf16 for qwen3_moe."""
    from transformers import AutoModelForCausalLM

    src, cores = exported
    if dtype == "bfloat16" and cores[dtype].manifest.arch.family == "qwen3_5_moe":
        pytest.skip("bf16 greedy = HF is not held for qwen3_5_moe (see NOTE)")
    ids, num_new = prompt(150, seed=5), 32
    engine = cuda_engine(cores[dtype])
    assert engine.runner.graphs is not None
    got = generate(engine, [greedy_request("a", ids, num_new)])["a"]
    replays = engine.runner.launches["graph"] + engine.runner.launches["speculative"]  # both replay graphs
    assert replays >= num_new - 1, engine.runner.launches
    hf = hf_torch_path(AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[dtype]).to("cuda").eval())
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=num_new, min_new_tokens=num_new,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert got == ref[len(ids):]


# --- every other MoE family -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family_arch(tmp_path_factory):
    """family -> its tiny checkpoint's Architecture (moe_cases.family_arch), built on first use."""
    return moe_cases.arch_getter(tmp_path_factory.mktemp("moe-families"))


@pytest.mark.parametrize("family", list(moe_cases.family_builders()))
def test_each_family_block_matches_its_torch_path_and_replays_in_a_graph(family_arch, family):
    """The family's own MoE blocks (deepseek_v4: a hash layer's and a scored one's), float32 on the device: the
    Triton backend's block (fused) = the torch backend's within 1e-4; a CUDA graph of the fused block on an 8-token
    bucket, replayed on new inputs (and token ids) = the block run eagerly, bit for bit."""
    from helios.kernels.backend import TritonAttentionBackend
    from helios.layers.attention import select_attention_backend

    arch = family_arch(family)
    eager = moe_cases.unbound_model(arch, select_attention_backend("torch"), "cuda")
    fused = moe_cases.unbound_model(arch, TritonAttentionBackend(), "cuda")
    torch_blocks, fused_blocks = moe_cases.moe_blocks(eager), moe_cases.moe_blocks(fused)
    for i, name in enumerate(moe_cases.blocks_to_run(family, fused_blocks)):
        pair = [torch_blocks[name], fused_blocks[name]]
        assert pair[1].fused and not pair[0].fused
        moe_cases.bind_block_weights(pair, arch.moe.num_experts, seed=i, device="cuda")
        x = inputs(5, arch.hidden_size, torch.float32, seed=7 + i, device="cuda")
        ids = torch.tensor([3, 17, 5, 60, 9], device="cuda")
        with torch.inference_mode():
            want, got = (moe_cases.run_block(b, family, x, ids) for b in pair)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        check_graph_replay(lambda a, t: moe_cases.run_block(pair[1], family, a, t), arch.hidden_size)


def check_graph_replay(run, hidden_size: int) -> None:
    """run(x [8, H], token_ids [8]) captured once on static buffers; two new inputs copied in and replayed = eager."""
    static_x = inputs(8, hidden_size, torch.float32, seed=3, device="cuda")
    static_ids = torch.arange(8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(stream):  # compile and warm up off the capture
            for _ in range(2):
                run(static_x, static_ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(static_x, static_ids)
        for seed in (4, 5):
            x = inputs(8, hidden_size, torch.float32, seed=seed, device="cuda")
            ids = torch.randint(0, 200, (8,), generator=torch.Generator().manual_seed(seed)).to("cuda")
            static_x.copy_(x)
            static_ids.copy_(ids)
            graph.replay()
            assert torch.equal(out, run(x, ids))


GRAPHED_FAMILIES = {  # family -> the HF class that generates its tiny checkpoint (by name in transformers)
    "mimo_v2_flash": "MiMoV2FlashForCausalLM",
    "muse_spark": "MuseSparkForConditionalGeneration",
    "step3p7": "Step3p7ForConditionalGeneration",
    "nemotron_h": "AutoModelForCausalLM",
}


@pytest.mark.parametrize("family", list(GRAPHED_FAMILIES))
def test_greedy_through_decode_graphs_matches_transformers_in_float32(tmp_path, family):
    """The family's tiny checkpoint in float32 through the CUDA engine (the window-group engine of its family test; a
    recurrent model's state slots as above): the MoE layers fused, the decode steps replaying CUDA graphs (the fused
    MoE was what refused them), 32 greedy tokens of a 150-token prompt = HF's generate on the device."""
    import transformers
    from ignition.export import ExportOptions, export_core

    src = moe_cases.family_builders()[family](tmp_path / "hf")
    core = load_core(export_core(src, tmp_path / "core", ExportOptions(dtype="float32")))
    engine = cuda_engine(core) if core.manifest.arch.recurrent is not None else window_cuda_engine(core)
    assert engine.runner.graphs is not None, engine.runner.startup.graphs
    blocks = moe_cases.moe_blocks(engine.runner.model).values()
    assert blocks and all(b.fused for b in blocks)
    ids, num_new = prompt(150, seed=5), 32
    got = generate(engine, [greedy_request("a", ids, num_new)])["a"]
    replays = engine.runner.launches["graph"] + engine.runner.launches["speculative"]  # both replay graphs
    assert replays >= num_new // 2, engine.runner.launches
    check_tokens_match_hf(getattr(transformers, GRAPHED_FAMILIES[family]), src, "float32", ids, got)

