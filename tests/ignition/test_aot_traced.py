"""Ahead-of-time kernels of the families helios.kernels.aot_shapes does not list by hand: their decode graphs run on
meta tensors under the compile hook (helios.runner.aot_trace), on a machine without a GPU.

The trace lists each family's kernels (the recurrent mixers', the gated norms', the fused MoE's, the attention
layers'); the keys it finds equal those of the same graphs run by a ModelRunner-built model on real CPU tensors (so
meta offsets and strides specialize as memory does); an exported qwen3_5 core holds them, and the loader's offline
pass, the runtime's launches through the compile hook, finds every one of them without compiling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helios.core.load import load_core
from helios.kernels._triton import HAS_TRITON
from ignition.export import ExportOptions, export_core
from tests.models.hybrid_tiny import build_hybrid
from tests.models.kimi_linear_tiny import build_kimi_linear
from tests.models.nemotron_h_tiny import build_nemotron_h

ROOT = Path(__file__).resolve().parents[2]
TARGET = "cuda-sm90"
CONTEXT = 256

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

BUILDERS = {
    "qwen3_5": lambda out: build_hybrid("qwen3_5", out),
    "qwen3_5_moe": lambda out: build_hybrid("qwen3_5_moe", out),
    "nemotron_h": build_nemotron_h,
    "kimi_linear": build_kimi_linear,
}
DENSE = {"_rms_norm_kernel", "_gemv_kernel", "_decode_kernel", "_reshape_and_cache_kernel"}
GDN = {"_gated_delta_step_kernel", "_gated_rms_norm_kernel", "_gated_kernel"}
GATED_ATTENTION = {"_rms_norm_rope_kernel", "_sigmoid_gate_kernel"}
MOE = {"_router_kernel", "_route_kernel", "_align_kernel", "_expert_gemm_kernel", "_combine_kernel"}
# what each family's decode graphs launch (qwen3_5's attention: q/k norms with partial rotary in one launch, the
# sigmoid gate in another, which keeps it off decode_qkv; nemotron_h: the Mamba-2 mixer's decode step in one launch
# (mixed steps take the varlen conv and the scan, never graphed), its gated norm and relu2 in one each, each residual
# add and norm in one launch)
EXPECTED = {
    "qwen3_5": DENSE | GDN | GATED_ATTENTION,
    # its shared expert rides in the experts' launches (fused_moe's shared blocks): no act-and-mul of its own
    "qwen3_5_moe": (DENSE | GDN | GATED_ATTENTION | MOE) - {"_gated_kernel"},
    "nemotron_h": {"_mamba2_decode_kernel", "_gated_rms_norm_kernel", "_relu2_kernel", "_gemv_kernel",
                   "_decode_kernel", "_reshape_and_cache_kernel", "_rms_norm_kernel"} | MOE,
}


def clean_env() -> dict[str, str]:
    """This environment without Triton's variables (the tests' TRITON_INTERPRET among them), helios importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    """tests.ignition.aot_trace_probe, in a subprocess where Triton compiles rather than interprets, over each
    family's tiny checkpoint: qwen3_5 exported for cuda-sm90 in bfloat16 (kernels compiled into the core), the
    others for the CPU in float32 (the trace reads only the manifest; qwen3_5_moe's float32 graphs are the
    real-memory comparison)."""
    root = tmp_path_factory.mktemp("traced")
    cores = {name: export_core(BUILDERS[name](root / name / "hf"), root / name / "core",
                               ExportOptions(context_length=CONTEXT, target=TARGET if name == "qwen3_5" else "cpu"))
             for name in ("qwen3_5", "qwen3_5_moe", "nemotron_h", "kimi_linear")}
    proc = subprocess.run([sys.executable, "-m", "tests.ignition.aot_trace_probe", str(root / "cache"),
                           *map(str, cores.values())], capture_output=True, text=True, env=clean_env(), cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["families"] = {name: result["families"][str(core)] for name, core in cores.items()}
    result["cores"] = cores
    return result


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_trace_lists_the_family_kernels(probe, family):
    names = set(probe["families"][family])
    assert names == EXPECTED[family], sorted(names ^ EXPECTED[family])


def test_kimi_linear_traces_its_kda_kernels_once_graphed(probe):
    """kimi_linear: while its MLA layers decode on the torch path the runner captures no graph (its decode runs
    eagerly and compiles on first use) and the trace runs nothing; once they are graphed, the trace holds the KDA
    decode step (helios.kernels.kda's, f_b and the sigmoid-gated norm inside) and the MLA decode's launches."""
    names = probe["families"]["kimi_linear"]
    assert names is None or {"_kda_decode_kernel", "_absorb_query_kernel", "_mla_decode_kernel",
                             "_merge_expand_kernel"} <= set(names), names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_meta_trace_specializes_as_real_tensors(probe, dtype):
    """The qwen3_5_moe decode graphs through a CPU ModelRunner's own model and caches on the Triton backend (real
    memory) launch with the keys of the meta trace (offsets, strides, dtypes, constexprs)."""
    num_keys, equal = probe["real_equals_meta"][dtype]
    assert num_keys > 10 and equal


def test_export_holds_the_traced_kernels_and_the_loader_compiles_none(probe):
    """`ignition export --target cuda-sm90` of a bfloat16 qwen3_5: the gated delta rule's step, the gated norm and
    partial rotary are in the core; the offline load (the runtime's launches and the decode graphs' trace, through
    the compile hook) finds every kernel in the installed cache."""
    core = load_core(probe["cores"]["qwen3_5"])
    if not core.manifest.kernels:
        pytest.skip(f"this triton cannot compile for {TARGET} here")
    (kt,) = core.manifest.kernels
    index = json.loads((core.path / kt.dir / "index.json").read_text())
    names = {e["kernel"].rsplit(":", 1)[1] for e in index["kernels"]}
    assert EXPECTED["qwen3_5"] <= names, sorted(EXPECTED["qwen3_5"] - names)
    assert probe["load_offline"][str(core.path)] == [len(index["kernels"]), 0]


def test_start_puts_every_traced_kernel_into_tritons_cache(probe):
    """The runner's start (aot.load_traced, beside the weights upload): each launch the decode trace makes gets its
    kernel, from the installed cache (nothing compiled), under its launch key in Triton's in-memory cache, so the
    capture's launches find it there and the hook JitCounter counts never fires."""
    core = probe["cores"]["qwen3_5"]
    if str(core) not in probe["load_traced"]:
        pytest.skip(f"this triton cannot compile for {TARGET} here")
    num_launches, loaded, found, compiled, again = probe["load_traced"][str(core)]
    assert num_launches > 5 and loaded == found == num_launches and compiled == 0
    # a second start in the process (kernels already cached) launches nothing on meta tensors and loads nothing
    assert again == 0
