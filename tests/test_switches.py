"""helios.switches: every HELIOS_* execution switch declared once, read from an environment mapping once,
validated (one clear error), described in one line; and no module below the runner reads one itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helios.switches import DECLARED, DEFAULT_SWITCHES, SwitchError, Switches

ROOT = Path(__file__).resolve().parents[1]


def test_nothing_set_is_the_declared_defaults():
    assert Switches.from_environ({}) == DEFAULT_SWITCHES == Switches()
    assert (DEFAULT_SWITCHES.gemv, DEFAULT_SWITCHES.pdl, DEFAULT_SWITCHES.l2_prefetch) == ("narrow", None, "off")
    on = ("gemv_pdl", "rope_table", "decode_overlap", "fold_norms", "fused_decode", "defer_norms")
    assert all(getattr(DEFAULT_SWITCHES, name) is True for name in on)
    assert DEFAULT_SWITCHES.kernel_cache is None
    # unset and empty are the same; unrelated variables are ignored
    assert Switches.from_environ({"HELIOS_PDL": "", "HELIOS_GEMV": " ", "PATH": "/bin"}) == DEFAULT_SWITCHES


def test_every_declared_switch_maps_to_a_field_and_back():
    fields = set(Switches.__struct_fields__)
    assert {s.field for s in DECLARED} == fields and len(DECLARED) == len(fields)
    assert all(s.env.startswith("HELIOS_") and s.meaning for s in DECLARED)


@pytest.mark.parametrize("environ, field, value", [
    ({"HELIOS_GEMV": "all"}, "gemv", "all"), ({"HELIOS_GEMV": "1"}, "gemv", "all"),
    ({"HELIOS_GEMV": "0"}, "gemv", "off"), ({"HELIOS_GEMV": "NoWide"}, "gemv", "nowide"),
    ({"HELIOS_PDL": "1"}, "pdl", True), ({"HELIOS_PDL": "off"}, "pdl", False),
    ({"HELIOS_GEMV_PDL": "0"}, "gemv_pdl", False), ({"HELIOS_ROPE_TABLE": "false"}, "rope_table", False),
    ({"HELIOS_DECODE_OVERLAP": "0"}, "decode_overlap", False), ({"HELIOS_FOLD_NORMS": "no"}, "fold_norms", False),
    ({"HELIOS_FUSED_DECODE": "0"}, "fused_decode", False), ({"HELIOS_DEFER_NORMS": "0"}, "defer_norms", False),
    ({"HELIOS_L2_PREFETCH": "bulk"}, "l2_prefetch", "bulk"), ({"HELIOS_L2_PREFETCH": "0"}, "l2_prefetch", "off"),
    ({"HELIOS_KERNEL_CACHE": "/tmp/k"}, "kernel_cache", "/tmp/k"),
    ({"HELIOS_MOE_PREFILL": "grouped"}, "moe_prefill", "grouped"), ({"HELIOS_MOE_DECODE": "gemv"}, "moe_decode", "gemv"),
    ({"HELIOS_PINNED_UPLOAD": "1"}, "pinned_upload", True), ({"HELIOS_HOST_THREADS": "on"}, "host_threads", True),
])
def test_each_variable_sets_its_switch(environ, field, value):
    assert getattr(Switches.from_environ(environ), field) == value


@pytest.mark.parametrize("environ, words", [
    ({"HELIOS_GEMV": "wide"}, ["HELIOS_GEMV='wide'", "narrow", "nowide"]),
    ({"HELIOS_PDL": "maybe"}, ["HELIOS_PDL='maybe'", "1/true/on/yes/0/false/off/no"]),
    ({"HELIOS_L2_PREFETCH": "yes"}, ["HELIOS_L2_PREFETCH='yes'", "bulk", "load"]),
])
def test_a_bad_value_is_one_error_naming_the_variable_and_what_it_accepts(environ, words):
    with pytest.raises(SwitchError) as err:
        Switches.from_environ(environ)
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


def test_describe_is_one_line_with_every_switch():
    line = DEFAULT_SWITCHES.describe()
    assert "\n" not in line and line.startswith("switches: ")
    assert "gemv=narrow pdl=norm-free gemv_pdl=on" in line and "kernel_cache=default" in line
    assert all(f"{s.field}=" in line for s in DECLARED)
    assert "pdl=off" in Switches(pdl=False).describe() and "l2_prefetch=bulk" in Switches(l2_prefetch="bulk").describe()


def test_no_runtime_module_reads_a_helios_switch_from_the_environment():
    """The runner, models, layers and kernels get switches as arguments (STYLE.md rule 17): none of them mentions
    os.environ / os.getenv next to a HELIOS_ name, and helios.switches imports nothing heavy."""
    for pkg in ("runner", "models", "layers", "kernels"):
        for path in sorted((ROOT / "helios" / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("HELIOS_"):
                    raise AssertionError(f"{path.relative_to(ROOT)} names {node.value}")
    imports = {n.module for n in ast.walk(ast.parse((ROOT / "helios" / "switches.py").read_text()))
               if isinstance(n, ast.ImportFrom) and n.module}
    assert not {i for i in imports if i.split(".")[0] in ("torch", "numpy", "triton", "helios")}
