"""Triton kernels of the GPU fast path and the Triton attention backend.

Each kernel file holds the kernel, its launcher (shape/stride asserts) and a pure-torch `*_ref` with the same
signature. Triton is imported only through `helios.kernels._triton` (guarded), so this package imports on a
CPU-only machine. Imports torch (and triton) only: nothing else of helios, since layers sit above kernels.
"""
