"""What the decode-graph trace (helios.runner.aot_trace) launches, run where Triton compiles (the tests' process runs
it interpreted: TRITON_INTERPRET, tests/conftest.py): `python -m tests.ignition.aot_trace_probe CACHE CORE...`
prints one JSON object: per core directory, the kernel names its bfloat16 decode graphs launch (None when the
runner would not capture them); for the first float32 core, in float32 and bfloat16, whether the launch keys of a
CPU ModelRunner's own model and caches (real memory) equal the meta trace's; for a core with kernels, helios.runner.aot_compile.load_offline's
(index entries, compiled) with its cache under CACHE, and what helios.kernels.aot.load_traced puts into Triton's
in-memory cache (load_traced_check). Every launch goes through Triton's compile hook under a stand-in driver for
sm90: nothing is run.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import msgspec

from helios.core.load import load_core
from ignition.prepare.plan import graph_plan

TARGET = "cuda-sm90"
CONTEXT = 256


def cuda_manifest(core: Path, dtype: str | None = None):
    """The core's manifest with the CUDA graph plan (all decode buckets), as a CUDA export writes it."""
    manifest = load_core(core).manifest
    return msgspec.structs.replace(manifest, graph_plan=graph_plan(TARGET, 0, CONTEXT),
                                   dtype=dtype or manifest.dtype)


def traced(run) -> dict[str, str]:
    """{specialization data: kernel name} of every launch `run()` makes, none compiled or run."""
    from helios.kernels.aot import launch_keys

    return {data: name for name, data in launch_keys(run, TARGET)}


def family_kernels(core: Path) -> list[str] | None:
    from helios.runner.aot_trace import trace_decode

    manifest = cuda_manifest(core, "bfloat16")
    ran = []
    names = sorted(set(traced(lambda: ran.append(trace_decode(manifest))).values()))
    return names if ran[0] else None


def real_equals_meta(core_dir: Path, dtype: str) -> tuple[int, bool]:
    """(launch keys, equal?) of the decode graphs on real CPU tensors (a ModelRunner's model and caches on the
    Triton backend) against the meta trace. The CPU runner is given what the CUDA one builds from a core exported
    in `dtype`: every tensor in `dtype` but the norm multipliers such a core keeps in float32 (models.float32_kept;
    model_runner.move_tensors leaves them), and the rope tables (tabulate_rope); the GEMV switch is off for both (on
    the CPU a one-row 16-bit product never takes it, on meta it would, as on the GPU)."""
    import torch

    from helios.kernels._triton import meta_as_gpu
    from helios.layers.rotary import tabulate_rope
    from helios.models import float32_kept
    from helios.runner.aot_trace import meta_model, trace_decode
    from helios.runner.input_batch import max_table_blocks
    from helios.runner.model_runner import ModelRunner
    from helios.switches import Switches

    switches = Switches.from_environ({"HELIOS_GEMV": "off"})
    core, manifest = load_core(core_dir), cuda_manifest(core_dir, dtype)
    plan, arch, torch_dtype = manifest.graph_plan, manifest.arch, getattr(torch, dtype)
    with meta_as_gpu(9, 132), torch.inference_mode():
        kept = float32_kept(meta_model(arch, torch_dtype, switches)) if torch_dtype != torch.float32 else set()
    tensors = {name: t if name in kept else t.to(torch_dtype) for name, t in core.tensors.items()}
    runner = ModelRunner(arch, tensors, 16, plan.page_size, device="cpu", attention_backend="triton",
                         num_state_slots=max(plan.decode_buckets), max_model_len=CONTEXT, switches=switches)
    tabulate_rope(runner.model, max_table_blocks(CONTEXT, plan.page_size) * plan.page_size, torch_dtype)
    graphs = runner.make_graphs(list(plan.decode_buckets), capture=False)
    real = traced(lambda: [graphs.run_variants(b) for b in graphs.buckets])
    meta = traced(lambda: trace_decode(manifest, switches))
    return len(real), sorted(real) == sorted(meta)


def load_traced_check(core_dir: Path, cache: Path) -> list[int]:
    """[distinct launches of the core's decode trace, kernels helios.kernels.aot.load_traced put into Triton's
    in-memory cache, launches found there afterwards, kernels it had to compile, kernels a second load_traced put
    there] from the core's installed kernels, under a stand-in driver for sm90 (what the runner's start does on the
    GPU). The second pass runs with every kernel in the cache: a launch found there would run (and fail here)."""
    from triton import knobs
    from triton.runtime import driver

    from helios.kernels.aot import _kernel_dirs, _TargetDriver, install_cache, load_traced
    from helios.runner.aot_trace import trace_decode

    manifest = load_core(core_dir).manifest
    cache_dir, _ = install_cache(core_dir / manifest.kernels[0].dir, cache)

    def trace():  # not decode_tracer's: an error must surface
        assert trace_decode(manifest, major=9)

    missed = {}

    def hook(**kwargs):
        c = kwargs["compile"]
        missed[(id(kwargs["fn"].jit_function), c["key"])] = (kwargs["fn"].jit_function, c["key"], c["device"])
        return True

    previous_driver, previous_hook = getattr(driver, "_active", None), knobs.runtime.jit_cache_hook
    driver.set_active(_TargetDriver(90))
    try:
        knobs.runtime.jit_cache_hook = hook
        trace()
        knobs.runtime.jit_cache_hook = previous_hook
        before = _kernel_dirs(cache_dir)
        loaded = load_traced(trace)
        found = sum(key in fn.device_caches[device][0] for fn, key, device in missed.values())
        again = load_traced(trace)
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)
    return [len(missed), loaded, found, len(_kernel_dirs(cache_dir) - before), again]


def main(cache: str, cores: list[str]) -> None:
    from helios.runner.aot_compile import load_offline

    warnings.simplefilter("ignore")
    manifests = {c: load_core(Path(c)).manifest for c in cores}
    result = {"families": {c: family_kernels(Path(c)) for c in cores}}
    first_f32 = Path(next(c for c, m in manifests.items() if m.dtype == "float32"))
    result["real_equals_meta"] = {dtype: real_equals_meta(first_f32, dtype) for dtype in ("float32", "bfloat16")}
    result["load_offline"] = {c: load_offline(Path(c), Path(cache) / Path(c).parent.name)
                              for c, m in manifests.items() if m.kernels}
    # last: it points this process's Triton cache at the installed copy
    result["load_traced"] = {c: load_traced_check(Path(c), Path(cache) / "traced" / Path(c).parent.name)
                             for c, m in manifests.items() if m.kernels}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
