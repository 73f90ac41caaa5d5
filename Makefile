# Flare: `make serve` and `make test` each work alone on a fresh clone.
PY      := .venv/bin/python
STAMP   := .venv/.installed
CORE    := cores/build/smollm2-135m-instruct
HOST    ?= 127.0.0.1
PORT    ?= 8000
PYTEST_ARGS ?=
# `make test` on this many pytest-xdist workers (CI: 2 cores); tests/scheduling.py says how it splits the suite
TEST_WORKERS ?= 2
# the coding agents tests/server/test_coding_clients.py drives (versions pinned by clients/package-lock.json)
CLIENTS := clients/node_modules/.installed

.PHONY: setup core clients serve test test-gpu bench schemas lint clean

setup: $(STAMP)

# torch first, pinned, so later installs find it satisfied (a looser spec would pull a CUDA build).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,api-test]'
	touch $(STAMP)

core: $(CORE)/core.toml

$(CORE)/core.toml: $(STAMP) cores/smollm2-135m-instruct.toml
	.venv/bin/ignition build cores/smollm2-135m-instruct.toml

# Codex and Claude Code from npm into the ignored clients/node_modules (npm ci: exactly the lock file's versions)
clients: $(CLIENTS)

$(CLIENTS): clients/package.json clients/package-lock.json
	npm ci --prefix clients --no-audit --no-fund
	touch $(CLIENTS)

serve: core
	.venv/bin/helios serve $(CORE) --host $(HOST) --port $(PORT)

test: core clients
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-gpu: setup
	FLARE_RUN_CUDA_TESTS=1 $(PY) -m pytest -q -m gpu tests/gpu

bench: core
	$(PY) benchmarks/engine.py

schemas: setup
	$(PY) -m helios.schemas schemas

lint: setup
	$(PY) -m compileall -q helios ignition tests benchmarks

clean:
	rm -rf cores/build .cache
