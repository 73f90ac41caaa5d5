"""JSON Schemas generated from the msgspec Structs: `python -m helios.schemas DIR` writes them
(the core manifest and the helios.toml server configuration).

tests/core/test_schemas.py fails when a committed schema is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helios.core.manifest import json_schema as manifest_schema
from helios.server.config import json_schema as server_config_schema

SCHEMAS = {"core.schema.json": manifest_schema, "helios-config.schema.json": server_config_schema}


def render(name: str) -> str:
    return json.dumps(SCHEMAS[name](), indent=2, sort_keys=True) + "\n"


def write_all(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SCHEMAS:
        path = directory / name
        path.write_text(render(name), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "schemas")):
        print(p)
