"""The server, frontend and output packages import (and the app builds) with torch unavailable."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules['torch'] = None  # any import of torch now fails
import helios.cli, helios.server.app, helios.server.protocols.openai_chat, helios.server.protocols.openai_completions
import helios.frontend.chat, helios.frontend.sampling, helios.frontend.tokenizer
import helios.output.processor
assert 'numpy' not in sys.modules, 'numpy imported'
print('ok')
"""


def test_imports_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
