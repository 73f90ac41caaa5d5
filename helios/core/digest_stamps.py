"""Stat stamps of verified core files: a file hashed once to its manifest digest is not hashed again while its stat
is unchanged.

helios serve checks every file of the core against its sha256 at every start (beside the load, helios/compose.py):
for an 8B core that is 16 GB of hashing, ~1.7 s past the rest of the load on an H100 host (issue 22's cold start).
A stamp records, under the digest's name in <cache>/helios/digests, the (device, inode, size, mtime_ns, ctime_ns)
of a file whose whole content hashed to that digest; a file whose stat still equals a stamp of its digest is taken
as verified. Any write to a file moves its mtime and ctime (ctime cannot be set back without moving the system
clock), a copy is another inode, so a corrupted or modified file is hashed and refused as before.

NOTE: timestamps have a granularity (a clock tick; 2 s on FAT), so a write in the same tick as the last one before
hashing would leave the stat unchanged. As git does for racily clean entries, a stamp is recorded only for a file
last written at least RACY_S before its hashing began: any later write lands on a later timestamp. ignition export
stamps the files it wrote and hashed the same way (most of an export's bytes, its weights, are written long before
its end, so the first start after an export hashes little).

Pure Python (no torch): ignition and helios both use it. A cache that cannot be written costs only the stamps.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

RACY_S = 2.0  # a stamp needs the file's last write this long before its hashing began
MAX_STAMPS = 8  # per digest: copies of one file (the same tokenizer in several cores) each keep theirs
BLOCK = 1 << 22


def stamp_dir() -> Path:
    """<$XDG_CACHE_HOME or ~/.cache>/helios/digests (HELIOS_DIGEST_STAMPS overrides it)."""
    explicit = os.environ.get("HELIOS_DIGEST_STAMPS")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "helios" / "digests"


def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _stamps(digest: str) -> list[str]:
    try:
        return (stamp_dir() / digest).read_text().split()
    except (OSError, UnicodeDecodeError):
        return []


def is_stamped(path: Path, digest: str) -> bool:
    """Whether `path` was hashed to `digest` and not written since."""
    try:
        key = _key(os.stat(path))
    except OSError:
        return False
    return key in _stamps(digest)


def record(path: Path, digest: str, before: os.stat_result, started: float) -> bool:
    """Stamp `path` as hashed to `digest`: `before` is its stat when the hashing began at `started` (time.time()).
    Recorded only if the stat is unchanged since and the file's last write lies RACY_S before `started`; returns
    whether it was."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    key = _key(now)
    if key != _key(before) or before.st_mtime_ns > (started - RACY_S) * 1e9:
        return False
    kept = [k for k in _stamps(digest) if k != key][-(MAX_STAMPS - 1):] + [key]
    folder = stamp_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{digest[:16]}.", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(kept) + "\n")
        os.replace(tmp, folder / digest)
    except OSError:
        return False
    return True


def sha256(path: Path, expected: str | None = None) -> str:
    """The file's sha256 (the one file hasher of helios and ignition's core writer); `expected` when the file
    carries a stamp of it (no read). A file that hashes to `expected` is stamped for the next time."""
    if expected is not None and is_stamped(path, expected):
        return expected
    before, started = os.stat(path), time.time()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    digest = h.hexdigest()
    if digest == expected:
        record(path, digest, before, started)
    return digest


def stamp_written(path: Path, digest: str) -> bool:
    """Stamp a file this process wrote and hashed to `digest` (ignition export, after its last change to the file:
    the digest, the chmod)."""
    try:
        before = os.stat(path)
    except OSError:
        return False
    return record(path, digest, before, time.time())
