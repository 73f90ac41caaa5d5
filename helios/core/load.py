"""Load a core: validate the manifest, check files against their digests, memory-map the weights.

The weights are bound straight from a private (copy-on-write) mmap: no read, no copy. A core whose
format version, files or digests disagree with its manifest raises CoreError with one clear line.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from helios.core import digest_stamps, layout
from helios.core.manifest import FORMAT_VERSION, MANIFEST_FILE, Manifest, decode_manifest

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I32": torch.int32}


class CoreError(Exception):
    """The core cannot be served; the message names what is wrong."""


@dataclass
class LoadedCore:
    path: Path
    manifest: Manifest
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest.tokenizer.file

    @property
    def template_source(self) -> str | None:
        if not self.manifest.template.present or not self.manifest.template.file:
            return None
        return (self.path / self.manifest.template.file).read_text(encoding="utf-8")


def read_manifest(path: Path) -> Manifest:
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CoreError(f"{path}: not a core (no {MANIFEST_FILE})")
    raw = manifest_path.read_bytes()
    # check the version before the full schema, so an old or new core gets the right message
    try:
        version = msgspec.toml.decode(raw).get("format_version")
    except msgspec.DecodeError as exc:
        raise CoreError(f"{manifest_path}: malformed manifest: {exc}") from None
    if version != FORMAT_VERSION:
        raise CoreError(
            f"{path}: core format version {version} is not supported (this helios reads version "
            f"{FORMAT_VERSION}); re-export it with a matching ignition"
        )
    try:
        return decode_manifest(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CoreError(f"{manifest_path}: invalid manifest: {exc}") from None


def verify_files(path: Path, manifest: Manifest, digests: bool = True) -> None:
    """Sizes always; contents by sha256 unless digests=False. Extra or missing files are errors."""
    listed = {f.path for f in manifest.files}
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    missing = sorted(listed - present)
    if missing:
        raise CoreError(f"{path}: file {missing[0]} listed in the manifest is missing")
    extra = sorted(present - listed)
    if extra:
        raise CoreError(f"{path}: file {extra[0]} is not listed in the manifest")
    for entry in manifest.files:
        file = path / entry.path
        size = file.stat().st_size
        if size != entry.size:
            raise CoreError(f"{path}: {entry.path} has {size} bytes, the manifest says {entry.size}")
    if digests:
        start_digest_check(path, manifest)()


def start_digest_check(path: Path, manifest: Manifest) -> Callable[[], None]:
    """Hash every file of the core on background threads; the returned function waits for them and raises
    CoreError on the first mismatch (in manifest order). helios serve hashes while it builds the engine (the
    weights upload, kernel load and graph capture), and serves nothing before the check has passed.

    NOTE: one thread per file (hashlib releases the GIL on large blocks): an 8B core's four 4 GiB shards hash in
    the time of one instead of four."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1, max(1, len(manifest.files))),
                              thread_name_prefix="helios-sha256")
    # a file stamped as hashed to its digest and unchanged since is not read (helios/core/digest_stamps.py)
    futures = [pool.submit(digest_stamps.sha256, Path(path) / entry.path, entry.sha256) for entry in manifest.files]
    pool.shutdown(wait=False)

    def wait() -> None:
        for entry, future in zip(manifest.files, futures):
            if future.result() != entry.sha256:
                raise CoreError(f"{path}: {entry.path} does not match its sha256 digest (corrupt or modified)")

    return wait


def _map_safetensors(file: Path, flags: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, views of one mapping of it; flags: more mmap flags (MAP_POPULATE: the
    kernel fills the mapping's page tables in the mmap call, benchmarks/gpu_core_upload.py)."""
    with open(file, "rb") as f:
        # NOTE: MAP_PRIVATE gives a writable buffer (torch.frombuffer needs one) without copying;
        # pages are shared with the page cache until written, and we never write them.
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE | flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    header_len = int.from_bytes(mm[:8], "little")
    header = json.loads(mm[8 : 8 + header_len])
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CoreError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = info["shape"]
        count = (end - start) // dtype.itemsize
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start)
        out[name] = flat.view(shape)
    return out


def load_core(path: Path, verify_digests: bool = True, map_weights: bool = True) -> LoadedCore:
    """The core at `path`: manifest read, file sizes checked, contents against their sha256 (verify_digests=False:
    the caller runs start_digest_check itself), weights memory-mapped."""
    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest, digests=verify_digests)
    core = LoadedCore(path=path, manifest=manifest)
    if map_weights:
        for file in sorted((path / layout.WEIGHTS_DIR).glob("*.safetensors")):
            core.tensors.update(_map_safetensors(file))
    return core
