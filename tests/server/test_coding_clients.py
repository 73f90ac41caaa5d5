"""Client qualification: Codex and Claude Code, non-interactive, against a running service.

    FLARE_API_TEST_URL=http://127.0.0.1:8000 FLARE_RUN_CLIENT_TESTS=1 \\
      .venv/bin/python -m pytest tests/server/test_coding_clients.py -q

Skipped unless FLARE_RUN_CLIENT_TESTS=1 and FLARE_API_TEST_URL are set; each test also skips when its own
executable (`codex`, `claude`) is not on PATH. FLARE_API_TEST_KEY is the serving key (a dummy otherwise).
Qualified versions: Codex 0.162.1 and Claude Code 2.1.296; other versions run but are not qualified.

Each test builds a temporary git repository (a module with a bug and its failing pytest test, a module to edit,
a settings file to read), runs one client on one task, and checks the outcome on disk, never the prose:
inspection (answer contains a value only the file holds, tree untouched), editing (the asked change, nothing
else), test execution (the bug fixed, the test unchanged, pytest green).

Codex (Responses route), configured in a temporary CODEX_HOME:
  config.toml: model = the served id, model_provider "flare" {base_url = URL/v1, env_key, wire_api =
  "responses"}, web_search = "disabled" (no hosted search), model_catalog_json, model_context_window = the
  served max_model_len, approval_policy "never", sandbox_mode "workspace-write".
  The catalog (ModelsResponse {"models": [ModelInfo]}) describes the served model: context_window =
  max_model_len, apply_patch_tool_type "freeform", shell_type "shell_command", input_modalities from the card.
  Run: `codex exec --cd REPO --sandbox workspace-write --skip-git-repo-check --output-last-message FILE PROMPT`.
Claude Code (Messages route), configured by environment, with a temporary CLAUDE_CONFIG_DIR:
  ANTHROPIC_BASE_URL = URL, ANTHROPIC_API_KEY and ANTHROPIC_AUTH_TOKEN = the key (the same value, so the
  x-api-key and bearer headers agree), ANTHROPIC_MODEL and the default opus/sonnet/haiku models = the served id,
  CLAUDE_CODE_MAX_OUTPUT_TOKENS within the served context.
  Run: `claude [--bare] -p PROMPT --permission-mode acceptEdits --max-turns 30 --output-format text
  --allowedTools "Read,Edit,Write,Glob,Grep,Bash(python -m pytest:*),Bash(pytest:*)"` in REPO (--allowedTools
  is variadic, so it goes last). --bare skips hooks, plugins, MCP, memory and CLAUDE.md discovery and reads
  the key only from ANTHROPIC_API_KEY.
Both clients find this checkout's .venv/bin first on PATH, so `python -m pytest` works inside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tomli_w

ROOT = Path(__file__).resolve().parents[2]
URL = os.environ.get("FLARE_API_TEST_URL", "").rstrip("/")
KEY = os.environ.get("FLARE_API_TEST_KEY", "")
DUMMY_KEY = "flare-no-key"  # clients refuse an empty key; an unauthenticated server ignores it
TIMEOUT_S = float(os.environ.get("FLARE_CLIENT_TEST_TIMEOUT", "900"))
QUALIFIED = {"codex": "0.162.1", "claude": "2.1.296"}

pytestmark = pytest.mark.skipif(
    os.environ.get("FLARE_RUN_CLIENT_TESTS") != "1" or not URL,
    reason="needs FLARE_RUN_CLIENT_TESTS=1 and FLARE_API_TEST_URL",
)

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


@pytest.fixture(scope="module")
def served() -> Served:
    headers = {"Authorization": f"Bearer {KEY}"} if KEY else {}
    r = httpx.get(URL + "/v1/models", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    [card] = r.json()["data"]
    return Served(URL, KEY or DUMMY_KEY, card["id"], card["max_model_len"], card["flare"]["input_modalities"])


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # python -m pytest in the repo
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

    def describe(self) -> str:
        return (f"{self.client} {self.version} (qualified: {QUALIFIED[self.client.split('-')[0]]}) exited "
                f"{self.returncode}\n--- final ---\n{self.final[-2000:]}\n--- stdout ---\n{self.stdout[-4000:]}\n"
                f"--- stderr ---\n{self.stderr[-4000:]}")


def _version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    return (out.stdout or out.stderr).strip()


# --- Codex: HTTP Responses provider --------------------------------------------------------------------

CODEX_INSTRUCTIONS = (
    "You are a coding agent running in the Codex CLI in the user's repository. Inspect files and run commands "
    "with the shell tool, and edit files with apply_patch. Make only the changes the user asks for, verify "
    "them when asked, and finish with a short answer."
)


def _codex_catalog(s: Served) -> dict:
    """One ModelInfo for the served model: its context limit and the freeform apply_patch tool."""
    return {"models": [{
        "slug": s.model,
        "display_name": s.model,
        "description": "Local model served by Flare helios",
        "supported_reasoning_levels": [],
        "shell_type": "shell_command",
        "visibility": "list",
        "supported_in_api": True,
        "priority": 0,
        "upgrade": None,
        "base_instructions": CODEX_INSTRUCTIONS,
        "model_messages": None,
        "supports_reasoning_summaries": False,
        "default_reasoning_summary": "none",
        "support_verbosity": False,
        "default_verbosity": None,
        "apply_patch_tool_type": "freeform",
        "truncation_policy": {"mode": "tokens", "limit": min(10000, s.max_model_len // 8)},
        "supports_parallel_tool_calls": False,
        "supports_image_detail_original": False,
        "supports_search_tool": False,
        "context_window": s.max_model_len,
        "max_context_window": s.max_model_len,
        "effective_context_window_percent": 95,
        "experimental_supported_tools": [],
        "input_modalities": s.input_modalities,
        "prefer_websockets": False,
        "use_responses_lite": False,
    }]}


def _codex_config(s: Served, catalog: Path) -> dict:
    return {
        "model": s.model,
        "model_provider": "flare",
        "model_catalog_json": str(catalog),
        "model_context_window": s.max_model_len,
        "approval_policy": "never",
        "sandbox_mode": "workspace-write",
        "web_search": "disabled",
        "check_for_update_on_startup": False,
        "model_providers": {"flare": {
            "name": "Flare",
            "base_url": s.url + "/v1",
            "env_key": "FLARE_API_KEY",
            "wire_api": "responses",
        }},
    }


def run_codex(s: Served, repo: Path, prompt: str, work: Path) -> Run:
    home = work / "codex-home"
    home.mkdir()
    catalog = home / "flare-models.json"
    catalog.write_text(json.dumps(_codex_catalog(s), indent=2), encoding="utf-8")
    (home / "config.toml").write_text(tomli_w.dumps(_codex_config(s, catalog)), encoding="utf-8")
    last = work / "codex-last-message.txt"
    args = ["codex", "exec", "--cd", str(repo), "--sandbox", "workspace-write", "--skip-git-repo-check",
            "--output-last-message", str(last), prompt]
    out = subprocess.run(args, cwd=repo, env=_env(CODEX_HOME=str(home), FLARE_API_KEY=s.key),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S)
    final = last.read_text(encoding="utf-8") if last.is_file() else out.stdout
    return Run("codex", _version("codex"), out.returncode, out.stdout, out.stderr, final)


# --- Claude Code: Anthropic Messages ------------------------------------------------------------------

CLAUDE_TOOLS = "Read,Edit,Write,Glob,Grep,Bash(python -m pytest:*),Bash(pytest:*)"


def run_claude(s: Served, repo: Path, prompt: str, work: Path, bare: bool) -> Run:
    config = work / "claude-config"
    config.mkdir()
    env = _env(
        ANTHROPIC_BASE_URL=s.url,
        ANTHROPIC_API_KEY=s.key,
        ANTHROPIC_AUTH_TOKEN=s.key,
        ANTHROPIC_MODEL=s.model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=s.model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=s.model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=s.model,
        ANTHROPIC_SMALL_FAST_MODEL=s.model,
        # its default output budget can exceed a local context: explicit over-context requests are 400s
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(min(32000, s.max_model_len // 4)),
        CLAUDE_CONFIG_DIR=str(config),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )
    args = ["claude", *(["--bare"] if bare else []), "-p", prompt, "--permission-mode", "acceptEdits",
            "--max-turns", "30", "--output-format", "text", "--allowedTools", CLAUDE_TOOLS]
    out = subprocess.run(args, cwd=repo, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    return Run("claude-bare" if bare else "claude", _version("claude"), out.returncode, out.stdout, out.stderr,
               out.stdout)


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


def _client(name: str):
    """A client parameter that skips, before the service is even asked, when its executable is missing."""
    exe = name.split("-")[0]
    return pytest.param(name, marks=pytest.mark.skipif(shutil.which(exe) is None, reason=f"`{exe}` is not on PATH"))


@pytest.mark.parametrize("task", list(PROMPTS))
@pytest.mark.parametrize("client", [_client(name) for name in RUNNERS])
def test_client_task(client, task, served, project, tmp_path):
    run = RUNNERS[client](served, project, PROMPTS[task], tmp_path)
    assert run.returncode == 0, run.describe()
    CHECKS[task](project, run)
