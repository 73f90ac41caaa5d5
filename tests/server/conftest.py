"""A real `helios serve` subprocess on 127.0.0.1 with the default SmolLM2 core, plus a reference runner.

Two servers: `server` (bearer key, default limits) and `tight_server` (one model slot, a one-request queue and
three admission slots) for the admission status codes. Both are session-scoped; each waits for /health.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "cores" / "build" / "smollm2-135m-instruct"
API_KEY = "test-serving-key"
HELIOS = ROOT / ".venv" / "bin" / "helios"


@dataclass
class Server:
    url: str
    api_key: str
    proc: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_core(core: Path, config: Path, log: Path, extra_args: tuple[str, ...] = (),
               timeout_s: float = 180.0, poll_s: float = 0.5) -> tuple[subprocess.Popen, str]:
    """Start `helios serve` on a free port and wait for /health; (process, url). Stops it if it never answers."""
    args = [str(HELIOS), "serve", str(core), "--config", str(config), "--port", str(port := _free_port()),
            *extra_args]
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"helios serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    _stop(proc)
    raise RuntimeError(f"helios serve did not become healthy:\n{log.read_text()}")


def _start(tmp: Path, name: str, server_toml: str, api_key: str) -> Server:
    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    config = tmp / f"{name}.toml"
    config.write_text("[server]\n" + server_toml, encoding="utf-8")
    extra: tuple[str, ...] = ()
    if api_key:
        key_file = tmp / f"{name}.key"
        key_file.write_text(api_key + "\n", encoding="utf-8")
        extra = ("--api-key-file", str(key_file))
    log = tmp / f"{name}.log"
    proc, url = serve_core(CORE, config, log, extra)
    return Server(url, api_key, proc, log)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = _start(tmp_path_factory.mktemp("helios"), "main", 'aliases = []\n', API_KEY)
    yield srv
    _stop(srv.proc)


@pytest.fixture(scope="session")
def tight_server(tmp_path_factory):
    toml = "max_concurrency = 1\nmax_waiting = 1\nadmission_slots = 3\nkv_cache_tokens = 4096\n"
    srv = _start(tmp_path_factory.mktemp("helios-tight"), "tight", toml, "")
    yield srv
    _stop(srv.proc)


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def frontend():
    """The core's tokenizer and chat renderer, as the server builds them (no torch)."""
    from helios.core.load import read_manifest
    from helios.frontend.chat import ChatRenderer
    from helios.frontend.tokenizer import Tokenizer

    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    manifest = read_manifest(CORE)
    tok = Tokenizer.from_file(CORE / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    return manifest, tok, ChatRenderer((CORE / "template.jinja").read_text(), manifest.template, tok)


@pytest.fixture(scope="session")
def reference():
    """log_softmax over the full vocabulary for a token sequence, computed directly by the model runner."""
    import torch

    from helios.core.load import load_core
    from helios.runner.model_runner import ModelRunner

    core = load_core(CORE, verify_digests=False)
    runner = ModelRunner(core.manifest.arch, core.tensors, num_pages=256, page_size=core.manifest.graph_plan.page_size)

    def logprobs(token_ids: list[int]):
        return torch.log_softmax(runner.forward_logits(token_ids), dim=-1)  # [T, V]

    return logprobs


ANTHROPIC_VERSION = "2023-06-01"


@pytest.fixture(scope="session")
def anthropic_client(server):
    """The official Anthropic SDK as a user runs it: no extra headers (it sends its own newer anthropic-version,
    which the server serves with 2023-06-01 semantics)."""
    import anthropic

    with anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def core_runtime(frontend):
    """A Runtime over the real core's manifest, tokenizer and template without an engine: protocol
    `prepare` functions (decode, lowering, template, tokenize) run on it directly."""
    from helios.server.config import ServerConfig
    from helios.server.runtime import Runtime

    manifest, tok, _ = frontend
    runtime = Runtime(manifest, tok, (CORE / "template.jinja").read_text(), None, ServerConfig())
    yield runtime
    runtime.pool.shutdown(wait=False)


def fake_protocol_client(tokenizer, script, headers: dict | None = None, **config):
    """The app in-process around test_app_fake's scripted FakeEngine (`script(request) -> outputs`), with a
    template that can continue a final assistant message."""
    from helios.core.manifest import TemplateCaps
    from helios.server.app import HeliosApp
    from helios.server.config import ServerConfig
    from helios.server.runtime import Runtime
    from tests.frontend.conftest import make_manifest
    from tests.server.test_app_fake import TEMPLATE, FakeEngine

    manifest = make_manifest(tokenizer=tokenizer.info,
                             template=TemplateCaps(present=True, file="t.jinja", continuation=True))
    engine = FakeEngine(script)
    runtime = Runtime(manifest, tokenizer, TEMPLATE, engine, ServerConfig(**config))
    app = HeliosApp(runtime, warm=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", headers=headers), engine


@pytest.fixture(scope="session")
def qwen25_served(qwen25_coder_gguf, tmp_path_factory):
    """(url, core directory) of the Qwen2.5-Coder core (float32, recipe qwen25) served once for every module that
    needs the real tool-calling model: one 2 GB export, not one per module."""
    from ignition.export import ExportOptions, export_core

    tmp = tmp_path_factory.mktemp("qwen25-served")
    core = tmp / "core"
    export_core(qwen25_coder_gguf, core, ExportOptions(dtype="float32", recipe="qwen25"))
    config = tmp / "server.toml"
    config.write_text("[server]\naliases = []\n", encoding="utf-8")
    proc, url = serve_core(core, config, tmp / "serve.log")
    try:
        yield url, core
    finally:
        _stop(proc)
        shutil.rmtree(core, ignore_errors=True)  # 2 GB of float32 weights: CI's disk is shared
