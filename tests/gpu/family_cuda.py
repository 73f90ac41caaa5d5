"""The family GPU tests' shared pieces (tests/gpu/test_<family>_cuda.py): their skip markers, a tiny checkpoint's
float32 and bfloat16 exports, the CUDA engine (hybrid_harness.window_engine on the device: the sliding layers' pages
in a window group when a model has both kinds) and the CPU tests' parity checks run through it: greedy tokens = HF
transformers' generate on the device, 16 batched requests = each alone."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import torch

from helios.core.load import LoadedCore, load_core
from helios.engine.engine_core import EngineCore
from helios.kernels._triton import HAS_TRITON, interpret_mode
from tests.models.hybrid_harness import check_batched_equals_alone, generate, greedy_request, prompt, window_engine

CUDA_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.skipif(interpret_mode(), reason="TRITON_INTERPRET is set: kernels would not be compiled"),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUM_PAGES = 512


def export_dtypes(src: Path, root: Path, dtypes=DTYPES) -> dict[str, LoadedCore]:
    """{dtype name: the core of src exported in it (under root / name)}."""
    from ignition.export import ExportOptions, export_core

    return {name: load_core(export_core(src, root / name, ExportOptions(dtype=name))) for name in dtypes}


def export_family(tmp_path_factory, name: str, build) -> tuple[Path, dict[str, LoadedCore]]:
    """A family's module fixture: (the HF directory build(root / "hf") writes, its float32 and bfloat16 cores)."""
    root = tmp_path_factory.mktemp(name)
    src = build(root / "hf")
    return src, export_dtypes(src, root)


def cuda_engine(core, max_concurrency: int = 16, budget: int = 256, chunk: int = 128, **options) -> EngineCore:
    """window_engine's (room in the window group for every request's window and chunk) on the GPU, 512 pages;
    options: window_engine's (cuda_graphs=False: eager decode)."""
    return window_engine(core, max_concurrency, NUM_PAGES, chunk, budget, device="cuda", **options)


def check_graphed_equals_eager(engine, prompt_step: int = 37) -> None:
    """Four requests' 24 greedy tokens (prompts of 40, 40 + prompt_step, ... tokens) through `engine(True)`, decode
    steps replayed as graphs (asserted: graphs built and launched) = through `engine(False)`, the same engine with
    graphs off (the same kernels eagerly)."""
    reqs = [greedy_request(f"r{i}", prompt(40 + prompt_step * i, seed=20 + i), 24) for i in range(4)]
    graphed = engine(True)
    assert graphed.runner.graphs is not None, graphed.runner.startup.graphs
    got = generate(graphed, reqs)
    assert graphed.runner.launches["graph"] > 0, graphed.runner.launches
    assert got == generate(engine(False), reqs)


def check_greedy_on_cuda(hf_class, src: Path, core, engine=None, **options) -> EngineCore:
    """32 greedy tokens of a 150-token prompt through the engine `engine(core)` builds (default cuda_engine: a
    256-token budget, 128-token chunks; options: window_engine's) = generate of the HF model (hf_class from src, in
    the core's dtype, on the device; its torch ops). Returns the engine."""
    engine = engine(core) if engine is not None else cuda_engine(core, **options)
    ids, num_new = prompt(150, seed=5), 32
    got = generate(engine, [greedy_request("a", ids, num_new)])["a"]
    check_tokens_match_hf(hf_class, src, core.manifest.dtype, ids, got)
    return engine


@contextmanager
def ieee_float32():
    """float32 convolutions and matmuls in IEEE precision inside: cuDNN takes TF32 by default
    (torch.backends.cudnn.allow_tf32), and HF's GDN and Mamba convs on its torch path are nn.Conv1d, so its float32
    reference on the device would otherwise round their inputs to 10 mantissa bits."""
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


@torch.no_grad()
def check_tokens_match_hf(hf_class, src: Path, dtype_name: str, ids: list[int], got: list[int]) -> int:
    """`got` (the engine's greedy tokens after `ids`) = HF's generate in `dtype_name` on the device (its torch ops).
    Returns how many tokens are identical: all of them, except in 16 bits, where the first differing token may be a
    tie within rounding: our pick's float32 logit (HF's float32 model teacher-forced on the shared prefix) is within
    twice HF's own 16-bit logit error of the float32 top (HF's 16-bit run is no better a reference than ours there).
    That error is the largest of four: at that position and on average over the generated positions, each for HF's
    prompt form (its 16-bit model teacher-forced on the prefix) and for its decode form (the logits its generate
    chose by, one token a step from its caches). The message gives them."""
    with ieee_float32():
        hf = hf_torch_path(hf_class.from_pretrained(src, dtype=DTYPES[dtype_name]).to("cuda").eval())
        out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=len(got), min_new_tokens=len(got),
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
        ref = out.sequences[0].tolist()[len(ids):]
        if got == ref:
            return len(got)
        k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        context = torch.tensor([ids + ref[:k]], device="cuda")
        low = hf(context).logits[0, len(ids) - 1 :].float()  # the positions that chose generated tokens, k's last
        f32 = hf_torch_path(hf_class.from_pretrained(src, dtype=torch.float32).to("cuda").eval())
        exact_all = f32(context).logits[0, len(ids) - 1 :].float()
    exact = exact_all[-1]
    errors = (low - exact_all).abs().amax(-1)
    # HF's decode form: the logits its generate picked tokens 0..k by (the shared prefix)
    stepped = (torch.cat([step.float() for step in out.logits[: k + 1]]) - exact_all).abs().amax(-1)
    # NOTE: HF's own error at position k alone (0.08 where qwen3_next's first differing token sat, session 26) says
    # little: teacher-forced over 31 positions of these tiny random models, bf16 moves the logits by 0.2-0.8 on
    # average and up to 5.5 (HF's and ours alike, measured on the CPU), so the typical error counts too. And the
    # decode form rounds apart from the prompt form: qwen3_next's bf16 generate (HF's and ours, the same tokens)
    # picked a token 1.77 under the float32 top at its 4th output, where HF's teacher-forced error is 0.10 (session 29,
    # tests/gpu/bf16_errors.py: our decode path 0.32 on average, our prompt path 0.11)
    rounding = max(errors[-1].item(), errors.mean().item(), stepped[-1].item(), stepped.mean().item())
    shortfall = (exact.max() - exact[got[k]]).item()
    message = (f"{dtype_name}: token {k} of {len(got)}: ours {got[k]}, HF {ref[k]}; HF float32 logits "
               f"{exact[got[k]]:.5f} (ours) vs {exact[ref[k]]:.5f} (HF's), top {exact.max():.5f}; HF {dtype_name}'s "
               f"largest logit error there {errors[-1]:.5f} teacher-forced, {stepped[-1]:.5f} in its generate; over "
               f"the generated positions {errors.mean():.5f} / {stepped.mean():.5f} on average, {errors.max():.5f} / "
               f"{stepped.max():.5f} at most\nours {got}\nHF   {ref}")
    assert dtype_name != "float32" and shortfall <= 2 * rounding, message
    print(f"[rounding tie] {message}")
    return k


# a router's k-th and (k+1)-th experts this close in probability (float32) are a tie: a batch and a row alone round
# the hidden state apart by ~1e-6, which can swap them (qwen3_next, session 27: 1.75e-5)
ROUTER_TIE = 1e-4


def router_tie(hf_class, src: Path):
    """check_batched_equals_alone's `tie` for a softmax-routed MoE family: runs that part at output k are a tie when,
    at the position choosing it (the alone run's prefix), some MoE layer's router has its k-th and (k+1)-th experts
    within ROUTER_TIE in probability, by HF's float32 model on the device on its torch path (hf_torch_path, as
    check_tokens_match_hf: fla's kernels would take its float32 dots in TF32; cuDNN's convs too, unless
    ieee_float32), loaded at the first parting.
    NOTE: the last position only: the test's logit-tie rule looks at the outputs, this one at the routing that
    produced them; an earlier position is not searched (150 positions x layers would find a small gap by chance)."""
    from tests.models.router_ties import model_router_gaps

    models = []

    def explain(req, together: list[int], alone: list[int]) -> str | None:
        with ieee_float32():
            if not models:
                models.append(hf_torch_path(hf_class.from_pretrained(src, dtype=torch.float32).to("cuda").eval()))
            k = next(i for i, (a, b) in enumerate(zip(together, alone)) if a != b)
            gaps, _ = model_router_gaps(models[0], list(req.prompt_token_ids) + alone[:k])
        name, gap = min(((n, g[-1]) for n, g in gaps), key=lambda item: item[1])
        if gap >= ROUTER_TIE:
            print(f"[no router tie] {req.req_id} at output {k}: the closest router is {name}, {gap:.2e} (HF float32)")
            return None
        return (f"{req.req_id} parts at output {k} ({together[k]} together, {alone[k]} alone): {name} picks its "
                f"top-k with the next expert {gap:.2e} behind in probability there (HF float32)")

    return explain


def check_batched_on_cuda(core, budget: int = 128, chunk: int = 64, one_alone_engine: bool = True, seed: int = 10,
                          tie=None, **options) -> None:
    """16 requests together (prompts split into `chunk`-token chunks beside decodes, a `budget`-token budget) = each
    alone (one slot, 512-token chunks; one engine for all of them unless one_alone_engine is False: every engine
    captures its graphs); tie: check_batched_equals_alone's (router_tie for a softmax-routed MoE); options:
    window_engine's.

    NOTE: the GPU tests hold this in float32 only. In bfloat16 a row's bits depend on how many rows a projection has
    (cuBLAS picks its GEMM kernel, tiles and split-K by the row count, so a 64-token chunk and a 512-token chunk
    round differently): measured on the H200 (session 13), qwen3_5, qwen3_5_moe, gemma4 and minimax_m3 changed
    tokens in bfloat16 while every family held in float32. Batch-invariant 16-bit GEMMs would be their own feature;
    the CPU tests hold batch invariance in every dtype they run."""
    prompts = [prompt(7 + 23 * i, seed=seed + i) for i in range(16)]  # request i's prompt: seed + i
    check_batched_equals_alone(core, prompts, engine=partial(cuda_engine, **options), budget=budget, chunk=chunk,
                               one_alone_engine=one_alone_engine, tie=tie)


def hf_torch_path(model):
    """Point the model's hub-kernel wrappers (transformers.integrations.hub_kernels: fla when installed) at the torch
    functions they wrap, in its modeling module and on its layers."""
    import sys

    def unwrapped(fn):
        inner = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        return inner if inner is not None and code is not None and code.co_filename.endswith("hub_kernels.py") else fn

    owners = [sys.modules[type(model).__module__], *model.modules()]
    for owner in owners:
        for name, value in list(vars(owner).items()):
            if callable(value) and unwrapped(value) is not value:
                setattr(owner, name, unwrapped(value))
    return model


def check_layer_step_replay(layer, rotary, caches: tuple, dtype: torch.dtype, hidden: int, page_size: int = 16,
                            bucket: int = 4, width: int = 24) -> None:
    """check_step_replay for one layer called `layer(x, cos_sin, caches, meta)`."""

    def forward(x, caches_now, meta):
        return [layer(x, rotary.cos_sin(meta.positions, dtype), caches_now, meta)]

    check_step_replay(forward, caches, dtype, hidden, page_size, bucket, width)


def check_step_replay(forward, caches: tuple, dtype: torch.dtype, hidden: int, page_size: int = 16, bucket: int = 4,
                      width: int = 24, lens: tuple[int, ...] = (300, 2, 77)) -> None:
    """A decode step `forward(x, caches, meta)` -> [outputs] of one or more layers on static inputs
    (tests/gpu/test_mla_decode_cuda.py's construction: 3 sequences in a bucket of 4), captured once and replayed
    after the lengths (to `lens`), tables, slots and hidden rows change in place (other pages, a padded row): every
    output and cache = an eager run of the same step on the same inputs. caches: the page tensors on the device, each
    holding >= 64 pages, in the order `forward` reads them."""
    from helios.layers.attention import AttentionMetadata
    from tests.gpu.test_mla_decode_cuda import _decode_meta
    from tests.kernels.test_mla_decode import _randn, paged_tables

    num_pages = caches[0].shape[1]
    first, _ = paged_tables([5, 40, 17], page_size, "cpu")
    static = {k: v.to("cuda") for k, v in _decode_meta([5, 40, 17], first, page_size, bucket, width).items()}
    x = _randn(bucket, hidden, device="cuda", dtype=dtype, seed=6)

    def step(caches_now):  # the *_cpu lists are capture's (as cuda_graphs.StaticBuffers.metadata)
        meta = AttentionMetadata(query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device="cuda"),
                                 query_start_loc_cpu=list(range(bucket + 1)), seq_lens_cpu=[1024] * bucket, **static)
        return forward(x, caches_now, meta)

    def copies():
        return tuple(c.clone() for c in caches)

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(copies())  # warm-up: compiles
        torch.cuda.current_stream().wait_stream(side)
        replayed = copies()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step(replayed)
        used = sum(-(-n // page_size) for n in lens)  # a new step: other lengths and pages, one row padded
        tables, _ = paged_tables(list(lens), page_size, "cpu", seed=9, spare=num_pages - 1 - used)
        for name, t in _decode_meta(list(lens), tables, page_size, bucket, width).items():
            static[name].copy_(t)
        x.copy_(_randn(bucket, hidden, device="cuda", dtype=dtype, seed=7))
        for ours, original in zip(replayed, caches):
            ours.copy_(original)
        eager = copies()
        graph.replay()
        wants = step(eager)
    torch.cuda.synchronize()
    # the same kernels on the same inputs; the projections' cuBLAS may pick another algorithm under capture
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for out, want in zip(outs, wants, strict=True):
        torch.testing.assert_close(out, want, **tol)
        assert torch.count_nonzero(out[3]) == 0  # the padded row
    for ours, theirs in zip(replayed, eager):
        torch.testing.assert_close(ours, theirs, **tol)
