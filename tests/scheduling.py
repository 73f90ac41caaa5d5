"""How `make test` spreads the suite over CI's two cores (pytest-xdist, `-n 2 --dist loadgroup`).

Work units: a test module's tests stay on one worker (its module fixtures are built once), and modules that use
one of SHARED_FIXTURES are joined into one unit, so each of those session fixtures is built by one worker only:
the GGUF oracles (tests/conftest.py's GgufOracle: 20-60 s each, and the release after the last marked test, which
holds only where every marked test runs in one process), SmolLM2's HF model, the served Qwen2.5-Coder core (a 2 GB
float32 export and a server) and the default core's two servers.
Order: the costliest unit first (longest-processing-time first), each unit's cost from tests/durations.json
(seconds per module of a whole run; a module not listed counts DEFAULT_TEST_S a test), so the last units to
start are short and the two workers finish together.

`--dist loadgroup` selects this scheduler (pytest_xdist_make_scheduler below); `make test TEST_WORKERS=0` runs the
suite in one process as before. Refresh the figures after big changes: `FLARE_STORE_DURATIONS=$PWD/tests/durations.json
make test` writes them at the end of a whole run (a run of part of the suite would drop the other modules').
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_TEST_S = 1.0
# session fixtures costly enough that every module using them runs on the worker that builds them (`server` and
# `tight_server`: a `helios serve` of 2-2.5 GB each; two workers holding one each came near CI's memory)
SHARED_FIXTURES = frozenset({"qwen25_served", "qwen25_coder_oracle", "gemma3_270m_oracle", "smollm2_hf_model",
                             "server", "tight_server"})
GROUPS_ENV = "FLARE_XDIST_GROUPS"  # the file a worker writes the groups to and the scheduler reads them from


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def groups_of(items) -> dict[str, str]:
    """module -> its group (the first module of its group in collection order), for the modules joined by a
    SHARED_FIXTURES fixture they use (directly, through another fixture, or by a gguf_oracle mark)."""
    parent: dict[str, str] = {}

    def find(m: str) -> str:
        while parent.setdefault(m, m) != m:
            m = parent[m]
        return m

    owner: dict[str, str] = {}  # shared fixture -> the first module that uses it
    order: dict[str, int] = {}
    for item in items:
        module = _module(item.nodeid)
        order.setdefault(module, len(order))
        used = SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        used |= {mark.args[0] for mark in item.iter_markers("gguf_oracle")}
        for name in used:
            a, b = find(module), find(owner.setdefault(name, module))
            if a != b:
                parent[max(a, b, key=order.get)] = min(a, b, key=order.get)
    return {m: find(m) for m in parent}


def pytest_configure(config):
    # the controller names the file before its workers start (they inherit the environment)
    if getattr(config.option, "dist", "no") == "loadgroup" and "PYTEST_XDIST_WORKER" not in os.environ:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="flare-xdist-groups-", suffix=".json")
        os.close(fd)
        os.environ[GROUPS_ENV] = path


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and os.environ.get(GROUPS_ENV):
        Path(os.environ.pop(GROUPS_ENV)).unlink(missing_ok=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """A worker writes the groups of its collection for the scheduler (NOTE: not xdist_group marks: xdist 3.8
    appends a mark's group to the node id through Item._nodeid, which pytest 9 no longer reads)."""
    path = os.environ.get(GROUPS_ENV)
    if path and "PYTEST_XDIST_WORKER" in os.environ:
        tmp = f"{path}.{os.environ['PYTEST_XDIST_WORKER']}"
        Path(tmp).write_text(json.dumps(groups_of(items)))
        os.replace(tmp, path)  # every worker collects the same tests: the same groups


def _costs() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup as `make test` runs it: a module's tests, or a group's, are one unit; costliest first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    costs = _costs()

    class ModuleScheduling(LoadScopeScheduling):
        groups: dict[str, str] = {}
        module_counts: dict[str, int] = {}

        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return self.groups.get(module, module)

        def _cost(self, scope: str) -> float:
            modules = [_module(nodeid) for nodeid in self.workqueue[scope]]
            return sum(costs[m] / self.module_counts[m] if m in costs else DEFAULT_TEST_S for m in modules)

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:
                # every worker has collected (and so written the groups) before it reports its collection
                try:
                    self.groups = json.loads(Path(os.environ[GROUPS_ENV]).read_text())
                except (KeyError, OSError, ValueError):
                    self.groups = {}
                counts: dict[str, int] = {}
                for nodeid in next(iter(self.registered_collections.values()), []):
                    counts[_module(nodeid)] = counts.get(_module(nodeid), 0) + 1
                self.module_counts = counts
            super().schedule()

        def _assign_work_unit(self, node) -> None:
            scope = max(self.workqueue, key=self._cost)
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


# ---------------------------------------------------------------- FLARE_STORE_DURATIONS: the figures above

_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if os.environ.get("FLARE_STORE_DURATIONS") and "PYTEST_XDIST_WORKER" not in os.environ:
        module = _module(report.nodeid)
        _SPENT[module] = _SPENT.get(module, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FLARE_STORE_DURATIONS")
    if path and _SPENT and "PYTEST_XDIST_WORKER" not in os.environ:
        Path(path).write_text(json.dumps({m: round(s, 1) for m, s in sorted(_SPENT.items())}, indent=0) + "\n")
