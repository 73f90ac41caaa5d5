"""helios.kernels.aot_install: a core's kernels copied into the runtime cache in Triton's layout, without torch; a
second install (the kernel load's, after the warm-up thread's) finds everything in place and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helios.kernels.aot_install import INDEX_FILE, install_cache


def _kernels(root):
    """A kernels/<target>/ dir as ignition writes it: an index and, per kernel, its files under its cache key dir."""
    entries = []
    for key, name in (("KEYA", "_a_kernel"), ("KEYB", "_b_kernel")):
        (root / key).mkdir(parents=True)
        (root / key / f"{name}.cubin").write_bytes(os.urandom(64))
        (root / key / f"{name}.json").write_text(json.dumps({"name": name}))
        entries.append({"dir": key, "files": [f"{name}.cubin", f"{name}.json"]})
    (root / INDEX_FILE).write_text(json.dumps({"target": "cuda-sm90", "kernels": entries}))
    return root


def test_install_copies_each_kernel_with_its_group_file_and_a_second_install_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    kernels = _kernels(tmp_path / "core" / "kernels" / "cuda-sm90")
    cache_dir, index = install_cache(kernels, tmp_path / "cache", activate=False)
    assert "TRITON_CACHE_DIR" not in os.environ and len(index["kernels"]) == 2
    assert cache_dir.parent == tmp_path / "cache"
    for entry in index["kernels"]:
        dest = cache_dir / entry["dir"]
        for name in entry["files"]:
            assert (dest / name).read_bytes() == (kernels / entry["dir"] / name).read_bytes()
        group = json.loads((dest / f"__grp__{entry['files'][1]}").read_text())
        assert group == {"child_paths": {n: str(dest / n) for n in entry["files"]}}
    before = {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*")}
    again, _ = install_cache(kernels, tmp_path / "cache")  # the kernel load's: activates
    assert again == cache_dir and os.environ["TRITON_CACHE_DIR"] == str(cache_dir)
    assert {p: p.stat().st_mtime_ns for p in cache_dir.rglob("*")} == before  # nothing rewritten, no temporaries


def test_install_imports_no_torch(tmp_path):
    kernels = _kernels(tmp_path / "kernels")
    code = ("import sys; from pathlib import Path; from helios.kernels.aot_install import install_cache; "
            f"install_cache(Path({str(kernels)!r}), Path({str(tmp_path / 'cache')!r}), activate=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout + out.stderr
