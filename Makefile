# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: this machine holds 2.13.0 as a local CPU wheel (no multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/drift demo --out drift-out

test: $(STAMP)
	$(BIN)/ruff check driftcli tests benchmarks examples
	# the type check (docs/contributing.md#types) runs beside the suite, which starts on both
	# cores of a 2-core CI machine (docs/contributing.md#the-test-suite): a cold mypy is a
	# minute and a half of one core; either failing fails the target
	$(BIN)/mypy & types=$$!; $(BIN)/python -m pytest -q -n 2 --dist worksteal; suite=$$?; \
	    wait $$types && exit $$suite

# the inner loop while developing: everything but the tests marked slow (make test runs them)
test-fast: $(STAMP)
	$(BIN)/ruff check driftcli tests benchmarks examples
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow"

clean:
	rm -rf $(VENV) drift-out .pytest_cache
