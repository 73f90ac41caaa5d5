"""helios.kernels.triton_warmup: the thread a GPU server starts beside torch's import leaves Triton's per-process
key computed (what every kernel load's first compile would compute), without importing torch itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helios.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def test_the_warmup_computes_tritons_key_without_torch():
    code = ("import sys; from helios.kernels import triton_warmup; triton_warmup.start().join(); "
            "from triton.runtime.cache import triton_key; "
            "print(triton_key.cache_info().currsize, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-2:] == ["1", "False"], out.stdout + out.stderr
