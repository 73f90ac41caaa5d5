"""The host tier's disk records: one file per KV page, named by its page hash, in a directory of one core's KV.

A record is the page of every layer of a HostKVStore slot, [num_layers][2, page_size, num_kv_heads, head_dim] (an MLA
layer's [1, page_size, latent]), raw bytes. Which records exist and which the plan moves is the engine's business
(helios/engine/host_cache.py); this module only writes, reads, deletes and lists files. record_dir() names the
directory by the KV's identity, so records of another model, dtype, page size or layout are never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from helios.runner.host_cache import HostKVStore

_HASH_HEX = 64  # the engine's page hashes are 32 bytes


def record_dir(base: Path | str, manifest, dtype: torch.dtype, page_size: int) -> Path:
    """`base`/<16 hex>: sha256 over the core's weight digests, the KV dtype, the page size and the KV layout."""
    arch = manifest.arch
    identity = {
        "files": sorted((f.path, f.sha256) for f in manifest.files),
        "dtype": str(dtype),
        "page_size": page_size,
        "kv": [arch.num_layers, arch.num_kv_heads, arch.head_dim],
    }
    return Path(base) / hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


class DiskKVStore:
    def __init__(self, directory: Path | str, host: HostKVStore):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.record_bytes = sum(layer[:, 0].numel() * layer.element_size() for layer in host.layers)

    def list_records(self) -> list[bytes]:
        """Hashes of the complete records here, least recently written first; other files are ignored."""
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            if len(name) != _HASH_HEX or not entry.is_file():
                continue
            try:
                block_hash = bytes.fromhex(name)
                st = entry.stat()
            except (ValueError, OSError):
                continue
            if st.st_size == self.record_bytes:
                found.append((st.st_mtime_ns, block_hash))
        return [h for _, h in sorted(found)]

    def spill(self, spills: list[tuple[int, bytes]]) -> None:
        """(slot, hash): the slot's record into its file. Written to a temporary name, then renamed: a crash
        never leaves a torn record under a hash. On CUDA the caller has synchronized the stream (the slot may
        have been written by an asynchronous copy-out).

        NOTE: a failed write (a full disk) is a warning, not an error: the record is simply absent, and the load
        that later misses it fails its step, which recomputes those pages."""
        for slot, block_hash in spills:
            data = torch.cat([layer[:, slot].reshape(-1).view(torch.uint8) for layer in self.host.layers])
            path = self._path(block_hash)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(memoryview(data.numpy()))
                os.replace(tmp, path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                warnings.warn(f"host disk tier: record {path.name} not written: {exc}", stacklevel=2)

    def drop(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            try:
                self._path(block_hash).unlink(missing_ok=True)
            except OSError as exc:  # a stale file is harmless: the index no longer names it
                warnings.warn(f"host disk tier: record {block_hash.hex()} not deleted: {exc}", stacklevel=2)

    def load(self, loads: list[tuple[bytes, int]]) -> None:
        """(hash, slot): files into slots. A missing or short file raises OSError (the runner fails the step, the
        engine forgets the records and recomputes), so wrong KV is never served."""
        for block_hash, slot in loads:
            with open(self._path(block_hash), "rb") as f:
                data = bytearray(f.read(self.record_bytes + 1))
            if len(data) != self.record_bytes:
                raise OSError(f"disk record {block_hash.hex()} has {len(data)} bytes, not {self.record_bytes}")
            flat = torch.frombuffer(data, dtype=torch.uint8)
            offset = 0
            for layer in self.host.layers:
                record = layer[:, slot]
                n = record.numel() * record.element_size()
                record.copy_(flat[offset : offset + n].view(layer.dtype).view(record.shape))
                offset += n

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / block_hash.hex()
