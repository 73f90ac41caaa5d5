"""Installing a core's precompiled kernels into a runtime cache dir in Triton's layout, without torch.

`install_cache` copies kernels/<target>/'s files into a writable dir named by its index's digest and writes Triton's
group files beside them (they hold absolute paths, so they are never stored in a core); with `activate` it points
TRITON_CACHE_DIR (and Triton's knobs, when Triton is imported) at it. Files already in place are neither copied nor
written again, so a second install (the kernel load after helios.kernels.triton_warmup's, which runs beside torch's
import) costs a directory walk. helios.kernels.aot re-exports what lives here.
Standard library only (Triton's knobs imported when activating).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

INDEX_FILE = "index.json"


def runtime_cache_root(kernel_cache: str | None = None) -> Path:
    """Where kernels are installed at start: the kernel_cache switch (HELIOS_KERNEL_CACHE, helios.switches) when
    set, else helios/triton under $XDG_CACHE_HOME or ~/.cache."""
    if kernel_cache:
        return Path(kernel_cache)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "helios" / "triton"


def _unique() -> str:
    """A temporary file's tag no other writer shares: two threads of a process (the warm-up's install and the
    kernel load's) or two processes may install the same kernels at once; each renames its own complete copy."""
    return f"{os.getpid()}-{threading.get_ident()}"


def _write_once(path: Path, text: str) -> None:
    """path holds text afterwards; written (through a temporary file and a rename) only when it does not yet."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{_unique()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def install_cache(kernels_dir: Path, cache_root: Path | None = None, activate: bool = True) -> tuple[Path, dict]:
    """Copy the kernels into a runtime cache dir in Triton's layout (with its group files); activate: point
    TRITON_CACHE_DIR at it. The core itself is never written (kernels compiled later land in the copy)."""
    kernels_dir = Path(kernels_dir)
    raw = (kernels_dir / INDEX_FILE).read_bytes()
    index = json.loads(raw)
    cache_dir = (cache_root or runtime_cache_root()) / hashlib.sha256(raw).hexdigest()[:16]
    for entry in index["kernels"]:
        dest = cache_dir / entry["dir"]
        dest.mkdir(parents=True, exist_ok=True)
        for name in entry["files"]:
            if not (dest / name).is_file():
                tmp = dest / f".{name}.{_unique()}.tmp"
                shutil.copyfile(kernels_dir / entry["dir"] / name, tmp)
                os.replace(tmp, dest / name)
        meta = next(n for n in entry["files"] if n.endswith(".json"))
        _write_once(dest / f"__grp__{meta}", json.dumps({"child_paths": {n: str(dest / n) for n in entry["files"]}}))
    if activate:
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
        try:
            from triton import knobs

            knobs.cache.dir = str(cache_dir)
        except (ImportError, AttributeError):
            pass
    return cache_dir, index
