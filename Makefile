# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint setup clean

# torch when $(PYTHON) has none: 2.13.0, which this project's machines hold as a local CPU wheel.
# Elsewhere plain pip fetches the multi-GB CUDA build on Linux; for a CPU build, install one into
# $(PYTHON) first (pip install torch --index-url https://download.pytorch.org/whl/cpu), or give
# make TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# a torch $(PYTHON) already has is kept: a .pth puts the site-packages holding it after the
	# venv's own (--system-site-packages would not reach it when $(PYTHON) is itself a venv's)
	$(BIN)/python -c "import torch" 2>/dev/null || ! $(PYTHON) -c "import torch" 2>/dev/null || \
	    $(PYTHON) -c "import pathlib, torch; print(pathlib.Path(torch.__file__).parents[1])" \
	    > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/torch-there.pth"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
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
