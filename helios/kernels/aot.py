"""Ahead-of-time Triton kernels: compile every kernel a core's runtime path launches for a GPU target (no GPU
needed), and load them at start without compiling.

Mechanism: Triton's own on-disk cache. `compile_kernels` runs the launchers of the runtime path (`run_launchers`:
norms, rotary + cache write, gated activation, decode attention with each graph bucket's pinned split, its
merge, prefill attention) on CPU tensors laid out as the model lays them out, under a stand-in driver for the
target, with Triton's public `knobs.runtime.jit_cache_hook` intercepting each launch: the hook compiles the
exact source object the runtime would compile (`triton.compile(ASTSource(fn, signature, constants, attrs))`)
and skips the launch. The cubin and metadata of each kernel are written in Triton's cache layout
(<cache key dir>/<name>.cubin|.json) plus an index.json. `load_kernels` copies them into a writable runtime
cache dir with Triton's group files (they hold absolute paths, so they are never stored in a core), points
TRITON_CACHE_DIR at it and runs the same launchers once on small CUDA tensors: each launch is Triton's ordinary
path, which finds its cubin in the cache and compiles nothing (checked: a compile would write IR files there).
NOTE: loading never calls JITFunction.preload: a kernel preloaded from the serialized specialization could be
launched with arguments its launcher did not expect (seen on Triton 3.6 on the H200: "only integer tensors of a
single element can be converted to an index"); ordinary launches bind arguments the way every later launch does.
A different target or Triton version falls back to JIT compiling on first use, with a warning. Triton
specializes on dtypes, constexprs and the 16-divisibility of integer arguments, never on the token count, so the
plan's shapes reduce to: dtype, heads, head_dim, hidden size, page size, layer kinds (window / soft-cap), q/k
norms, activation and pinned decode splits.
Imports torch, triton (guarded) and helios.kernels (aot_shapes: what to launch); never helios.core: a manifest
arrives as an argument (read by helios.runner.aot_compile, which also holds the command line ignition runs).
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import shutil
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from helios.kernels._triton import HAS_TRITON, forced_pdl, interpret_mode, triton

if HAS_TRITON:
    import triton.runtime.jit  # noqa: F401  (JITFunction, for _relative_sources)
from helios.kernels.aot_install import INDEX_FILE, install_cache, runtime_cache_root  # noqa: F401  (re-exported)
from helios.kernels.aot_shapes import (  # noqa: F401  (re-exported: the runtime and tests import them here)
    TARGET_SMS,
    KernelShape,
    device_target,
    graph_decode_splits,
    parse_target,
    run_launchers,
    runtime_shape,
    shape_from_manifest,
)

def kernel_modules() -> list[str]:
    """Every module of helios.kernels (those a model imports on first use too): _relative_sources imports them all
    first, so a family's kernels get relative paths whether or not its model was built yet in this process."""
    import helios.kernels

    return sorted(m.name for m in pkgutil.iter_modules(helios.kernels.__path__) if m.name != "__init__")


class _TargetDriver:
    """The part of Triton's active-driver interface a hooked launch and a compile touch, for a target with no GPU."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        # NOTE: warp size 32: the CUDA target the runtime driver reports (64 is AMD's wavefront).
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def _relative_sources() -> None:
    """Point every JIT function's source file (helios' kernels and Triton's own language helpers, which get
    inlined) at a path relative to its package root, so no compiled artifact's line info carries a path of
    this machine. Triton's cache key does not include file names, so the runtime key is unchanged."""
    for name in kernel_modules():
        importlib.import_module(f"helios.kernels.{name}")
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(("helios.kernels.", "triton.language")):
            continue
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            if not isinstance(value, triton.runtime.jit.JITFunction) or fn is None:
                continue
            path = Path(fn.__code__.co_filename)
            top = module_name.split(".")[0]
            if top not in path.parts:
                continue
            rel = Path(*path.parts[len(path.parts) - 1 - path.parts[::-1].index(top) :]).as_posix()
            value.file_name = rel  # read by Triton >= 3.7's code generator
            fn.__code__ = fn.__code__.replace(co_filename=rel)  # read by 3.6's


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _compile_launched(shape: KernelShape, target, device: torch.device | str = "cpu",
                      both_pdl: bool = True, pdl: bool | None = None,
                      trace: Callable[[], object] | None = None) -> list[tuple[object, str, object]]:
    """(JIT function, specialization data, compiled kernel) of every kernel run_launchers launches, and `trace`
    (helios.runner.aot_trace: a model's decode graphs run on meta tensors) after it, compiled (or found in the
    current Triton cache) for `target`; nothing is launched (on the CPU: under the stand-in driver)."""
    from triton import knobs
    from triton.compiler import ASTSource

    wanted: dict[str, tuple[object, object, dict]] = {}

    def hook(**kwargs):
        c = kwargs["compile"]
        data = c["specialization_data"]
        if data not in wanted:
            fn = kwargs["fn"].jit_function
            # NOTE: the source object is built from the runtime's own signature/constants/attrs (not from the
            # serialized data), so its cache key is the one an ordinary launch on the device computes.
            src = ASTSource(fn, c["signature"], c["constants"], c["configs"][0])
            wanted[data] = (fn, src, {k: _tuples(v) for k, v in json.loads(data)["options"].items()})
        return True  # skip Triton's own compile and the launch

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        # one-row launches take programmatic dependent launch on sm90+ devices (pdl_allowed: the norm-free
        # layers' by default, every one or none by the pdl switch): a core holds both forms of each for such a
        # target, so any setting serves without compiling (both_pdl); at start only this process's choices are
        # built (None: each launch decides as at run time, under the process's `pdl` switch)
        for forced in sorted({False, target.arch >= 90}) if both_pdl else [None if target.arch >= 90 else False]:
            with forced_pdl(forced):
                run_launchers(shape, device, pdl)
        if trace is not None:  # its launches take PDL where the model's forward asks for it, as on the device
            with forced_pdl(None):
                trace()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return [(fn, data, kernel) for (data, (fn, _, _)), kernel in zip(sorted(wanted.items(), key=lambda kv: kv[0]),
                                                                    _compile_all(wanted, target))]


def launch_keys(launches: Callable[[], object], target: str = "cuda-sm90") -> set[tuple[str, str]]:
    """(kernel's qualified name, specialization data) of every Triton launch `launches` makes, each stopped before
    Triton compiles it (the compile hook), under the stand-in driver for `target`: on the CPU as at export. Tests
    hold the hand-kept launch list (run_launchers) to a family's traced decode graphs with it."""
    from triton import knobs
    from triton.runtime import driver

    keys: set[tuple[str, str]] = set()

    def hook(**kwargs):
        keys.add((kwargs["fn"].jit_function.fn.__qualname__, kwargs["compile"]["specialization_data"]))
        return True

    previous_driver, previous_hook = getattr(driver, "_active", None), knobs.runtime.jit_cache_hook
    driver.set_active(_TargetDriver(parse_target(target)))
    knobs.runtime.jit_cache_hook = hook
    try:
        launches()
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)
    return keys


def _compile_all(wanted: dict[str, tuple[object, object, dict]], target) -> list:
    """triton.compile of each wanted (fn, source, options), in sorted specialization order, several at a time.

    NOTE: threads: a compile spends its time in MLIR passes and a ptxas subprocess, mostly outside the GIL; the
    results do not depend on the order (each lands under its own cache key)."""
    from concurrent.futures import ThreadPoolExecutor

    items = [wanted[data] for data in sorted(wanted)]

    def build(item):
        _, src, options = item
        return triton.compile(src, target=target, options=options)

    workers = max(1, min(len(items), os.cpu_count() or 1, 16))
    if workers == 1:
        return [build(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="helios-aot") as pool:
        return list(pool.map(build, items))


def _portable(data: str) -> dict:
    """Specialization data without machine paths (libdevice is re-resolved by the loading Triton)."""
    obj = json.loads(data)
    obj["options"].pop("extern_libs", None)
    return obj


def _portable_metadata(text: str) -> str:
    meta = json.loads(text)
    if "extern_libs" in meta:
        meta["extern_libs"] = [[name, Path(path).name] for name, path in meta["extern_libs"]]
    return json.dumps(meta)


def compile_kernels(shape: KernelShape, target: str, out_dir: Path, trace: Callable[[], object] | None = None) -> dict:
    """Compile every kernel variant of `shape` for `target` into out_dir, and every kernel `trace` launches
    (helios.runner.aot_trace.decode_tracer); returns the index written there."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if interpret_mode():
        raise RuntimeError("TRITON_INTERPRET is set: kernels would be interpreted, not compiled")
    from triton import knobs
    from triton.runtime import driver

    arch = parse_target(target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="helios-aot-"))
    previous_dir = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(scratch)
    knobs.cache.dir = str(scratch)
    previous_driver = getattr(driver, "_active", None)  # None: not created yet (no GPU here, perhaps)
    stand_in = _TargetDriver(arch)
    driver.set_active(stand_in)
    entries = []
    try:
        _relative_sources()
        for fn, data, kernel in _compile_launched(shape, stand_in.target, trace=trace):
            group = {Path(p).name: Path(p) for p in kernel.metadata_group.values()}
            key_dir = next(iter(group.values())).parent.name
            name = kernel.metadata.name
            files = [f"{name}.{ext}" for ext in ("cubin", "json")]
            dest = out_dir / key_dir
            dest.mkdir(exist_ok=True)
            (dest / files[0]).write_bytes(group[files[0]].read_bytes())
            (dest / files[1]).write_text(_portable_metadata(group[files[1]].read_text()))
            entries.append({"kernel": f"{fn.fn.__module__}:{fn.fn.__qualname__}", "dir": key_dir, "files": files,
                            "specialization": _portable(data)})
    finally:
        driver.set_active(previous_driver)
        del knobs.cache.dir  # drop the override; the environment below is restored as it was
        if previous_dir is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = previous_dir
        shutil.rmtree(scratch, ignore_errors=True)
    entries.sort(key=lambda e: (e["kernel"], e["dir"]))
    index = {"target": target, "triton_version": triton.__version__, "kernels": entries}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, sort_keys=True, indent=1) + "\n")
    _check_portable(out_dir, [scratch, Path(triton.__file__).parent, Path(__file__).parents[2], Path.home()])
    return index


def _check_portable(out_dir: Path, roots: list[Path]) -> None:
    """Refuse artifacts that embed a path of this machine (a core must be byte-identical anywhere)."""
    needles = {str(r.resolve()).encode() for r in roots if str(r) not in ("", "/")}
    for path in sorted(out_dir.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            for needle in needles:
                if needle in data:
                    raise RuntimeError(f"{path.name} embeds the machine path {needle.decode()}; not reproducible")


# --- loading at start --------------------------------------------------------------------------------


@dataclass
class KernelLoad:
    """What happened to a core's precompiled kernels at start."""

    status: str  # "loaded" | "absent" | "mismatch" | "unavailable"
    target: str = ""
    num_loaded: int = 0  # kernels in the core's index
    num_compiled: int = 0  # kernels the warm launches still had to compile here (a cache key differed)
    cache_dir: Path | None = None
    messages: list[str] = field(default_factory=list)
    # seconds of each part of the load: install (copy into the runtime cache), hook (the launches through the
    # compile hook), compile (each kernel from the installed cache), launchers (modules and host stubs: load_launched)
    phases: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        if self.status == "loaded":
            extra = f", {self.num_compiled} compiled here" if self.num_compiled else ""
            phases = ", ".join(f"{name} {s:.2f}s" for name, s in self.phases.items())
            return f"{self.num_loaded} precompiled kernels ({self.target}{extra}; {phases})"
        return self.messages[0] if self.messages else self.status


def check_kernels(kernels_dir: Path, target: str, triton_version: str, want_target: str) -> str | None:
    """Why the kernels at kernels_dir cannot be used here (None when they can)."""
    if not HAS_TRITON:
        return "triton is not installed"
    if target != want_target:
        return f"kernels were compiled for {target}, this device is {want_target}"
    if triton_version != triton.__version__:
        return f"kernels were compiled with triton {triton_version}, this is triton {triton.__version__}"
    if not (Path(kernels_dir) / INDEX_FILE).is_file():
        return f"{kernels_dir} has no {INDEX_FILE}"
    return None


def _kernel_dirs(cache_dir: Path) -> set[str]:
    """Cache key dirs holding a compiled kernel. NOTE: Triton <= 3.6 also caches each launcher stub (a small C
    extension built with the host compiler, one per kernel signature) in the cache dir: not a kernel compile."""
    return {p.parent.name for p in cache_dir.glob("*/*.cubin")} if cache_dir.is_dir() else set()


def load_kernels(core_dir: Path, kernel_targets: list, device: torch.device | str, manifest, *, gemv: str = "narrow",
                 fused_decode: bool = True, defer_norms: bool = True, pdl: bool | None = None,
                 cache_root: Path | None = None, trace: Callable[[], object] | None = None) -> KernelLoad:
    """Install the core's kernels for this device and load each into Triton's in-memory cache without launching
    it (load_launched: each found in the installed cache); warn and fall back to JIT when they do not fit.
    manifest: the core's (decoded by the caller); gemv, fused_decode, defer_norms, pdl: the process's switches
    (helios.switches), which pick the kernels it launches (runtime_shape); cache_root: runtime_cache_root's answer
    for them; trace: the model's decode graphs on meta tensors (helios.runner.aot_trace.decode_tracer), whose kernels
    load the same way."""
    device = torch.device(device)
    if device.type != "cuda" or not kernel_targets:
        return KernelLoad("absent", messages=["no precompiled kernels (compiled on first use)"])
    if not HAS_TRITON or interpret_mode():
        return KernelLoad("unavailable", messages=["triton unavailable or interpreted"])
    want = device_target(device)
    chosen = next((k for k in kernel_targets if k.target == want), kernel_targets[0])
    kernels_dir = Path(core_dir) / chosen.dir
    reason = check_kernels(kernels_dir, chosen.target, chosen.triton_version, want)
    if reason is not None:
        warnings.warn(f"precompiled kernels not used: {reason}; compiling on first use", stacklevel=2)
        return KernelLoad("mismatch", target=chosen.target, messages=[reason])
    t0 = time.perf_counter()
    cache_dir, index = install_cache(kernels_dir, cache_root)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    shape = runtime_shape(shape_from_manifest(manifest, num_sms), gemv, fused_decode, defer_norms)
    before = _kernel_dirs(cache_dir)
    phases = {"install": time.perf_counter() - t0}

    def launches() -> None:  # what this process launches: the llama path's launchers, a traced family's graphs
        run_launchers(shape, device, pdl)
        if trace is not None:
            trace()

    with torch.cuda.device(device):
        try:
            load_launched(launches, phases, device)
        except Exception as exc:  # noqa: BLE001 - the warm launches still load every kernel, slower
            # NOTE: load_launched replaced the warm launches after the last device session (unmeasured there): should
            # Triton's internals differ, the start loads the kernels as it did before rather than fail
            warnings.warn(f"kernel load by the compile hook failed ({type(exc).__name__}: {exc}); warm launches "
                          "instead", stacklevel=2)
            run_launchers(shape, device, pdl)
            if trace is not None:
                load_traced(trace)
        torch.cuda.synchronize(device)
    compiled = sorted(_kernel_dirs(cache_dir) - before)
    result = KernelLoad("loaded", target=chosen.target, num_loaded=len(index["kernels"]),
                        num_compiled=len(compiled), cache_dir=cache_dir, phases=phases)
    if compiled:
        result.messages.append(f"compiled here: {compiled[:3]}")
        warnings.warn(f"{len(compiled)} kernels were not found among the precompiled ones and were compiled here",
                      stacklevel=2)
    return result


def load_offline(core_dir: Path, manifest, cache_root: Path,
                 trace: Callable[[], object] | None = None) -> tuple[int, int]:
    """What load_kernels does, under a stand-in driver for the kernels' target (no GPU needed): install them,
    run every launcher and `trace` through the compile hook; (index entries, kernels compiled because none
    matched). manifest: the core's, decoded by the caller (helios.runner.aot_compile.load_offline)."""
    from triton import knobs
    from triton.runtime import driver

    (kt,) = manifest.kernels[:1]
    cache_dir, index = install_cache(Path(core_dir) / kt.dir, cache_root)
    arch = parse_target(index["target"])
    before = _kernel_dirs(cache_dir)
    previous_driver = getattr(driver, "_active", None)
    stand_in = _TargetDriver(arch)
    driver.set_active(stand_in)
    try:
        _compile_launched(shape_from_manifest(manifest, TARGET_SMS.get(arch, 132)), stand_in.target, trace=trace)
    finally:
        driver.set_active(previous_driver)
        del knobs.cache.dir
    return len(index["kernels"]), len(_kernel_dirs(cache_dir) - before)


def _loaded_jit_functions() -> list:
    """Every JIT function of every loaded module (helios' kernels, and any other package's: fla's, behind their
    autotuners), each once. Only types are inspected (no attribute of an unknown object is read)."""
    from triton.runtime.jit import JITFunction, KernelInterface

    found: dict[int, object] = {}
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            while issubclass(type(value), KernelInterface) and not isinstance(value, JITFunction):
                value = getattr(value, "fn", None)  # an Autotuner / Heuristics wraps the JIT function as .fn
            if isinstance(value, JITFunction):
                found[id(value)] = value
    return list(found.values())


@contextmanager
def _every_launch_missing() -> Iterator[None]:
    """Inside, every loaded JIT function holds an empty in-memory cache, so that every launch reaches the compile
    hook (a kernel an earlier launch compiled would otherwise run); the caches are restored on exit. Modules
    imported inside start with empty caches anyway."""
    functions = _loaded_jit_functions()
    saved = [fn.device_caches for fn in functions]
    for fn in functions:
        fn.device_caches = defaultdict(fn.create_binder)
    try:
        yield
    finally:
        for fn, caches in zip(functions, saved):
            fn.device_caches = caches


def load_traced(trace: Callable[[], object]) -> int:
    """load_launched for a model's decode graphs traced on meta tensors (helios.runner.aot_trace)."""
    return load_launched(trace)


def load_launched(launches: Callable[[], object], phases: dict[str, float] | None = None,
                  device: torch.device | str | None = None) -> int:
    """Run `launches` (kernel launches: run_launchers' on small tensors, a model's decode graphs traced on meta
    tensors, helios.runner.aot_trace) through the compile hook, launching nothing; then compile each launch's
    kernel for this device, several at a time (each finds its cubin in the installed cache), and put it into
    Triton's in-memory cache under the launch's key, as an ordinary first launch would: later launches, graph
    captures included, then compile nothing. On a CUDA `device`, each kernel's module and launcher stub are loaded
    here too, side by side (Triton <= 3.6 builds a stub with the host compiler the first time, ~0.4 s, then
    caches it), not at its first launch. Returns how many kernels it put there; phases gets the seconds of the
    hook pass (hook), the compiles (compile) and the handles (launchers).
    NOTE: a key found in the cache mid-pass would be launched, on meta tensors' pointers: the pass runs on empty
    caches (_every_launch_missing) and the kernels go into the real ones after it. Like every compile hook here, it
    assumes no other thread launches kernels meanwhile (the runner's start: the weights upload only copies).
    NOTE: before, the start compiled every kernel from the cache (to build the stubs in parallel), then launched
    each for real to load it again through Triton's own path: ~1.2 s + 0.9 s on the 8B core (H100, session 21)."""
    from concurrent.futures import ThreadPoolExecutor

    from triton import knobs
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    found: dict[tuple[int, int, object], tuple] = {}  # (function, device, key) -> (function, compile args)

    def hook(**kwargs):
        c = kwargs["compile"]
        fn = kwargs["fn"].jit_function
        found.setdefault((id(fn), c["device"], c["key"]), (fn, c))  # keys are per function
        return True  # no compile, no launch

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        with _every_launch_missing():
            launches()
    finally:
        knobs.runtime.jit_cache_hook = previous
    todo = [(fn, dev, key, c) for (_, dev, key), (fn, c) in found.items() if key not in fn.device_caches[dev][0]]
    t1 = time.perf_counter()

    def build(item):
        fn, dev, _, c = item
        # NOTE: the source and options as _compile_launched builds them at export: the same cache key
        src = ASTSource(fn, c["signature"], c["constants"], c["configs"][0])
        options = {k: _tuples(v) for k, v in json.loads(c["specialization_data"])["options"].items()}
        return triton.compile(src, target=fn.device_caches[dev][2], options=options)

    def handles(kernel) -> None:
        with torch.cuda.device(device):
            kernel._init_handles()

    if todo:  # once, here: every thread's first compile would compute it at the same time (~0.45 s of hashing each)
        from triton.runtime.cache import triton_key

        triton_key()
    workers = max(1, min(len(todo), os.cpu_count() or 1, 16))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="helios-kernel-load") as pool:
        kernels = list(pool.map(build, todo))
        t2 = time.perf_counter()
        if device is not None and torch.device(device).type == "cuda":
            list(pool.map(handles, kernels))
    for (fn, dev, key, _), kernel in zip(todo, kernels):
        fn.device_caches[dev][0][key] = kernel
    if phases is not None:
        phases.update(hook=t1 - t0, compile=t2 - t1, launchers=time.perf_counter() - t2)
    return len(todo)


class JitCounter:
    """Counts kernels Triton had to JIT-compile (or fetch from its cache) because no warm launch loaded them."""

    def __init__(self):
        self.names: list[str] = []
        self._previous = None

    def __enter__(self) -> JitCounter:
        if HAS_TRITON and not interpret_mode():
            from triton import knobs

            self._previous = knobs.runtime.jit_cache_hook

            def hook(**kwargs):
                self.names.append(kwargs["fn"].name if hasattr(kwargs["fn"], "name") else str(kwargs["fn"]))
                return self._previous(**kwargs) if self._previous else None

            knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc) -> None:
        if HAS_TRITON and not interpret_mode():
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._previous


_jit_total = [0, False]  # JIT launches seen by the process-wide hook; whether it is installed


def kernels_jit_total() -> int:
    """Kernels Triton compiled (or fetched from its disk cache) at a launch in this process since the first call,
    which installs a process-wide jit_cache_hook (chaining whatever hook was set; JitCounter's own chain to it):
    the runner reads it after its start (RunnerStats.kernels_jit, /metrics flare_kernels_jit_total). Zero without
    a compiled Triton."""
    if not _jit_total[1] and HAS_TRITON and not interpret_mode():
        from triton import knobs

        previous = knobs.runtime.jit_cache_hook

        def hook(**kwargs):
            _jit_total[0] += 1
            return previous(**kwargs) if previous else None

        knobs.runtime.jit_cache_hook = hook
        _jit_total[1] = True
    return _jit_total[0]
