"""Deterministic core writer: safetensors weights, tokenizer, template, manifest with file digests.

Everything goes into a temporary sibling directory that is renamed into place only when complete, so a
failed export never leaves a half-written core. Same inputs give the same bytes: tensors in sorted
order, JSON headers with sorted keys, no timestamps, no absolute paths.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import torch

from helios.core import digest_stamps, layout
from helios.core.manifest import FileDigest, Manifest, encode_manifest, MANIFEST_FILE
from ignition.errors import ExportError

ALIGN = 64  # header padding so the tensor data region starts cache-line aligned
SHARD_BYTES = 4 << 30
# the header region a shard reserves before its data: the header is written into it at close (padded with spaces to
# fill it), so the data is written once; a header that outgrows it moves the data behind a larger one (_prepend)
HEADER_BYTES = 1 << 18
COPY_CHUNK = 1 << 24  # bytes moved at a time when the header goes in front of a shard's data

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32"}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy of a contiguous CPU tensor (the view keeps it alive)."""
    t = t.detach().contiguous().cpu()
    # view as uint8 so bfloat16 (which numpy lacks) serializes too
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class _ShardWriter:
    """Streams tensors one at a time into safetensors shards (data behind a reserved header region, the header
    written into it at close)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.shards: list[tuple[Path, dict]] = []
        self._open_new()

    def _open_new(self) -> None:
        self._data_path = self.directory / f".data-{len(self.shards)}"
        self._data = open(self._data_path, "wb")
        self._data.seek(HEADER_BYTES)
        self._entries: dict = {}
        self._offset = 0

    def add(self, name: str, t: torch.Tensor) -> int:
        if t.dtype not in _ST_DTYPES:
            raise ExportError(f"tensor {name}: dtype {t.dtype} cannot be stored")
        data = _tensor_bytes(t)
        size = data.nbytes
        if self._offset and self._offset + size > SHARD_BYTES:
            self._close_current()
            self._open_new()
        self._entries[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self._offset, self._offset + size],
        }
        self._data.write(data)
        self._offset += size
        return size

    def _close_current(self) -> None:
        self._data.close()
        self.shards.append((self._data_path, self._entries))

    def finish(self) -> list[str]:
        self._close_current()
        names = []
        count = len(self.shards)
        for i, (data_path, entries) in enumerate(self.shards):
            name = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            header = dict(entries)
            header["__metadata__"] = {"format": "pt", "producer": "flare-ignition"}
            raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
            out_path = self.directory / name
            if 8 + len(raw) <= HEADER_BYTES:
                # pad with spaces (allowed by the format) to the reserved region: the data stays where it is
                raw += b" " * (HEADER_BYTES - 8 - len(raw))
                with open(data_path, "r+b") as f:
                    f.write(len(raw).to_bytes(8, "little") + raw)
                os.replace(data_path, out_path)
            else:
                raw += b" " * ((-(8 + len(raw))) % ALIGN)  # the data at an ALIGN boundary
                _prepend(len(raw).to_bytes(8, "little") + raw, data_path, out_path, skip=HEADER_BYTES)
            names.append(name)
        return names


def _prepend(head: bytes, data_path: Path, out_path: Path, chunk: int = COPY_CHUNK, skip: int = 0) -> None:
    """Write head followed by data_path's bytes from offset `skip` to out_path, consuming data_path as it goes.

    The data moves from its end backwards, truncating the source behind each chunk, so an export
    needs the disk for its weights plus one chunk, not twice the weights (a 16 GB core would
    otherwise need 32 GB free at the end of its write).
    """
    size = data_path.stat().st_size
    with open(data_path, "r+b") as src, open(out_path, "wb") as out:
        out.write(head)
        end = size
        while end > skip:
            start = max(skip, end - chunk)
            src.seek(start)
            block = src.read(end - start)
            out.seek(len(head) + start - skip)
            out.write(block)
            out.flush()
            src.truncate(start)
            end = start
    data_path.unlink()


def digest_files(root: Path, under: Path | None = None) -> list[FileDigest]:
    """The digest of every file under `under` (None: all of root but the manifest), its path relative to root, in
    path order; hashed side by side (hashlib leaves the GIL for large blocks: a core's shards at the disk's or the
    cores' pace, not one core's)."""
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(p for p in (under or root).rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(files)))) as pool:
        digests = list(pool.map(digest_stamps.sha256, files))
    return [FileDigest(path=p.relative_to(root).as_posix(), size=p.stat().st_size, sha256=d)
            for p, d in zip(files, digests)]


def write_core(
    out_dir: Path,
    manifest: Manifest,
    tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]],
    tokenizer_json: str,
    template: str | None,
    dtype: torch.dtype,
    on_tensor: Callable[[str], None] | None = None,
    force: bool = False,
) -> Path:
    """Write a complete core at out_dir (atomically). The manifest's files list is filled here."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise ExportError(f"{out_dir} already exists (use --force to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        weights = tmp / layout.WEIGHTS_DIR
        weights.mkdir()
        writer = _ShardWriter(weights)
        for name, produce in tensors:
            t = produce()
            kept = getattr(produce, "keep_float32", False) and t.dtype == torch.float32  # transforms.keep_float32
            writer.add(name, t.to(dtype) if t.is_floating_point() and not kept else t)
            if on_tensor:
                on_tensor(name)
        writer.finish()
        (tmp / layout.TOKENIZER_FILE).write_text(_canonical_json(tokenizer_json), encoding="utf-8")
        if template is not None:
            (tmp / layout.TEMPLATE_FILE).write_text(template, encoding="utf-8")
        final = msgspec.structs.replace(manifest, files=digest_files(tmp))
        (tmp / MANIFEST_FILE).write_bytes(encode_manifest(final))
        for p in [tmp, *tmp.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for entry in final.files:  # hashed above and not written since: helios serve need not hash them again
        digest_stamps.stamp_written(out_dir / entry.path, entry.sha256)
    return out_dir


def _canonical_json(text: str) -> str:
    # NOTE: re-serialized with sorted keys so equal tokenizers give equal bytes whatever their source.
    return json.dumps(json.loads(text), ensure_ascii=False, sort_keys=True, indent=None, separators=(",", ":"))
