"""helios.runner.early_upload through the real CUDA driver: the bytes torch adopts are the files', a runner built on
an early upload gives the tokens of one that uploaded its own weights, and what nobody claims goes back to the device."""

from __future__ import annotations

import pytest
import torch

from helios.core.load import load_core
from helios.runner import early_upload
from helios.runner.early_upload import EarlyUpload
from helios.runner.upload import adopt_early
from tests.runner.test_early_upload import write_core

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("mode", ["pinned", "pageable"])
def test_torch_adopts_the_files_bytes(tmp_path, mode):
    tensors = write_core(tmp_path)
    upload = EarlyUpload(tmp_path, 0, mode, num_threads=3, buffer_bytes=1024).start()
    assert upload.wait(), upload.error
    out = adopt_early(upload, tensors, torch.device("cuda"), {"b": torch.bfloat16})
    assert set(out) == {n for n, t in tensors.items() if t.numel()}
    for name, got in out.items():
        want = tensors[name].to("cuda")
        want = want.to(torch.bfloat16) if name == "b" else want
        assert got.device.type == "cuda" and got.dtype == want.dtype and torch.equal(got, want), name
    assert upload.memory == {}  # released


def test_unclaimed_memory_goes_back(tmp_path):
    from safetensors.torch import save_file

    from helios.core import layout

    (tmp_path / layout.WEIGHTS_DIR).mkdir(parents=True)
    save_file({"w": torch.zeros(256 << 20, dtype=torch.uint8)}, str(tmp_path / layout.WEIGHTS_DIR / "w.safetensors"))
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    upload = EarlyUpload(tmp_path, 0).start()
    assert upload.wait(), upload.error
    assert torch.cuda.mem_get_info()[0] <= free0 - (256 << 20)
    upload.release()
    assert torch.cuda.mem_get_info()[0] >= free0 - (8 << 20)


@pytest.mark.parametrize("mode", ["pinned", "pageable"])
def test_runner_on_an_early_upload_gives_the_same_tokens(tmp_path, mode, monkeypatch):
    from ignition.export import ExportOptions, export_core
    from helios.runner.model_runner import ModelRunner
    from tests.ignition.tiny_models import build_tiny

    src = build_tiny("llama", tmp_path / "hf")
    core = load_core(export_core(src, tmp_path / "core", ExportOptions(dtype="bfloat16")))
    prompt = list(range(3, 40))
    plain = ModelRunner.from_core(core, device="cuda", num_pages=64, max_model_len=256)
    want = plain.forward_logits(prompt)
    assert plain.startup.early_upload == ""
    del plain
    monkeypatch.setattr(early_upload, "_current", None)
    early_upload.start(core.path, 0, mode=mode)
    runner = ModelRunner.from_core(core, device="cuda", num_pages=64, max_model_len=256)
    assert runner.startup.early_upload.startswith(mode), runner.startup.summary()
    assert torch.equal(runner.forward_logits(prompt), want)
