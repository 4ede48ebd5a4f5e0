# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv if missing and installs torch==2.13.0 (CPU) *before* the project, with
# constraints.txt on every pip call so that pip can never resolve another torch.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PIP) -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hookscope demo $(ARGS)

# The browser tests open the HTML report in Debian's headless chromium; install it when missing.
test: $(STAMP)
	command -v chromium >/dev/null || (apt-get install -y -q chromium >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null))
	$(PY) -m pytest $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/bench_capture.py
	$(PY) benchmarks/bench_monitor.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis hookscope-demo
