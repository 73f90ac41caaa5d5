"""The import rules of DESIGN.md, checked on the source (ast), so a violation fails CI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH_ALLOWED = ("helios/runner/", "helios/models/", "helios/layers/", "helios/kernels/", "helios/core/load.py")
# package -> helios packages it must not import
FORBIDDEN = {
    "helios/core": {"engine", "runner", "models", "layers", "kernels", "frontend", "output", "server"},
    "helios/engine": {"runner", "models", "layers", "kernels", "frontend", "output", "server"},
    "helios/kernels": {"core", "engine", "runner", "models", "layers", "frontend", "output", "server"},
    "helios/layers": {"engine", "runner", "models", "frontend", "output", "server"},
    "helios/models": {"engine", "runner", "kernels", "frontend", "output", "server"},  # kernels through layers
    "helios/runner": {"frontend", "output", "server"},
    "helios/frontend": {"runner", "models", "layers", "kernels", "server"},
    "helios/output": {"runner", "models", "layers", "kernels", "server"},
    "helios/server": {"runner", "models", "layers", "kernels"},
}
# the engine's public surface: what crosses the boundary (messages) and its handle; the rest is engine internals
ENGINE_PUBLIC = ("helios.engine.messages", "helios.engine.async_engine")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _files("helios"), ids=lambda p: str(p.relative_to(ROOT)))
def test_helios_imports(path: Path):
    rel = path.relative_to(ROOT).as_posix()
    imports = _imports(path)
    assert not {i for i in imports if i.split(".")[0] in ("ignition", "transformers")}, rel
    heavy = {i for i in imports if i.split(".")[0] in ("torch", "numpy", "triton")}
    if not rel.startswith(TORCH_ALLOWED):
        assert not heavy, f"{rel} imports {sorted(heavy)}"
    for pkg, banned in FORBIDDEN.items():
        if rel.startswith(pkg + "/"):
            bad = {i for i in imports if i.startswith("helios.") and i.split(".")[1] in banned}
            assert not bad, f"{rel} imports {sorted(bad)}"
    if rel.startswith(("helios/server/", "helios/frontend/", "helios/output/")):
        internal = {i for i in imports if i.startswith("helios.engine.") and i not in ENGINE_PUBLIC}
        assert not internal, f"{rel} imports engine internals {sorted(internal)}"


@pytest.mark.parametrize("path", _files("ignition"), ids=lambda p: str(p.relative_to(ROOT)))
def test_ignition_uses_only_helios_core(path: Path):
    bad = {i for i in _imports(path) if i.startswith("helios.") and not i.startswith("helios.core")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
