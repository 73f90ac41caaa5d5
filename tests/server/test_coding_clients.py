"""Codex and Claude Code, non-interactive, on inspect / edit / fix tasks in a temporary git repository.

`make test` runs them against a local `helios serve` of the scripted agent core (tests.fixtures.scripted_clients:
a tiny model trained to answer these tasks with tool calls, so each completes the same way every run). The
executables are the qualified versions, installed by `make clients` (clients/package-lock.json: Codex 0.162.1 and
Claude Code 2.1.296) into clients/node_modules/.bin; a missing one fails the test (FLARE_SKIP_CLIENT_TESTS=1 skips
them on purpose). Against another service (a real model, qualification):

    FLARE_RUN_CLIENT_TESTS=1 FLARE_API_TEST_URL=http://127.0.0.1:8000 \\
      .venv/bin/python -m pytest tests/server/test_coding_clients.py -q

FLARE_API_TEST_KEY is the serving key (a dummy otherwise). Other client versions on PATH run when
clients/node_modules has none, but are not qualified. No client reaches beyond 127.0.0.1: every run has a dead
HTTP(S) proxy for anything else, and the settings below turn off telemetry, update checks and plugin syncs.

Each test checks the outcome on disk, never the prose: inspection (answer contains a value only the file holds,
tree untouched), editing (the asked change, nothing else), test execution (the bug fixed, the test unchanged,
pytest green).

Codex (Responses route): the shipped clients/codex/config.toml and models.json, copied into a temporary
CODEX_HOME with the served model's id, context (max_model_len) and URL: provider "flare" (wire_api
"responses"), web_search "disabled", plugins and analytics off, approval "never", sandbox "workspace-write"; the
catalog entry gives the context window, the freeform apply_patch custom tool and the unified exec shell.
  Run: `codex exec --cd REPO --sandbox workspace-write --skip-git-repo-check --output-last-message FILE PROMPT`.
Claude Code (Messages route), configured by environment (README: "Claude Code"), with a temporary
CLAUDE_CONFIG_DIR: ANTHROPIC_BASE_URL = URL, ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN = the key,
ANTHROPIC_MODEL and the default opus/sonnet/haiku models = the served id, CLAUDE_CODE_MAX_OUTPUT_TOKENS within
the served context (its default, 32000, is a 400 on any smaller context), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC.
  Run: `claude [--bare] -p PROMPT --permission-mode acceptEdits --max-turns 30 --output-format stream-json
  --verbose --include-partial-messages --allowedTools "Read,Edit,Write,Glob,Grep,Bash(python -m pytest:*),Bash(pytest:*)"` in REPO
  (--allowedTools is variadic, so it goes last); the stream's per-turn usage shows the second turn's prompt
  reuse (>= 90% cached on the scripted core). --bare skips hooks, plugins, MCP, memory and CLAUDE.md discovery.
Both clients find this checkout's .venv/bin first on PATH, so `python -m pytest` works inside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tomli_w

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "clients"
CLIENT_BIN = CLIENTS / "node_modules" / ".bin"
EXTERNAL = os.environ.get("FLARE_RUN_CLIENT_TESTS") == "1"
URL = os.environ.get("FLARE_API_TEST_URL", "").rstrip("/") if EXTERNAL else ""
KEY = os.environ.get("FLARE_API_TEST_KEY", "") if EXTERNAL else ""
DUMMY_KEY = "flare-no-key"  # clients refuse an empty key; an unauthenticated server ignores it
TIMEOUT_S = float(os.environ.get("FLARE_CLIENT_TEST_TIMEOUT", "900" if EXTERNAL else "180"))
QUALIFIED = {"codex": "0.162.1", "claude": "2.1.296"}
DEAD_PROXY = "http://127.0.0.1:9"  # the discard port: any request past 127.0.0.1 fails at once

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("FLARE_SKIP_CLIENT_TESTS") == "1", reason="FLARE_SKIP_CLIENT_TESTS=1"),
    pytest.mark.skipif(EXTERNAL and not URL, reason="FLARE_RUN_CLIENT_TESTS=1 needs FLARE_API_TEST_URL"),
]

# --- the project the clients work on ------------------------------------------------------------------

CODENAME = "heliotrope-4127"  # only settings.py holds it: an answer containing it read the file
FILES = {
    ".gitignore": "__pycache__/\n.pytest_cache/\n",
    "calc.py": '"""Small arithmetic helpers."""\n\n\ndef add(a, b):\n    """Return the sum of a and b."""\n'
               "    return a - b\n",
    "test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                    "def test_add_negative():\n    assert add(-4, 1) == -3\n",
    "greet.py": 'def greeting(name):\n    return "Hello, " + name + "!"\n',
    "settings.py": f'RELEASE_CODENAME = "{CODENAME}"\n',
}
PROMPTS = {
    "inspect": "Read settings.py and reply with the exact value of RELEASE_CODENAME. Do not modify any file.",
    "edit": 'In greet.py, change the greeting word "Hello" to "Howdy". Do not change anything else.',
    "fix": "Run the tests with `python -m pytest -q`. They fail because of a bug in calc.py. Fix the bug in "
           "calc.py without changing test_calc.py, then run the tests again to confirm that they pass.",
}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def _pytest(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=repo,
                          capture_output=True, text=True, timeout=120)


def _changed(repo: Path) -> list[str]:
    """Paths that differ from the initial commit, new files included (.gitignore hides caches)."""
    return sorted(line[3:] for line in _git(repo, "status", "--porcelain", "--untracked-files=all").splitlines())


@pytest.fixture
def project(tmp_path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH")
    repo = tmp_path / "project"
    repo.mkdir()
    for name, text in FILES.items():
        (repo / name).write_text(text, encoding="utf-8")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=Flare", "-c", "user.email=flare@example.invalid", "commit", "-q", "-m", "init")
    assert _pytest(repo).returncode == 1  # the bug is real before any client runs
    return repo


# --- the service --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    url: str
    key: str  # the real key, or DUMMY_KEY on an unauthenticated endpoint
    model: str
    max_model_len: int
    input_modalities: list[str]
    local: bool  # the scripted agent core this module serves


def _card(url: str, key: str) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    [card] = r.json()["data"]
    return card


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    if URL:
        card = _card(URL, KEY)
        yield Served(URL, KEY or DUMMY_KEY, card["id"], card["max_model_len"], card["flare"]["input_modalities"],
                     local=False)
        return
    from tests.fixtures.scripted_clients import MODEL_ID, export_client_core
    from tests.server.conftest import _stop, serve_core

    tmp = tmp_path_factory.mktemp("scripted-clients")
    core = export_client_core(tmp / "core").core
    config = tmp / "server.toml"
    config.write_text("[server]\naliases = []\n", encoding="utf-8")
    proc, url = serve_core(core, config, tmp / "serve.log")
    try:
        card = _card(url, "")
        assert card["id"] == MODEL_ID
        yield Served(url, DUMMY_KEY, card["id"], card["max_model_len"], card["flare"]["input_modalities"],
                     local=True)
    finally:
        _stop(proc)


def _executable(name: str) -> str:
    """The client from clients/node_modules (make clients), else from PATH; missing: the test fails."""
    exe = CLIENT_BIN / name
    if exe.is_file():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not installed: run `make clients` (npm ci --prefix clients), or set "
                    "FLARE_SKIP_CLIENT_TESTS=1 to skip the client tests")
    return found


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # python -m pytest in the repo
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        env[name] = DEAD_PROXY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


@dataclass
class Run:
    client: str
    version: str
    returncode: int
    stdout: str
    stderr: str
    final: str  # the last agent message
    turns: list[dict]  # per model response, its usage (Claude Code's stream-json); empty for Codex

    def describe(self) -> str:
        return (f"{self.client} {self.version} (qualified: {QUALIFIED[self.client.split('-')[0]]}) exited "
                f"{self.returncode}\n--- final ---\n{self.final[-2000:]}\n--- stdout ---\n{self.stdout[-4000:]}\n"
                f"--- stderr ---\n{self.stderr[-4000:]}")


def _version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, env=_env())
    return (out.stdout or out.stderr).strip()


# --- Codex: HTTP Responses provider --------------------------------------------------------------------


def codex_home(s: Served, home: Path) -> Path:
    """The shipped config and catalog, pointed at the served model (its id, context and URL)."""
    home.mkdir()
    config = tomllib.loads((CLIENTS / "codex" / "config.toml").read_text(encoding="utf-8"))
    catalog = json.loads((CLIENTS / "codex" / "models.json").read_text(encoding="utf-8"))
    [info] = catalog["models"]
    info.update(slug=s.model, display_name=s.model, context_window=s.max_model_len,
                max_context_window=s.max_model_len, input_modalities=s.input_modalities)
    info["truncation_policy"]["limit"] = min(info["truncation_policy"]["limit"], s.max_model_len // 8)
    config.update(model=s.model, model_context_window=s.max_model_len)
    config["model_providers"]["flare"]["base_url"] = s.url + "/v1"
    (home / config["model_catalog_json"]).write_text(json.dumps(catalog, indent=2), encoding="utf-8")
    (home / "config.toml").write_text(tomli_w.dumps(config), encoding="utf-8")
    return home


def run_codex(s: Served, repo: Path, prompt: str, work: Path) -> Run:
    home = codex_home(s, work / "codex-home")
    last = work / "codex-last-message.txt"
    exe = _executable("codex")
    args = [exe, "exec", "--cd", str(repo), "--sandbox", "workspace-write", "--skip-git-repo-check",
            "--output-last-message", str(last), prompt]
    out = subprocess.run(args, cwd=repo, env=_env(CODEX_HOME=str(home), FLARE_API_KEY=s.key),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S)
    final = last.read_text(encoding="utf-8") if last.is_file() else out.stdout
    return Run("codex", _version(exe), out.returncode, out.stdout, out.stderr, final, [])


# --- Claude Code: Anthropic Messages ------------------------------------------------------------------

CLAUDE_TOOLS = "Read,Edit,Write,Glob,Grep,Bash(python -m pytest:*),Bash(pytest:*)"


def claude_env(s: Served, config: Path) -> dict[str, str]:
    """The settings README's "Claude Code" section documents."""
    return _env(
        ANTHROPIC_BASE_URL=s.url,
        ANTHROPIC_API_KEY=s.key,
        ANTHROPIC_AUTH_TOKEN=s.key,
        ANTHROPIC_MODEL=s.model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=s.model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=s.model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=s.model,
        ANTHROPIC_SMALL_FAST_MODEL=s.model,
        # its default output budget (32000) exceeds a small local context: over-context requests are 400s
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(min(32000, s.max_model_len // 4)),
        CLAUDE_CONFIG_DIR=str(config),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",  # telemetry, error reports, update checks
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )


def _stream(stdout: str) -> tuple[str, list[dict]]:
    """stream-json lines -> (the result text, each model response's final usage, in order).

    NOTE: the final usage is message_delta's (--include-partial-messages passes the raw events through):
    message_start reports the whole prompt with zero cache reads, as the spec has it."""
    final, usages = "", []
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("type") == "result":
            final = event.get("result") or ""
        elif event.get("type") == "stream_event" and (event.get("event") or {}).get("type") == "message_delta":
            usages.append(event["event"].get("usage") or {})
    return final, usages


def run_claude(s: Served, repo: Path, prompt: str, work: Path, bare: bool) -> Run:
    config = work / "claude-config"
    config.mkdir()
    exe = _executable("claude")
    args = [exe, *(["--bare"] if bare else []), "-p", prompt, "--permission-mode", "acceptEdits",
            "--max-turns", "30", "--output-format", "stream-json", "--verbose", "--include-partial-messages",
            "--allowedTools", CLAUDE_TOOLS]
    env = claude_env(s, config) | {"CLAUDE_CODE_MAX_RETRIES": "1"}  # a failing server fails fast, not after minutes
    out = subprocess.run(args, cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    final, turns = _stream(out.stdout)
    return Run("claude-bare" if bare else "claude", _version(exe), out.returncode, out.stdout, out.stderr, final,
               turns)


RUNNERS = {
    "codex": run_codex,
    "claude": lambda s, repo, prompt, work: run_claude(s, repo, prompt, work, bare=False),
    "claude-bare": lambda s, repo, prompt, work: run_claude(s, repo, prompt, work, bare=True),
}


# --- outcomes on disk ---------------------------------------------------------------------------------


def check_inspect(repo: Path, run: Run) -> None:
    assert CODENAME in run.final, run.describe()
    assert _changed(repo) == [], run.describe()


def check_edit(repo: Path, run: Run) -> None:
    assert _changed(repo) == ["greet.py"], run.describe()
    text = (repo / "greet.py").read_text(encoding="utf-8")
    assert "Howdy" in text and "Hello" not in text, text
    said = subprocess.run([sys.executable, "-c", "from greet import greeting; print(greeting('Ada'))"], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert said.stdout.strip() == "Howdy, Ada!", (said.stdout, said.stderr)


def check_fix(repo: Path, run: Run) -> None:
    assert _changed(repo) == ["calc.py"], run.describe()  # the test itself is untouched
    result = _pytest(repo)
    assert result.returncode == 0, result.stdout + result.stderr + "\n" + run.describe()


CHECKS = {"inspect": check_inspect, "edit": check_edit, "fix": check_fix}


@pytest.mark.parametrize("task", list(PROMPTS))
@pytest.mark.parametrize("client", list(RUNNERS))
def test_client_task(client, task, served, project, tmp_path):
    run = RUNNERS[client](served, project, PROMPTS[task], tmp_path)
    assert run.returncode == 0, run.describe()
    CHECKS[task](project, run)
    if not served.local:
        return
    from tests.fixtures.scripted_clients import SCRIPT

    script = SCRIPT[client.split("-")[0]][task]  # the scripted agent took exactly its scripted path
    assert run.final.strip() == script[-1], run.describe()
    if client.startswith("claude"):
        assert len(run.turns) == len(script), (run.turns, run.describe())
        # the follow-up turn reuses the first turn's prompt (the prefix cache, page-granular)
        second = run.turns[1]
        prompt = second["input_tokens"] + second["cache_read_input_tokens"]
        assert second["cache_read_input_tokens"] >= 0.9 * prompt, (run.turns, run.describe())


def test_script_matches_the_tasks():
    """The scripted agent answers these very prompts (its template renders the task text verbatim)."""
    from tests.fixtures.scripted_clients import CODENAME as SCRIPTED_CODENAME, PROMPTS as SCRIPTED

    assert SCRIPTED == PROMPTS and SCRIPTED_CODENAME == CODENAME
