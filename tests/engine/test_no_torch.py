"""helios.engine is pure Python: it imports with torch, numpy and triton blocked."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "helios" / "engine"
BLOCKED = ("torch", "numpy", "triton")


def test_engine_imports_with_torch_blocked():
    modules = sorted(p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__")
    assert {"async_engine", "block_pool", "config", "engine_core", "messages", "prefix_cache", "request",
            "scheduler"} <= set(modules)
    code = "\n".join(
        [
            "import sys",
            *(f"sys.modules[{name!r}] = None" for name in BLOCKED),
            "import helios.engine",
            *(f"import helios.engine.{m}" for m in modules),
            f"leaked = [m for m in sys.modules if m.split('.')[0] in {BLOCKED!r} and sys.modules[m] is not None]",
            "assert not leaked, leaked",
        ]
    )
    root = ENGINE.parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_engine_sources_never_import_torch():
    for path in ENGINE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in BLOCKED, f"{path.name} imports {name}"
