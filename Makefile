# stagetree: the two commands a new machine needs are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: venv install test lint typecheck unit services browser proto demo cluster clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Reinstall when the dependency list changes. torch comes first, pinned (TORCH): pyproject asks for a
# range, which the pinned CPU wheel satisfies, so pip keeps it instead of fetching another build. The pin
# is repeated in the project's install: without it, pip's resolver backtracks through older torch releases
# (gigabytes of CUDA wheels) while it settles boto3/botocore between moto and s3fs.
TORCH ?= torch==2.13.0
DEMO_STAMP := $(VENV)/.installed-embedded

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q "$(TORCH)" -e ".[dev]"
	touch $(STAMP)

# What `make demo` needs: the embedded extra, no dev tools.
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q "$(TORCH)" -e ".[embedded]"
	touch $(DEMO_STAMP)

venv: $(STAMP)

# Start PostgreSQL, Redis and moto's S3 server when they are not answering (the integration tests need
# them; tests read the S3 server's URL from STAGETREE_TEST_S3_URL, and start a private one when it is down).
MOTO_PORT ?= 5077
S3_URL := http://127.0.0.1:$(MOTO_PORT)
services: $(STAMP)
	@$(BIN)/python -c "import urllib.request as u; u.urlopen('$(S3_URL)/moto-api/', timeout=2)" 2>/dev/null || (nohup $(BIN)/moto_server -H 127.0.0.1 -p $(MOTO_PORT) >/tmp/stagetree-moto-$(MOTO_PORT).log 2>&1 &)
	@pg_isready -h 127.0.0.1 -p 5432 -q || pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql) main start
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
	@for i in $$(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
	@# kubectl renders deploy/kubernetes offline (tests/unit/test_kubernetes.py): from apt when a configured
	@# repository has it (Kubernetes' or Google Cloud's), else those tests are skipped with the reason
	@command -v kubectl >/dev/null || { apt-cache show kubectl >/dev/null 2>&1 \
	  && echo "installing kubectl (apt)" && apt-get install -y -q kubectl >/dev/null; } \
	  || echo "note: no kubectl; tests/unit/test_kubernetes.py will be skipped (https://kubernetes.io/docs/tasks/tools/)"

# The browser tests drive Debian's Chromium through Playwright (its own browser download cannot work here).
browser:
	@test -x /usr/bin/chromium || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

lint: $(STAMP)
	$(BIN)/ruff check services tests examples scripts
	$(BIN)/ruff format --check services tests examples scripts

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) services browser lint typecheck
	STAGETREE_TEST_S3_URL=$${STAGETREE_TEST_S3_URL:-$(S3_URL)} $(BIN)/python -m pytest -q

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
