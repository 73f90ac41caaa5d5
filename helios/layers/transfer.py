"""Host values onto the device without a stream synchronization.

NOTE: torch.tensor(values, device=cuda) and .to(cuda) of a pageable host tensor synchronize the stream: the host
waits for every kernel queued before the copy, then the GPU waits for the host to launch what follows. Made once a
layer (a mixed step's decode rows, a per-sequence index), that serialized host and GPU in every layer; made before
the draw, it cost the decode overlap its speculative step. Through pinned memory with non_blocking the copy queues
behind that work; the caching host allocator keeps the pinned copy until its transfer has run. On the CPU (and on
meta tensors) these are the plain conversions."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` (CUDA: through pinned memory, asynchronously)."""
    device = torch.device(device)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def device_tensor(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype) on `device`, as to_device moves it."""
    return to_device(torch.tensor(values, dtype=dtype), device)
