"""Stat stamps of verified core files (helios/core/digest_stamps.py): a file hashed to its digest and unchanged since
is not read again; a fresh file is never stamped; any write afterwards makes it hashed (and refused) again."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from helios.core import digest_stamps


@pytest.fixture(autouse=True)
def stamps(tmp_path, monkeypatch):
    folder = tmp_path / "stamps"
    monkeypatch.setenv("HELIOS_DIGEST_STAMPS", str(folder))
    return folder


def old_file(path, data: bytes, age: float = 60.0):
    path.write_bytes(data)
    past = time.time() - age
    os.utime(path, (past, past))
    return path, hashlib.sha256(data).hexdigest()


def no_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the file was read")

    monkeypatch.setattr(digest_stamps, "open", refuse, raising=False)


def test_a_hashed_file_is_not_read_again_while_unchanged(tmp_path, monkeypatch, stamps):
    path, digest = old_file(tmp_path / "w.bin", os.urandom(1 << 16))
    assert digest_stamps.sha256(path, digest) == digest
    assert [p.name for p in stamps.iterdir()] == [digest]
    no_reads(monkeypatch)
    assert digest_stamps.sha256(path, digest) == digest


def test_a_fresh_file_is_hashed_but_not_stamped(tmp_path):
    """Written less than RACY_S before its hashing: a write in the same timestamp tick could go unseen."""
    data = os.urandom(4096)
    path = tmp_path / "fresh.bin"
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    assert digest_stamps.sha256(path, digest) == digest
    assert not digest_stamps.is_stamped(path, digest)
    assert not digest_stamps.stamp_written(path, digest)


def test_a_write_after_the_stamp_is_hashed_and_refused(tmp_path):
    """Same size, mtime set back to the stamped one: the ctime still moved, so the file is read and mismatches."""
    path, digest = old_file(tmp_path / "w.bin", bytes(8192))
    assert digest_stamps.sha256(path, digest) == digest and digest_stamps.is_stamped(path, digest)
    st = os.stat(path)
    time.sleep(0.02)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\x01")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not digest_stamps.is_stamped(path, digest)
    assert digest_stamps.sha256(path, digest) != digest


def test_a_copy_is_another_file_and_stamps_of_one_digest_are_kept_per_copy(tmp_path, monkeypatch):
    data = os.urandom(2048)
    a, digest = old_file(tmp_path / "a.bin", data)
    b, _ = old_file(tmp_path / "b.bin", data)
    digest_stamps.sha256(a, digest)
    assert not digest_stamps.is_stamped(b, digest)
    digest_stamps.sha256(b, digest)
    assert digest_stamps.is_stamped(a, digest) and digest_stamps.is_stamped(b, digest)
    c, _ = old_file(tmp_path / "c.bin", os.urandom(2048))
    assert digest_stamps.sha256(c, digest) != digest and not digest_stamps.is_stamped(c, digest)


def test_an_unwritable_stamp_folder_costs_only_the_stamps(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HELIOS_DIGEST_STAMPS", str(blocker / "stamps"))
    path, digest = old_file(tmp_path / "w.bin", b"x" * 100)
    assert digest_stamps.sha256(path, digest) == digest
    assert not digest_stamps.is_stamped(path, digest)


def test_an_exported_core_is_stamped_and_served_without_hashing(tmp_path, monkeypatch, stamps):
    """ignition export stamps the files it wrote long enough before its end (here: all of them); the
    digest check of helios serve then reads none of them, and a weight modified afterwards is refused."""
    from helios.core.load import CoreError, load_core, start_digest_check
    from ignition.export import export_core
    from tests.ignition.tiny_models import build_tiny

    checkpoint = build_tiny("llama", tmp_path / "hf")
    monkeypatch.setattr(digest_stamps, "RACY_S", 0.0)  # as if the export had written its files long before its end
    core_path = export_core(checkpoint, tmp_path / "core")
    core = load_core(core_path, verify_digests=False)
    assert all(digest_stamps.is_stamped(core_path / f.path, f.sha256) for f in core.manifest.files)
    with monkeypatch.context() as m:
        no_reads(m)
        start_digest_check(core_path, core.manifest)()
    time.sleep(0.05)  # past the clock tick of the stamps (the racy window RACY_S normally keeps)
    weights = next(core_path.glob("weights/*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(CoreError, match="sha256"):
        start_digest_check(core_path, core.manifest)()
