"""Kernel tests run in Triton's CPU interpreter here (no GPU); tests/gpu runs the same checks on CUDA.

NOTE: Triton picks interpreted vs compiled when a kernel is decorated, i.e. at the first import of a kernel
module, so the variable is set here, before any test module of this folder imports helios.kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

