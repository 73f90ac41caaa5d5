"""The family GPU tests' shared pieces (tests/gpu/test_<family>_cuda.py): their skip markers, a tiny checkpoint's
float32 and bfloat16 exports, the CUDA engine (hybrid_harness.window_engine on the device: the sliding layers' pages
in a window group when a model has both kinds) and the CPU tests' parity checks run through it: greedy tokens = HF
transformers' generate on the device, 16 batched requests = each alone."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from helios.core.load import LoadedCore, load_core
from helios.engine.engine_core import EngineCore
from helios.kernels._triton import HAS_TRITON, interpret_mode
from tests.models.hybrid_harness import check_batched_equals_alone, check_greedy_matches_generate, prompt, window_engine

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


def check_greedy_on_cuda(hf_class, src: Path, core, **options) -> EngineCore:
    """32 greedy tokens of a 150-token prompt through cuda_engine (256-token budget, 128-token chunks; options:
    window_engine's) = generate of the HF model (hf_class from src, float32, on the device). Returns the engine."""
    hf = hf_class.from_pretrained(src, dtype=torch.float32).to("cuda").eval()
    return check_greedy_matches_generate(hf, core, prompt(150, seed=5), engine=partial(cuda_engine, **options),
                                         device="cuda")


def check_batched_on_cuda(core, budget: int = 128, chunk: int = 64, one_alone_engine: bool = False, **options) -> None:
    """16 requests together (prompts split into `chunk`-token chunks beside decodes, a `budget`-token budget) = each
    alone (one slot, 512-token chunks); options: window_engine's."""
    prompts = [prompt(7 + 23 * i, seed=10 + i) for i in range(16)]
    check_batched_equals_alone(core, prompts, engine=partial(cuda_engine, **options), budget=budget, chunk=chunk,
                               one_alone_engine=one_alone_engine)


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
