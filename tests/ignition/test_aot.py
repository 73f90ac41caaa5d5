"""Ahead-of-time kernels: `ignition export --target cuda-sm90` on a machine without a GPU.

Two exports of the same tiny checkpoint must be byte-identical, kernels included; the manifest lists the
kernel target; helios' loader accepts it (target and Triton version match) and Triton, pointed at the
installed copy, finds every kernel in its cache without compiling. Skips when this Triton cannot compile
for CUDA here (no ptxas).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helios.core.load import load_core
from helios.kernels._triton import HAS_TRITON
from ignition.export import ExportOptions, export_core
from tests.ignition.tiny_models import build_tiny

ROOT = Path(__file__).resolve().parents[2]
TARGET = "cuda-sm90"

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _files(core: Path) -> dict[str, bytes]:
    return {p.relative_to(core).as_posix(): p.read_bytes() for p in sorted(core.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Two exports: to an absolute path, and (b) to a path relative to the working directory, as a user types it
    (the kernel compile runs in a subprocess elsewhere: a relative path once left b's kernels/<target>/ empty)."""
    tmp = tmp_path_factory.mktemp("aot")
    src = build_tiny("gemma3", tmp / "hf", sliding_window=4)  # sliding + full layers: two attention variants
    cores = []
    cwd = Path.cwd()
    for name in ("a", "b"):
        out = tmp / name
        if name == "b":
            os.chdir(tmp)
            out = Path(name)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cores.append((tmp / export_core(src, out, ExportOptions(target=TARGET, context_length=256))).resolve())
        finally:
            os.chdir(cwd)
        if not load_core(cores[-1]).manifest.kernels:
            pytest.skip(f"this triton cannot compile for {TARGET} here: {[str(w.message) for w in caught]}")
    return cores


def test_two_exports_are_byte_identical(exported):
    a, b = (_files(c) for c in exported)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    assert any(k.startswith(f"kernels/{TARGET}/") and k.endswith(".cubin") for k in a)
    assert any(k.startswith(f"kernels/{TARGET}/") and k.endswith(".cubin") for k in b)


def test_manifest_lists_the_kernels(exported):
    import triton

    core = load_core(exported[0])  # verifies every file, kernels included, against its digest
    (kt,) = core.manifest.kernels
    assert (kt.target, kt.triton_version, kt.dir) == (TARGET, triton.__version__, f"kernels/{TARGET}")
    index = json.loads((core.path / kt.dir / "index.json").read_text())
    entries = [(e["kernel"].rsplit(":", 1)[1], bool(e["specialization"]["options"].get("launch_pdl")))
               for e in index["kernels"]]
    # sm90: one-row launches (batch-1 decode) may use programmatic dependent launch (pdl_allowed), so the core
    # holds them in both forms; the plain form of most is also the multi-row one. A 256-token context never
    # splits decode (splits need > 256 keys): no merge kernel. Decode for each of the sliding and full layers;
    # the norm without and with the residual add; the batch-1 GEMV in two specializations (the projections do
    # or do not fill its tiles) and its gated form (the down projection reading [gate | up]); prefill (two
    # tokens), the unfused cache write, the sampler's argmax (two kernels) and noise only without PDL.
    pdl = sorted(name for name, on in entries if on)
    plain = sorted(name for name, on in entries if not on)
    assert pdl == ["_decode_kernel"] * 2 + ["_gated_kernel"] + ["_gemv_kernel"] * 3 + ["_rms_norm_kernel",
                                            "_rms_norm_kernel", "_rotary_cache_kernel"], pdl
    assert plain == (["_argmax_chunk_kernel", "_argmax_merge_kernel"] + ["_decode_kernel"] * 2
                     + ["_exponential_log_noise_kernel", "_gated_kernel"] + ["_gemv_kernel"] * 3
                     + ["_prefill_kernel"] * 2 + ["_reshape_and_cache_kernel"] + ["_rms_norm_kernel"] * 2
                     + ["_rotary_cache_kernel"]), plain
    assert core.manifest.dtype == "bfloat16"


def test_artifacts_carry_no_machine_paths(exported):
    for rel, data in _files(exported[0]).items():
        for needle in (str(ROOT), str(exported[0]), str(Path.home()), sys.prefix):
            assert needle.encode() not in data, f"{rel} embeds {needle}"


def test_every_kernel_module_gets_relative_source_paths():
    """Every helios.kernels module's JIT functions, a family's not yet imported in the process too (qwen4_hc,
    relu2, ...), read relative source paths after the exporter's _relative_sources: no kernel's line info can carry
    this machine's checkout path into a core. Compiled kernels (no interpreter), as an export compiles them."""
    script = """
import importlib, pathlib, triton
from helios.kernels.aot import _relative_sources, kernel_modules
_relative_sources()
seen = 0
for name in kernel_modules():
    for value in vars(importlib.import_module("helios.kernels." + name)).values():
        if isinstance(value, triton.runtime.jit.JITFunction):
            assert not pathlib.Path(value.fn.__code__.co_filename).is_absolute(), (name, value.fn.__code__.co_filename)
            seen += 1
print(seen)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 50


def test_helios_loader_accepts_and_triton_finds_every_kernel(exported, tmp_path):
    import triton

    from helios.kernels.aot import check_kernels

    core = load_core(exported[0])
    (kt,) = core.manifest.kernels
    kernels_dir = core.path / kt.dir
    assert check_kernels(kernels_dir, kt.target, kt.triton_version, TARGET) is None
    assert "compiled for cuda-sm90" in check_kernels(kernels_dir, kt.target, kt.triton_version, "cuda-sm80")
    assert "triton 0.0" in check_kernels(kernels_dir, kt.target, "0.0", TARGET)
    # the loader's install + every launcher through the compile hook, under a stand-in driver for sm90 (a
    # subprocess: no interpreter there): each kernel must be found in the installed cache, none compiled
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    code = ("import sys, json; from pathlib import Path; from helios.runner.aot_compile import load_offline; "
            "print(json.dumps(load_offline(Path(sys.argv[1]), Path(sys.argv[2]))))")
    proc = subprocess.run([sys.executable, "-c", code, str(core.path), str(tmp_path / "cache")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    num, compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert num == len(json.loads((kernels_dir / "index.json").read_text())["kernels"])
    assert compiled == 0, f"triton {triton.__version__}: {compiled} of {num} kernels compiled again"
    assert _files(exported[0]) == _files(exported[1])  # loading never writes into the core


def test_cli_target_auto_resolves_to_cpu_without_a_gpu(tmp_path):
    import torch
    from typer.testing import CliRunner

    from ignition.cli import app

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto resolves to it")
    src = build_tiny("llama", tmp_path / "hf")
    result = CliRunner().invoke(app, ["export", str(src), "-o", str(tmp_path / "core"), "--target", "auto"])
    assert result.exit_code == 0, result.output
    manifest = load_core(tmp_path / "core").manifest
    assert manifest.kernels == [] and manifest.dtype == "float32"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_runner_loads_precompiled_kernels_and_compiles_nothing(exported, tmp_path, monkeypatch):
    """On the GPU the export's target must be this device's (the H200: cuda-sm90)."""
    import torch

    from helios.kernels.aot import JitCounter, device_target
    from helios.runner.model_runner import ModelRunner
    from helios.switches import Switches

    if device_target("cuda") != TARGET:
        pytest.skip(f"this GPU is {device_target('cuda')}, the export targets {TARGET}")
    switches = Switches.from_environ({"HELIOS_KERNEL_CACHE": str(tmp_path / "cache")})
    core = load_core(exported[0])
    with JitCounter() as built:  # names what a failure compiled
        runner = ModelRunner.from_core(core, device="cuda", num_pages=64, max_model_len=256, switches=switches)
    assert "precompiled kernels" in runner.startup.kernels and "compiled here" not in runner.startup.kernels
    assert runner.startup.num_graphs > 0 and runner.startup.kernels_jit == 0, (runner.startup.summary(), built.names)
    with JitCounter() as jit:
        logits = runner.forward_logits(list(range(3, 40)))  # eager prefill: reshape + prefill kernels
    assert torch.isfinite(logits).all() and jit.names == []


def _missing_launches(family: str, dtype: str, root: str) -> list[str]:
    """The kernels (by name) that a tiny core's decode graphs launch, traced on meta tensors (aot_trace.trace_decode),
    and aot_shapes.run_launchers' hand-kept list does not; run where Triton compiles (no TRITON_INTERPRET)."""
    from helios.kernels._triton import forced_pdl
    from helios.kernels.aot import launch_keys, run_launchers, shape_from_manifest
    from helios.runner.aot_trace import trace_decode

    options = {"sliding_window": 4} if family == "gemma3" else {}
    src = build_tiny(family, Path(root) / "hf", **options)
    manifest = load_core(export_core(src, Path(root) / "core", ExportOptions(dtype=dtype, context_length=256))).manifest
    shape = shape_from_manifest(manifest)

    def listed():
        for pdl in (False, True):  # as compile_kernels: both forms of each one-row launch on sm90
            with forced_pdl(pdl):
                run_launchers(shape, "cpu")

    def traced():
        with forced_pdl(None):
            assert trace_decode(manifest)

    return sorted(name for name, _ in launch_keys(traced) - launch_keys(listed))


HAND_LISTED = [(family, dtype) for family in ("llama", "qwen3", "gemma3") for dtype in ("float32", "bfloat16")]


@pytest.fixture(scope="module")
def missing_launches(tmp_path_factory) -> dict[str, list[str]]:
    """{"family/dtype": _missing_launches(...)} for every HAND_LISTED case, from one subprocess (the tests interpret
    Triton; one torch and Triton import for the six cases)."""
    root = tmp_path_factory.mktemp("hand_listed")
    code = ("import json, sys; from tests.ignition.test_aot import HAND_LISTED, _missing_launches; "
            "print('MISSING ' + json.dumps({f'{f}/{d}': _missing_launches(f, d, f'{sys.argv[1]}/{f}-{d}') "
            "for f, d in HAND_LISTED}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("MISSING ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[8:])


@pytest.mark.parametrize(("family", "dtype"), HAND_LISTED)
def test_hand_listed_launches_cover_the_traced_decode_graphs(family, dtype, missing_launches):
    """The llama decoder's kernels are listed by hand (aot_shapes.run_launchers), not traced: every launch of the
    family's decode graphs must be among them, or capture compiles it on the GPU (session 24: the tiny gemma3
    core's post-norms, which multiply in float32, were missing)."""
    assert missing_launches[f"{family}/{dtype}"] == []
