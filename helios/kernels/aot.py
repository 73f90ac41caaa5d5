"""Ahead-of-time Triton kernels: compile a core's attention kernels for a GPU target (no GPU needed), load them.

Mechanism: Triton's own on-disk cache. `compile_kernels` runs each launcher of the runtime path on CPU
tensors laid out as the model lays them out (under a stand-in driver for the target, so nothing launches),
captures Triton's specialization data through its public `knobs.runtime.jit_cache_hook`, and compiles each
with `JITFunction.preload` (i.e. `triton.compile(ASTSource(...), target=GPUTarget(...))`). The cubin and
metadata of each kernel are written in Triton's cache layout (<cache key dir>/<name>.cubin|.json) plus an
index.json of the specialization data. `load_kernels` copies them into a writable runtime cache dir, writes
Triton's group files there (they hold absolute paths, so they are never stored in a core), points
TRITON_CACHE_DIR at it and preloads every kernel: Triton finds each in its cache and compiles nothing.
A different target or Triton version falls back to JIT compiling on first use, with a warning.
Why not a launcher of our own: loading a cubin into Triton's launcher has no public API in 3.6 or 3.9; the
cache layout and preload are what Triton itself uses to skip compilation. Triton specializes on dtypes,
constexprs and the 16-divisibility of integer arguments, never on the token count, so the plan's shapes
reduce to: dtype, heads, head_dim, page size, layer kinds (window / soft-cap) and pinned decode splits.
Imports torch, triton (guarded), helios.kernels and helios.core.manifest (the plan it compiles for).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from helios.kernels._triton import HAS_TRITON, interpret_mode, triton

if HAS_TRITON:
    import triton.runtime.jit  # noqa: F401  (JITFunction, for _relative_sources)
from helios.kernels.paged_attention import choose_num_splits

INDEX_FILE = "index.json"
KERNEL_MODULES = ("_triton", "paged_attention", "prefill_attention", "reshape_and_cache")
# streaming multiprocessors assumed per target when pinning graph splits ahead of time (H100 SXM / H200)
TARGET_SMS = {90: 132, 100: 148, 80: 108}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def graph_decode_splits(bucket: int, num_kv_heads: int, max_model_len: int, num_sms: int = 132) -> int:
    """The decode split count a graph of `bucket` rows pins: sized for the longest sequence it may see.
    One rule for capture (helios.runner.cuda_graphs) and for the kernels compiled ahead of time."""
    return choose_num_splits(max_model_len, bucket, num_kv_heads, num_sms)


def parse_target(target: str) -> int:
    """'cuda-sm90' -> 90 (the GPUTarget arch)."""
    m = re.fullmatch(r"cuda-sm(\d+)", target)
    if not m:
        raise ValueError(f"unknown kernel target {target!r} (expected cuda-sm<NN>, e.g. cuda-sm90)")
    return int(m.group(1))


def device_target(device: torch.device | str) -> str:
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"cuda-sm{major}{minor}"


# --- what the runtime launches ------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionShape:
    """Everything the attention kernels of one model specialize on."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    layer_kinds: tuple[tuple[int | None, float | None], ...]  # distinct (sliding window, soft-cap)
    decode_splits: tuple[int, ...]


def shape_from_manifest(manifest, num_sms: int = 132) -> AttentionShape:
    arch, plan = manifest.arch, manifest.graph_plan
    kinds = set()
    for i in range(arch.num_layers):
        sliding = bool(arch.layer_types) and arch.layer_types[i] == "sliding"
        kinds.add((arch.sliding_window if sliding else None, arch.attn_logit_softcapping))
    context = manifest.limits.context_length
    splits = {1} | {graph_decode_splits(b, arch.num_kv_heads, context, num_sms) for b in plan.decode_buckets}
    return AttentionShape(
        dtype=_DTYPES[manifest.dtype],
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        page_size=plan.page_size,
        layer_kinds=tuple(sorted(kinds, key=repr)),
        decode_splits=tuple(sorted(splits)),
    )


def run_launchers(shape: AttentionShape) -> None:
    """Call every launcher of the runtime attention path once per variant, on CPU tensors that mirror the
    runtime layouts: q and k fresh from rotary (contiguous), v a view into the fused qkv output, the cache
    one [2, pages, page, Nkv, D] tensor, block tables 16 wide (runner/input_batch pads them so)."""
    from helios.kernels.paged_attention import paged_decode_attention
    from helios.kernels.prefill_attention import paged_prefill_attention
    from helios.kernels.reshape_and_cache import reshape_and_cache

    nq, nkv, d, dt = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype
    scale = d**-0.5
    for num_tokens in (1, 2):  # decode rows, then a two-token prefill
        qkv = torch.zeros(num_tokens, (nq + 2 * nkv) * d, dtype=dt)
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q = q.reshape(num_tokens, nq, d).clone()
        k = k.reshape(num_tokens, nkv, d).clone()
        v = v.reshape(num_tokens, nkv, d)
        kv_cache = torch.zeros(2, 4, shape.page_size, nkv, d, dtype=dt)
        reshape_and_cache(k, v, kv_cache, torch.zeros(num_tokens, dtype=torch.int64))
        block_tables = torch.zeros(1, 16, dtype=torch.int32)
        seq_lens = torch.full((1,), num_tokens, dtype=torch.int32)
        for window, softcap in shape.layer_kinds:
            if num_tokens == 1:
                for splits in shape.decode_splits:
                    paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, window, softcap, splits)
            else:
                qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
                paged_prefill_attention(q, kv_cache, qsl, seq_lens, block_tables, num_tokens, scale, window, softcap)


class _TargetDriver:
    """The part of Triton's active-driver interface a warm-up or preload touches, for a target with no GPU."""

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
    for name in KERNEL_MODULES:
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


def _capture_specializations(shape: AttentionShape) -> list[tuple[object, str]]:
    from triton import knobs

    captured: dict[str, object] = {}

    def hook(**kwargs):
        data = kwargs["compile"]["specialization_data"]
        captured.setdefault(data, kwargs["fn"].jit_function)
        return True  # skip compiling and launching: only the specialization is wanted here

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        run_launchers(shape)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return sorted(((fn, data) for data, fn in captured.items()), key=lambda item: item[1])


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


def compile_kernels(shape: AttentionShape, target: str, out_dir: Path) -> dict:
    """Compile every kernel variant of `shape` for `target` into out_dir; returns the index written there."""
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
    driver.set_active(_TargetDriver(arch))
    entries = []
    try:
        _relative_sources()
        for fn, data in _capture_specializations(shape):
            kernel = fn.preload(data)
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
    num_loaded: int = 0  # found in the cache, nothing compiled
    num_compiled: int = 0  # preloaded but compiled here (the cache key differed)
    cache_dir: Path | None = None
    messages: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.status == "loaded":
            extra = f", {self.num_compiled} recompiled" if self.num_compiled else ""
            return f"{self.num_loaded} precompiled kernels ({self.target}){extra}"
        return self.messages[0] if self.messages else self.status


def runtime_cache_root() -> Path:
    env = os.environ.get("HELIOS_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "helios" / "triton"


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


def install_cache(kernels_dir: Path, cache_root: Path | None = None) -> tuple[Path, dict]:
    """Copy the kernels into a runtime cache dir in Triton's layout (with its group files) and point
    TRITON_CACHE_DIR at it; the core itself is never written (kernels compiled later land in the copy)."""
    kernels_dir = Path(kernels_dir)
    raw = (kernels_dir / INDEX_FILE).read_bytes()
    index = json.loads(raw)
    cache_dir = (cache_root or runtime_cache_root()) / hashlib.sha256(raw).hexdigest()[:16]
    for entry in index["kernels"]:
        dest = cache_dir / entry["dir"]
        dest.mkdir(parents=True, exist_ok=True)
        for name in entry["files"]:
            if not (dest / name).is_file():
                tmp = dest / f".{name}.tmp"
                shutil.copyfile(kernels_dir / entry["dir"] / name, tmp)
                os.replace(tmp, dest / name)
        meta = next(n for n in entry["files"] if n.endswith(".json"))
        group = json.dumps({"child_paths": {n: str(dest / n) for n in entry["files"]}})
        (dest / f"__grp__{meta}").write_text(group)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    try:
        from triton import knobs

        knobs.cache.dir = str(cache_dir)
    except (ImportError, AttributeError):
        pass
    return cache_dir, index


def _jit_function(ref: str):
    module, qualname = ref.split(":")
    return getattr(importlib.import_module(module), qualname)


def load_kernels(core_dir: Path, kernel_targets: list, device: torch.device | str,
                 cache_root: Path | None = None) -> KernelLoad:
    """Install and preload the core's kernels for this device; warn and fall back to JIT when they do not fit."""
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
    cache_dir, index = install_cache(kernels_dir, cache_root)
    result = KernelLoad("loaded", target=chosen.target, cache_dir=cache_dir)
    with torch.cuda.device(device):
        for entry in index["kernels"]:
            try:
                kernel = _jit_function(entry["kernel"]).preload(json.dumps(entry["specialization"]))
            except Exception as exc:  # a kernel that cannot be preloaded is compiled on first use instead
                result.messages.append(f"{entry['kernel']}: {type(exc).__name__}: {exc}")
                result.num_compiled += 1
                continue
            hit = any(Path(p).parent.name == entry["dir"] for p in kernel.metadata_group.values())
            result.num_loaded += hit
            result.num_compiled += not hit
    if result.num_compiled:
        warnings.warn(f"{result.num_compiled} precompiled kernels did not match this Triton build and were "
                      f"compiled here: {result.messages[:1]}", stacklevel=2)
    return result


def preload_offline(kernels_dir: Path, cache_root: Path) -> tuple[int, int]:
    """Install the kernels and preload each under a stand-in driver for their target (no GPU needed):
    (found in the cache, compiled). What helios' start does on the GPU, minus loading the cubins."""
    from triton import knobs
    from triton.runtime import driver

    index = json.loads((Path(kernels_dir) / INDEX_FILE).read_bytes())
    cache_dir, _ = install_cache(kernels_dir, cache_root)
    before = sorted(p.relative_to(cache_dir) for p in cache_dir.rglob("*"))
    previous_driver = getattr(driver, "_active", None)
    driver.set_active(_TargetDriver(parse_target(index["target"])))
    found = 0
    try:
        for entry in index["kernels"]:
            kernel = _jit_function(entry["kernel"]).preload(json.dumps(entry["specialization"]))
            found += any(Path(p).parent.name == entry["dir"] for p in kernel.metadata_group.values())
    finally:
        driver.set_active(previous_driver)
        del knobs.cache.dir
    # a compile would have written IR files next to the cubins
    after = sorted(p.relative_to(cache_dir) for p in cache_dir.rglob("*"))
    compiled = len(index["kernels"]) - found + (before != after)
    return found, compiled


class JitCounter:
    """Counts kernels Triton had to JIT-compile (or fetch from its cache) because nothing preloaded them."""

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


# --- command line (run by ignition export in a subprocess) -------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helios.kernels.aot")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile a core's kernels for a GPU target")
    comp.add_argument("--manifest", type=Path, required=True, help="core.toml to compile for")
    comp.add_argument("--target", required=True, help="cuda-sm<NN>")
    comp.add_argument("--out", type=Path, required=True, help="directory to write kernels into")
    args = parser.parse_args(argv)
    from helios.core.manifest import decode_manifest

    manifest = decode_manifest(args.manifest.read_bytes())
    arch = parse_target(args.target)
    index = compile_kernels(shape_from_manifest(manifest, TARGET_SMS.get(arch, 132)), args.target, args.out)
    print(json.dumps({"kernels": len(index["kernels"]), "triton_version": index["triton_version"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
