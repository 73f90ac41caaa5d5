"""The weights upload on CUDA (helios.runner.upload): through pinned staging buffers, bitwise the same as `t.to("cuda")`
for the mixed host tensors of tests/runner/test_upload.py (mmap-backed safetensors among them), and move_tensors'
cast rule the same as casting after the plain copy.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from helios.core.load import _map_safetensors
from helios.runner.model_runner import move_tensors
from helios.runner.upload import upload_tensors
from tests.runner.test_upload import mixed_tensors, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("buffer_bytes,num_buffers,num_threads",
                         [(4096, 2, 0), (4096, 3, 1), (1 << 20, 4, 2), (64 << 20, 4, 2)])
def test_upload_matches_plain_copy(tmp_path, buffer_bytes, num_buffers, num_threads):
    tensors = mixed_tensors(tmp_path)
    big = {"big.a": torch.randn(1537, 1031).to(torch.bfloat16), "big.b": torch.randn(3, 1 << 20)}
    save_file(big, tmp_path / "big.safetensors")
    tensors.update(_map_safetensors(tmp_path / "big.safetensors"))  # several MB each: spans 1 MB buffers
    out = upload_tensors(tensors, "cuda", buffer_bytes=buffer_bytes, num_buffers=num_buffers,
                         num_threads=num_threads)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].device.type == "cuda", name
        assert same_bits(out[name], t.to("cuda")), name
        if name != "transposed":
            assert out[name].is_contiguous(), name


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("float32_norms", [False, True])
def test_move_tensors_cast_rule(tmp_path, float32_norms, pinned):
    tensors = {k: v for k, v in mixed_tensors(tmp_path).items() if v.is_floating_point()}
    out = move_tensors(tensors, torch.device("cuda"), torch.float16, float32_norms, pinned)
    keep = float32_norms and any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors.values())
    for name, t in tensors.items():
        t = t.to("cuda")
        want = t if t.dtype == torch.float16 or (keep and t.dtype == torch.float32) else t.to(torch.float16)
        assert same_bits(out[name], want), name
