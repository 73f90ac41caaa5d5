"""helios.kernels.triton_warmup: the thread a GPU server starts beside torch's import leaves Triton's per-process
key computed (what every kernel load's first compile would compute) and the core's kernels installed in the runtime
cache, without importing torch itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helios.kernels._triton import HAS_TRITON
from tests.kernels.test_aot_install import _kernels

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def test_the_warmup_computes_tritons_key_and_installs_the_kernels_without_torch(tmp_path):
    kernels = _kernels(tmp_path / "kernels")
    code = ("import sys; from pathlib import Path; from helios.kernels import triton_warmup; "
            f"triton_warmup.start(Path({str(kernels)!r}), Path({str(tmp_path / 'cache')!r})).join(); "
            "from triton.runtime.cache import triton_key; "
            "print(triton_key.cache_info().currsize, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-2:] == ["1", "False"], out.stdout + out.stderr
    (cache_dir,) = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in cache_dir.rglob("*.cubin")) == ["_a_kernel.cubin", "_b_kernel.cubin"]
