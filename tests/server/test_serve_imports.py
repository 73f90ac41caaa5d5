"""What `helios serve`'s processes import: the HTTP processes never torch (the engine boundary is data only), and
no process transformers (helios never reads an HF config at serve time).

A real server on the default core, started with a `sitecustomize` on PYTHONPATH that every process of it runs
(the engine process, its spawned HTTP processes): it logs each import of the watched packages with the process's
role, so a lazy import on any path (start-up, the first request) shows up, not only the modules' top levels.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.server.conftest import CORE, _stop, serve_core

WATCHED = ("torch", "transformers", "granian")  # granian: proof that the hook ran in the HTTP processes

SITECUSTOMIZE = f'''
import os, sys

class _ImportLog:
    """Logs the first import of each watched package in this process: pid, role, name."""

    def find_spec(self, name, path=None, target=None):
        if name in {WATCHED!r}:
            # a multiprocessing spawn child (helios' HTTP processes) runs with --multiprocessing-fork (orig_argv:
            # spawn then sets sys.argv to the parent's)
            role = "http" if "--multiprocessing-fork" in sys.orig_argv else "main"
            with open(os.environ["HELIOS_IMPORT_LOG"], "a") as f:
                f.write(f"{{os.getpid()}} {{role}} {{name}}\\n")
        return None

sys.meta_path.insert(0, _ImportLog())
'''


@pytest.fixture(scope="module")
def imports(tmp_path_factory) -> list[tuple[str, str, str]]:
    """(pid, role, package) of every watched import of a server that started and answered one completion."""
    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    tmp = tmp_path_factory.mktemp("serve-imports")
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    log = tmp / "imports.log"
    config = tmp / "helios.toml"
    config.write_text("[server]\nkv_cache_tokens = 4096\n", encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:  # the server's processes inherit this environment
        mp.setenv("PYTHONPATH", str(hook))
        mp.setenv("HELIOS_IMPORT_LOG", str(log))
        proc, url = serve_core(CORE, config, tmp / "serve.log")
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
    finally:
        _stop(proc)
    return [tuple(line.split()) for line in Path(log).read_text().splitlines()]


def test_http_processes_import_no_torch(imports):
    http = {name for _, role, name in imports if role == "http"}
    assert "granian" in http, f"no HTTP process ran the import hook: {imports}"
    assert "torch" not in http, "an HTTP process imported torch (the engine boundary must stay data only)"
    assert "torch" in {name for _, role, name in imports if role == "main"}, imports  # the engine process does


def test_serve_imports_no_transformers(imports):
    assert not [i for i in imports if i[2] == "transformers"], f"helios serve imported transformers: {imports}"
