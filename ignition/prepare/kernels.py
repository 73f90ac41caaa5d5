"""Kernel precompile: the core's Triton kernels for one GPU target, written into kernels/<target>/.

The kernels are helios' code and ignition imports no helios runtime, so the compile runs in a subprocess
(`python -m helios.runner.aot_compile compile`), which also gives it a clean Triton environment: no interpreter,
a private cache dir. No GPU is needed: Triton compiles for the named target with its bundled ptxas.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from helios.core import digest_stamps
from helios.core.manifest import MANIFEST_FILE, KernelTarget, Manifest, encode_manifest
from ignition.errors import ExportError

KERNELS_DIR = "kernels"


def resolve_target(target: str) -> str:
    """'auto' -> cuda-sm<cc> of the visible GPU, else cpu; anything else is checked and returned."""
    if target == "auto":
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"cuda-sm{major}{minor}"
        return "cpu"
    if target != "cpu" and not re.fullmatch(r"cuda-sm\d+", target):
        raise ExportError(f"unknown target '{target}' (choose auto, cpu, or cuda-sm<NN> such as cuda-sm90)")
    return target


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONHASHSEED"] = "0"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def compile_kernels(manifest: Manifest, target: str, out_dir: Path) -> tuple[KernelTarget, int]:
    """Compile into out_dir (Triton's cache layout + index.json); raises ExportError with Triton's reason."""
    with tempfile.TemporaryDirectory(prefix="ignition-kernels-") as tmp:
        manifest_path = Path(tmp) / MANIFEST_FILE
        manifest_path.write_bytes(encode_manifest(manifest))
        cmd = [sys.executable, "-m", "helios.runner.aot_compile", "compile", "--manifest", str(manifest_path),
               "--target", target, "--out", str(Path(out_dir).resolve())]  # resolved here: cwd is tmp
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExportError(f"kernel precompile for {target} failed: {last}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return KernelTarget(target=target, triton_version=result["triton_version"],
                        dir=f"{KERNELS_DIR}/{target}"), result["kernels"]


def add_kernels(core_dir: Path, target: str) -> KernelTarget:
    """Compile the kernels of the core at core_dir for target, move them into kernels/<target>/ and rewrite
    the manifest (kernel target + the new files' digests, in the writer's order)."""
    from helios.core.manifest import decode_manifest
    from ignition.write import digest_files

    # NOTE: absolute: the compile runs in a subprocess in its own directory, where a relative staging path named
    # another place (`ignition export ... -o core` left kernels/<target>/ empty, its manifest claiming a target)
    core_dir = Path(core_dir).resolve()
    manifest = decode_manifest((core_dir / MANIFEST_FILE).read_bytes())
    dest = core_dir / KERNELS_DIR / target
    staging = Path(tempfile.mkdtemp(prefix=".kernels-", dir=core_dir.parent))
    try:
        kernel_target, _ = compile_kernels(manifest, target, staging)
        dest.parent.mkdir(exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(staging), dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for p in [dest.parent, dest, *dest.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    new_files = digest_files(core_dir, under=dest)
    for entry in new_files:  # hashed and not written since (helios/core/digest_stamps.py)
        digest_stamps.stamp_written(core_dir / entry.path, entry.sha256)
    kept = [f for f in manifest.files if not f.path.startswith(f"{KERNELS_DIR}/{target}/")]
    files = sorted(kept + new_files, key=lambda f: Path(f.path))  # digest_files' order
    kernels = sorted([k for k in manifest.kernels if k.target != target] + [kernel_target], key=lambda k: k.target)
    import msgspec

    final = msgspec.structs.replace(manifest, kernels=kernels, files=files)
    tmp = core_dir / f".{MANIFEST_FILE}.tmp"
    tmp.write_bytes(encode_manifest(final))
    os.chmod(tmp, 0o644)
    os.replace(tmp, core_dir / MANIFEST_FILE)
    return kernel_target
