from pathlib import Path

from helios.schemas import SCHEMAS, render

ROOT = Path(__file__).resolve().parents[2]


def test_committed_schemas_are_current():
    for name in SCHEMAS:
        committed = (ROOT / "schemas" / name).read_text(encoding="utf-8")
        assert committed == render(name), f"schemas/{name} is stale: run `make schemas`"
