# Two commands for a new user: `make demo` and `make test`. Both build .venv on first use.
# torch is installed first, pinned, and every later pip call is constrained to that pin:
# any other torch spec would pull a multi-gigabyte CUDA build onto a CPU machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench bench-smoke install browser postgres tools clean gpu-wheels gpu-ray

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/elastron demo

# The web UI's tests drive Debian's chromium through its chromedriver (no browser download).
# Installed when missing and apt-get can run (root, as on CI); otherwise those tests skip and
# name what is missing.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver (Debian) for the web UI's browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "no chromium/chromedriver and no root apt-get: the browser tests will skip (apt-get install chromium chromium-driver)"; fi

# The store's tests run against a throwaway PostgreSQL cluster (initdb + pg_ctl from Debian's
# postgresql; the package's own cluster is not used). Installed like chromium above.
postgres:
	@if command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing postgresql (Debian) for the store's Postgres tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else echo "no PostgreSQL server and no root apt-get: the Postgres tests will skip (apt-get install postgresql)"; fi

# The deploy tests' promtool/prometheus, helm and dclint, into .tools/ (deploy/tools/install-tools.sh:
# idempotent, silent when they are in place). A tool that cannot be installed is named here and
# its tests skip; under ELASTRON_REQUIRE_TOOLS=1 (.ci/run) they fail instead (tests/tools.py).
tools:
	@bash deploy/tools/install-tools.sh >/dev/null || echo "deploy/tools/install-tools.sh failed: the tests that need its tools will skip"

# TEST_WORKERS=2: two pytest-xdist workers, the Ray tests (one group, one shared cluster:
# tests/conftest.py) on one, everything else on both. For machines with cores to spare: on 2
# cores the suite is CPU-bound (~80 % busy in one process), and two workers took longer than one
# (2394 s against 2252 s) with Ray tests overrunning their waits (issue 52).
# The default, 0, runs the suite in this one process.
TEST_WORKERS ?= 0
test: $(STAMP) browser postgres tools
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup) --durations=30 tests

# Every bench in bench/, its JSON lines appended to runs/bench/<commit>.jsonl (tagged with the
# commit) so two commits can be compared; `make bench-smoke` is the seconds-long run CI does.
bench: $(STAMP)
	$(PY) scripts/run_benches.py --out runs/bench

bench-smoke: $(STAMP)
	$(PY) scripts/run_benches.py --smoke --out runs/bench

# Wheels the GPU image's python lacks (scripts/gpu-wheels.txt says why each), for cp312 manylinux
# x86_64, into build/gpu-wheels/ to travel with a GPU run (64 MiB limit for all that travels, so
# fail over 60 MiB). Any python with pip; no constraints file; --no-deps, so no torch is resolved.
GPU_WHEELS := build/gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS)
	PIP_CONSTRAINT= $(PYTHON) -m pip download --only-binary=:all: --no-deps --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
		-r scripts/gpu-wheels.txt -d $(GPU_WHEELS)
	@size=$$(du -sb $(GPU_WHEELS) | cut -f1); echo "$(GPU_WHEELS): $$size bytes"; \
	test $$size -le 62914560 || { echo "$(GPU_WHEELS) is over 60 MiB"; exit 1; }

# Ray, torchft and pydantic & co. for the GPU machines, trimmed and xz-packed into
# build/gpu-ray/site.tar.xz (~34 MB; Ray's wheel alone is 79 MB): scripts/gpu_ray_bundle.sh says how.
gpu-ray:
	PYTHON=$(PYTHON) bash scripts/gpu_ray_bundle.sh

clean:
	rm -rf $(VENV) runs
