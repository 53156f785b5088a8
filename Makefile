# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DEMO_CASTS := -c fp8_e4m3 -c mxfp8_e4m3 -c mxfp8_e4m3_ceil -c nvfp4

.PHONY: demo test lint setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: this machine holds 2.13.0 as a local CPU wheel (no multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/drift formats
	$(BIN)/drift formats --presets
	$(BIN)/drift verify-formats --quick --out drift-out
	$(BIN)/python examples/make_checkpoint.py drift-out/example.safetensors
	$(BIN)/drift clip-rate drift-out/example.safetensors $(DEMO_CASTS) --out drift-out
	$(BIN)/drift underflow-rate drift-out/example.safetensors $(DEMO_CASTS) --out drift-out
	$(BIN)/drift error-bias drift-out/example.safetensors $(DEMO_CASTS) --out drift-out
	$(BIN)/drift report drift-out --html drift-out/report.html

test: $(STAMP)
	$(BIN)/ruff check driftcli tests benchmarks examples
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) drift-out .pytest_cache
